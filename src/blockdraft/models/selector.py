"""The chain selector: a block's rows chosen left to right, each among the draft's K best candidates and knowing the
token chosen for the row before it (blockdraft's own extension, after DFlash2's selector over the draft's top-k).

Why: one draft forward predicts every row of a block from MASK inputs, so row k cannot know which token row k-1
proposed; where the text can go two ways the rows mix them. Greedy verification only reads row k when rows 1..k-1
were accepted, that is when each equals the target's token, so conditioning row k on the token chosen for row k-1
conditions it on the truth whenever row k counts. And the right token is usually close: on the default target's
held-out answers (teacher-forced, the shipped draft, block 4) the draft's 16 best columns hold the target's token at
rows 1 / 2 / 3 94 / 90 / 85% of the time, its best column 78 / 70 / 61%.

What it computes, for block row k with the draft's final-normed hidden state h_k, the token p chosen for row k-1
(the anchor for row 1), the target's input embedding e and LM head W, and the row's scores s (the draft's logits,
through the copy gate if it has one):

    z_k     = W_out silu(W_in [rms(h_k); rms(e_p)] + b_in)
    s'_k(c) = s_k(c) + z_k . W[c]        for c among the K best columns of s_k, -inf elsewhere

so the hidden state moves by z_k and only the K candidates are scored again (K dot products, not a head product).
W_out starts at zero: a draft that gains a selector proposes what it proposed before (greedy) until training moves
it. Rows are chosen in order, so a block of g rows costs g calls of a small MLP after the draft's one forward.
Training (`train/selector.py`) keeps the draft frozen and fits the selector to the target's greedy tokens, with p
the true token before each row (what p is whenever the row is verified).

Chains read it (`dflash`, `dflash-adaptive`, greedy and sampled; sampling draws row k from the selector's
distribution given the rows drawn before it, the conditional rejection sampling needs); a candidate tree
(`dflash-tree`) and multi-pass denoising rank by the draft's own scores.

The selector is not part of the public DFlash layout: it is saved in its own file (`selector.safetensors`) beside
the draft's weights; engines that do not know it decode with the draft's own choices.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .quant import loaded_kernels

SELECTOR_WEIGHTS_NAME = "selector.safetensors"


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # both inputs at unit scale: a final-normed draft state and a raw token embedding differ much in scale
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ChainSelector(nn.Module):
    def __init__(self, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        if rank < 1 or top_k < 1:
            raise ValueError(f"a selector needs rank >= 1 and top_k >= 1 (got {rank}, {top_k})")
        self.hidden_size, self.top_k = hidden_size, top_k
        self.w_in = nn.Linear(2 * hidden_size, rank, bias=True)
        self.w_out = nn.Linear(rank, hidden_size, bias=False)
        with torch.no_grad():
            nn.init.normal_(self.w_in.weight, std=(2 * hidden_size) ** -0.5)
            self.w_in.bias.zero_()
            self.w_out.weight.zero_()

    # W_in [rms(h); rms(e)] + b in its two halves, as decoding computes it (`ChainView`): the hidden half for a
    # block's rows at once, the token half row by row as each row's previous token is chosen.
    def hidden_part(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> [R, rank] fp32: W_in's hidden columns applied, the bias added."""
        return F.linear(_rms(hidden.float()), self.w_in.weight[:, : self.hidden_size], self.w_in.bias)

    def token_part(self, prev_embeds: torch.Tensor) -> torch.Tensor:
        """prev_embeds [R, H] -> [R, rank] fp32: W_in's token columns applied."""
        return F.linear(_rms(prev_embeds.float()), self.w_in.weight[:, self.hidden_size:])

    def shift(self, hidden: torch.Tensor, prev_embeds: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] the rows' draft states, prev_embeds [R, H] the embeddings of the tokens before them ->
        z [R, H] fp32."""
        return self.w_out(F.silu(self.hidden_part(hidden) + self.token_part(prev_embeds)))

    def candidate_scores(self, top_scores: torch.Tensor, head_rows: torch.Tensor, hidden: torch.Tensor,
                         prev_embeds: torch.Tensor) -> torch.Tensor:
        """top_scores [R, K] the rows' K best scores, head_rows [R, K, H] the LM-head rows of those candidates,
        hidden / prev_embeds [R, H] -> the candidates' new scores [R, K] fp32 (what training fits)."""
        z = self.shift(hidden, prev_embeds)
        return top_scores.float() + torch.einsum("rkh,rh->rk", head_rows.float(), z)


class ChainView:
    """The selector as decoding runs it: its weights in fp32, the hidden half of the input layer applied to a
    block's rows in one product, and per row the fewest operations (an add, a silu, two matrix-vector products).
    Why: a block's chain is a few dozen operations on vectors of a few hundred numbers, where each torch operation
    costs ~10-30 us on 2 threads whatever its size; written as `candidate_scores` it came to ~0.8 ms a block on the
    default target, half the draft's step. (numpy would be cheaper per operation, but its own BLAS threads keep
    spinning after a product and took the cores from the target's verify: 2-3x slower verifies on the 1.5B target.)
    The token half of the input layer is kept per token id once computed (it depends on the token alone). Built once
    per draft and shared by its proposers; the selector's weights must not change afterwards.

    A greedy chain runs in one native call where it can (`choose_chain_greedy`); that call keeps its token parts in a
    [V, rank] table of its own, allocated untouched (memory becomes resident only for the tokens met)."""

    MAX_TOKENS = 1 << 16  # token parts kept (256-1,536 bytes each); the store starts again when full

    def __init__(self, selector: ChainSelector) -> None:
        w = selector.w_in.weight.detach().float()
        h = selector.hidden_size
        self.top_k = selector.top_k
        self.w_h, self.w_e = w[:, :h].contiguous(), w[:, h:].contiguous()  # [rank, H]
        self.b = selector.w_in.bias.detach().float().clone()
        self.w_out = selector.w_out.weight.detach().float().clone()  # [H, rank]
        self._token: dict[int, torch.Tensor] = {}
        self._table: torch.Tensor | None = None  # [V, rank] the native chain's token parts, where _have
        self._have: torch.Tensor | None = None  # [V] uint8

    def token_part(self, token: int, embed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        part = self._token.get(token)
        if part is None:
            if len(self._token) >= self.MAX_TOKENS:
                self._token.clear()
            e = embed(torch.tensor([token], device=self.w_e.device))[0]
            part = self._token[token] = torch.mv(self.w_e, _rms(e.float()))
        return part

    def hidden_part(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.b, _rms(hidden.float()), self.w_h.T)

    def native_chain(self, kernels, top_s: torch.Tensor, top_ids: torch.Tensor, hidden: torch.Tensor, anchor: int,
                     embed_weight: torch.Tensor, head_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy chain in one call of the kernels (`csrc/chain.h`): top_s [g, K] fp32 the rows' K best scores,
        top_ids [g, K] their target ids, hidden [g, H], embed_weight / head_weight [V, H] -> (chosen [g] indices into
        K, the candidates' scores [g, K])."""
        v = embed_weight.shape[0]
        if self._table is None or self._table.shape[0] != v:
            self._table = torch.empty(v, self.w_e.shape[0], dtype=torch.float32)
            self._have = torch.zeros(v, dtype=torch.uint8)
        return kernels.selector_chain(top_s.float().contiguous(), top_ids.contiguous(), hidden.contiguous(),
                                      int(anchor), self.w_h, self.w_e, self.b, self.w_out, embed_weight,
                                      head_weight, self._table, self._have)


def choose_chain(view: ChainView, scores: torch.Tensor, hidden: torch.Tensor, anchor: int,
                 to_ids: Callable[[torch.Tensor], torch.Tensor], embed: Callable[[torch.Tensor], torch.Tensor],
                 head_weight: torch.Tensor, pick: Callable[[int, torch.Tensor], int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose a block's g rows in order. scores [g, Vs] the draft's scores (fp32), hidden [g, H] its states, anchor
    the committed token before row 1, to_ids: column indices [g, ...] -> target ids (row-aware: a copy gate's last
    column is each row's own candidate), embed: ids [n] -> the target's input embeddings [n, H], head_weight [V, H]
    the target's LM head, pick(k, candidate scores [K] fp32) -> the index of row k's choice among its K candidates
    (the argmax, or a draw) -> (columns [g], the rows' scores [g, Vs]: the selector's over each row's K candidates,
    -inf elsewhere). Computes `ChainSelector.candidate_scores` for each row (`ChainView`)."""
    g = scores.shape[0]
    top_s, top_c = scores.topk(min(view.top_k, scores.shape[1]), dim=-1)  # [g, K]
    top_ids = to_ids(top_c)  # [g, K] target ids
    rows = head_weight[top_ids].float()  # [g, K, H]
    ids = top_ids.tolist()
    part = view.hidden_part(hidden)  # [g, rank]
    chosen, cand = [], []
    prev = int(anchor)
    for k in range(g):
        z = torch.mv(view.w_out, F.silu(part[k] + view.token_part(prev, embed)))  # [H]
        s = torch.addmv(top_s[k].float(), rows[k], z)  # [K]
        j = int(pick(k, s))
        chosen.append(j)
        cand.append(s)
        prev = ids[k][j]
    idx = torch.tensor(chosen, dtype=torch.long, device=scores.device).unsqueeze(1)
    out = torch.full(scores.shape, float("-inf"), dtype=torch.float32, device=scores.device)
    out.scatter_(1, top_c, torch.stack(cand))
    return top_c.gather(1, idx).squeeze(1), out


def _native_ready(hidden: torch.Tensor, embed_weight: torch.Tensor | None, head_weight: torch.Tensor) -> bool:
    ok = (torch.float32, torch.bfloat16)
    return (embed_weight is not None and embed_weight.dtype == head_weight.dtype and embed_weight.dtype in ok
            and hidden.dtype in ok and embed_weight.device.type == head_weight.device.type == hidden.device.type
            == "cpu" and embed_weight.is_contiguous() and head_weight.is_contiguous())


def choose_chain_greedy(view: ChainView, scores: torch.Tensor, hidden: torch.Tensor, anchor: int,
                        to_ids: Callable[[torch.Tensor], torch.Tensor], embed: Callable[[torch.Tensor], torch.Tensor],
                        head_weight: torch.Tensor, embed_weight: torch.Tensor | None = None) -> torch.Tensor:
    """`choose_chain` with each row's argmax -> the chosen columns [g]. embed_weight: the [V, H] table `embed` looks
    its ids up in, when it is a plain lookup (no scale): then, with the kernels loaded, the chain is one native call
    (`ChainView.native_chain`: the same formula in float32, summed in another order), else the torch chain."""
    kernels = loaded_kernels()
    if kernels is None or not _native_ready(hidden, embed_weight, head_weight):
        return choose_chain(view, scores, hidden, anchor, to_ids, embed, head_weight,
                            lambda k, cand: int(cand.argmax()))[0]
    top_s, top_c = scores.topk(min(view.top_k, scores.shape[1]), dim=-1)  # [g, K]
    chosen, _ = view.native_chain(kernels, top_s, to_ids(top_c), hidden, anchor, embed_weight, head_weight)
    return top_c.gather(1, chosen.unsqueeze(1)).squeeze(1)
