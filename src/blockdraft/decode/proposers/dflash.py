"""DFlash proposer: one forward of the block-diffusion draft proposes B-1 tokens in parallel."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn

from ...models.cache import KVCache
from ...config import SamplingParams
from ...models.copy_gate import gated_ids, gated_logits, gated_probs_to_vocab
from ...models.draft import DFlashDraftModel, check_compatible, decode_block_size
from ...models.draft_lean import LeanDraft
from ...models.lean import Linear, packed_linear_available
from ..sampling import logits_to_probs, sample
from ...models.target import TargetModel
from . import Proposer
from ..tree import Tree
from ...models.ngram import lookup_continuation
from ...models.selector import ChainView, choose_chain, choose_chain_greedy


class DFlashProposer(Proposer):
    name = "dflash"

    def __init__(self, draft: DFlashDraftModel, target: TargetModel, block_size: int | None = None,
                 denoise_steps: int = 1, lean: bool | LeanDraft = True, draft_weights: str = "bf16") -> None:
        """block_size: at most block_size - 1 drafts per step (None: `draft.decode_block_size`; the engine's width
        policy chooses how many of them a step drafts). lean: run the draft through `LeanDraft` (fused, prepacked
        weights in `draft_weights`, "bf16", "int8" or "int4"; a snapshot of the draft's weights now), else through the
        module (the reference the tests compare with); a LeanDraft of this draft is shared as it is (it holds no
        per-sequence state: the batched engine's per-row clones use one)."""
        check_compatible(draft.config, target)
        bs = decode_block_size(draft, block_size)
        if denoise_steps < 1:
            raise ValueError("denoise_steps must be >= 1")
        self.draft, self.target = draft, target
        self.block_size = bs
        self.denoise_steps = denoise_steps
        # A draft trained with --no-target-features (the paper's ablation) has no context: the block sees itself only.
        self.layer_ids = draft.context_layer_ids
        self.use_context = bool(self.layer_ids)
        cfg = draft.config
        self.vocab_ids = draft.vocab_ids  # [Vd] target ids of a reduced draft vocabulary, or None
        self._head = None  # the reduced LM head (its rows gathered once, prepacked for bf16), built on first use
        self.ctx = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, capacity=512,
                           dtype=draft.dtype, device=target.device)
        if isinstance(lean, LeanDraft) or not lean:
            self.lean = lean or None
        else:
            self.lean = LeanDraft(draft, weights=draft_weights)
        # A draft with `next_token_feature` also reads, at each context position, the embedding of the token after
        # it; for the newest position that token (the next anchor) is only known when drafting starts, so its
        # features wait in `_pending` until then.
        self.next_token = cfg.next_token_feature
        self._pending: list[torch.Tensor] = []
        # A draft with a copy gate (copy_gate.py) also scores prompt lookup's continuation of the committed tokens.
        self.gate = draft.copy_gate
        # A draft with a chain selector (selector.py) chooses a one-pass block's rows in order among its top-k.
        self.selector = ChainView(draft.selector) if draft.selector is not None else None
        self._vocab_map = None
        if self.gate is not None and self.vocab_ids is not None:
            self._vocab_map = torch.full((target.vocab_size,), -1, dtype=torch.long, device=target.device)
            self._vocab_map[self.vocab_ids] = torch.arange(self.vocab_ids.numel(), device=target.device)

    def fork(self) -> "DFlashProposer":
        """Another sequence's proposer around the same draft: the fused weights (and the reduced head) are shared,
        the context cache and acceptance rates are its own."""
        other = type(self)(self.draft, self.target, self.block_size, self.denoise_steps,
                           lean=self.lean if self.lean is not None else False)
        other._head, other.selector = self._head, self.selector
        return other

    def _append_context(self, features: torch.Tensor, next_ids: torch.Tensor | None = None) -> None:
        """features [1, m, K*H] of the next m context positions; next_ids [m]: the tokens after them."""
        start = self.ctx.length
        pos = torch.arange(start, start + features.shape[1], device=features.device).unsqueeze(0)
        if next_ids is not None:
            emb = self.draft.next_token_input(self.target.embed(next_ids.unsqueeze(0)))
            features = torch.cat([features.to(emb.dtype), emb], dim=-1)
        if self.lean is not None:
            self.lean.append_context(features, pos, self.ctx)
        else:
            self.ctx.append(*self.draft.context_kv(features, pos))

    def _add(self, features: torch.Tensor) -> None:
        # projected when the draft next runs (`_flush`): steps that skip the draft skip this work too, and a
        # draft with `next_token_feature` needs the token after each position, known only then
        self._pending.append(features)

    def _flush(self, tokens: torch.Tensor) -> None:
        """Append the waiting context positions now that `tokens` [n] (through the anchor) are known."""
        if not self._pending:
            return
        feats = torch.cat(self._pending, dim=1) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        start = self.ctx.length
        nxt = tokens[start + 1: start + 1 + feats.shape[1]] if self.next_token else None
        self._append_context(feats, nxt)

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        self.ctx.reset()
        self._pending = []
        if self.use_context:
            assert features is not None and features.dim() == 3, "DFlash needs the prompt's features [1, n0, K*H]"
            self._add(features)

    @torch.no_grad()
    def accept(self, tree: Tree, path: list[int], features: torch.Tensor | None) -> None:
        assert features is not None and features.shape[1] == len(path), "features of the verified positions"
        self._add(features)

    def _scores(self, tokens: torch.Tensor, block: torch.Tensor) -> tuple[torch.Tensor, Callable, Callable]:
        """tokens [n] committed, block [g+1] (anchor = tokens[-1], then MASK or fixed tokens) -> (scores [g, Vs]
        fp32, to_ids: column indices [...] -> target ids, to_vocab: [g, Vs] probabilities -> [g, V]). Vs = Vd, or
        Vd + 1 with a copy gate (its last column: a lookup candidate outside the draft vocabulary)."""
        hidden = self._hidden(block, tokens.shape[0] - 1)
        return self._score(tokens, hidden, self._head_logits(hidden))

    def _score(self, tokens: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor
               ) -> tuple[torch.Tensor, Callable, Callable]:
        """The draft's hidden states [g, H] and logits [g, Vd] of a block after tokens [n] -> `_scores`' triple."""
        g = hidden.shape[0]
        logits = logits.float()
        vocab_ids, v = self.vocab_ids, self.target.vocab_size
        if self.gate is None:
            if vocab_ids is None:
                return logits, (lambda i: i), (lambda p: p)
            return (logits, (lambda i: vocab_ids[i]),
                    (lambda p: p.new_zeros(p.shape[0], v).index_copy_(1, vocab_ids, p)))
        cont, n = lookup_continuation(tokens, g)
        copy = torch.full((g,), -1, dtype=torch.long, device=tokens.device)
        copy[: cont.numel()] = cont
        k = torch.arange(1, g + 1, device=tokens.device)
        scores = gated_logits(logits, hidden, self.gate, copy, torch.full_like(k, max(n, 1)), k,
                              self.target.lm_head.weight, self._vocab_map,
                              softcap=self.target.softcap)
        vd = logits.shape[1]
        return (scores, (lambda i: gated_ids(i, copy, vocab_ids, vd)),
                (lambda p: gated_probs_to_vocab(p, copy, vocab_ids, v)))

    def _hidden(self, block: torch.Tensor, start: int) -> torch.Tensor:
        """block [Q] token ids (MASK where undecided) at positions start..start+Q-1 -> the draft's final-normed
        hidden states [Q-1, H] at positions 1..Q-1 of the block (row j predicts block[j+1])."""
        pos = torch.arange(start, start + block.shape[0], device=block.device).unsqueeze(0)
        embeds = self.target.embed(block.unsqueeze(0))
        if self.lean is not None:
            return self.lean.forward(embeds, pos, self.ctx)[0, 1:].to(self.target.dtype)
        ks = [self.ctx.view(i)[0] for i in range(self.ctx.num_layers)]
        vs = [self.ctx.view(i)[1] for i in range(self.ctx.num_layers)]
        return self.draft(embeds, pos, ks, vs)[0, 1:].to(self.target.dtype)

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., Vd] (Vd = V unless the draft vocabulary is reduced)."""
        if (self.vocab_ids is None or self.target.softcap
                or getattr(self.target, "quantized_head", False)):  # the quantized head's rows, gathered once
            return self.target.logits(hidden, self.vocab_ids)
        if self._head is None:
            # gathering V' rows of the head at every step costs more than the product itself: do it once
            lm = self.target.lm_head
            bias = lm.bias[self.vocab_ids] if getattr(lm, "bias", None) is not None else None
            self._head = Linear(lm.weight[self.vocab_ids], bias, packed_linear_available(lm.weight.dtype,
                                                                                         lm.weight.device))
        return self._head(hidden)

    @torch.no_grad()
    def distributions(self, tokens: torch.Tensor, num_draft: int, sampling: SamplingParams) -> torch.Tensor:
        """The draft's distribution at each of the next G = min(num_draft, block_size - 1) positions from one
        forward, [G, V] over the target's vocabulary (zero outside a reduced draft vocabulary): a softmax for greedy
        decoding (a confidence), else processed like the target's (temperature, top-k, top-p) for rejection
        sampling. A candidate tree (tree.py) is built from these rows."""
        return self.distributions_top(tokens, num_draft, sampling, 0)[0]

    @torch.no_grad()
    def distributions_top(self, tokens: torch.Tensor, num_draft: int, sampling: SamplingParams, k: int
                          ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """`distributions`, and with k > 0 each row's k most probable tokens: (q [G, V], (probs [G, k'], ids [G, k'])
        in descending order, k' = min(k, columns the draft scores)), else (q, None). The top entries are read from the
        draft's own columns (a reduced vocabulary, the copy gate's candidate): they are q's largest entries (each
        column is a different token of q), and a topk over 8k columns costs a fraction of one over the target's
        150k, which was a quarter of the tree proposer's time."""
        g = min(num_draft, self.block_size - 1)
        n = tokens.shape[0]
        assert g >= 1, "at least one position to draft"
        self._flush(tokens)
        assert self.ctx.length == (n - 1 if self.use_context else 0), "draft context out of step with the target"
        block = torch.full((g + 1,), self.draft.mask_token_id, dtype=torch.long, device=tokens.device)
        block[0] = tokens[-1]
        scores, to_ids, to_vocab = self._scores(tokens, block)  # [g, Vs]
        probs = scores.softmax(-1) if sampling.greedy else logits_to_probs(scores, sampling)
        top = None
        if k > 0:
            vals, cols = probs.topk(min(k, probs.shape[-1]), dim=-1)
            top = (vals, to_ids(cols))
        return to_vocab(probs), top

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, num_draft: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Tree:
        block = self._open(tokens, num_draft)
        if block is None:
            return Tree.chain(tokens[-1])
        g = block.shape[0] - 1
        out = torch.zeros(g, dtype=torch.long, device=tokens.device)
        q = None if sampling.greedy else torch.zeros(g, self.target.vocab_size, device=tokens.device)
        fixed = torch.zeros(g, dtype=torch.bool, device=tokens.device)
        steps = min(self.denoise_steps, g)
        if self.selector is not None and steps == 1:
            hidden = self._hidden(block, tokens.shape[0] - 1)
            return self._chain(tokens, *self._score(tokens, hidden, self._head_logits(hidden)), hidden, sampling,
                               generator)
        if steps == 1 and sampling.greedy:  # one pass fixes every position: what the loop below does, in one line
            scores, to_ids, _ = self._scores(tokens, block)
            return Tree.chain(tokens[-1], to_ids(scores.argmax(-1)))
        for s in range(steps):
            scores, to_ids, to_vocab = self._scores(tokens, block)  # [g, Vs]
            if sampling.greedy and steps == 1:
                cand, conf, probs = scores.argmax(-1), None, None  # one pass: no confidence ranking needed
            elif sampling.greedy:
                conf, cand = scores.softmax(-1).max(-1)
                probs = None
            else:
                probs = logits_to_probs(scores, sampling)
                cand = sample(probs, generator)
                conf = probs.gather(-1, cand.unsqueeze(-1)).squeeze(-1)
            # back to target ids; q keeps zero mass outside the draft vocabulary (and the copy gate's candidate),
            # which rejection sampling handles like any other q (the output distribution is still the target's)
            cand = to_ids(cand)
            if probs is not None:
                probs = to_vocab(probs)
            free = (~fixed).nonzero().squeeze(-1)
            k = len(free) if s == steps - 1 else math.ceil(len(free) / (steps - s))
            if conf is None:
                chosen = free  # the single pass fixes every position
            elif sampling.greedy:
                # Greedy verification only compares tokens, so any order of unmasking stays lossless: keep the
                # most confident positions (the remasking schedule of block-diffusion LMs).
                chosen = free[conf[free].topk(k).indices]
            else:
                # Rejection sampling needs q_i(d_i | d_<i). Unmasking strictly left to right keeps each draw
                # conditioned only on the positions before it, so the recorded q rows are those conditionals.
                chosen = free[:k]
            out[chosen] = cand[chosen]
            if probs is not None:
                q[chosen] = probs[chosen]
            fixed[chosen] = True
            block[1:][chosen] = cand[chosen]
        return Tree.chain(tokens[-1], out, q)

    def _chain(self, tokens: torch.Tensor, scores: torch.Tensor, to_ids: Callable, to_vocab: Callable,
               hidden: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> Tree:
        """A one-pass block's rows chosen in order by the chain selector: scores [g, Vs] and hidden [g, H] from
        `_score`. Sampling draws row k from the selector's distribution given the rows before it, so the recorded q
        rows are the conditionals rejection sampling needs."""
        if sampling.greedy:
            # a plain embedding lookup lets the chain run natively (a scaled one, Gemma's, embeds in torch)
            emb = self.target.embed_tokens
            cols = choose_chain_greedy(self.selector, scores, hidden, int(tokens[-1]), to_ids, self.target.embed,
                                       self.target.lm_head.weight, emb.weight if type(emb) is nn.Embedding else None)
            return Tree.chain(tokens[-1], to_ids(cols))

        # over a row's K candidates: temperature, top-k and top-p give the probabilities they give over the full
        # row with every other column at -inf (those have no mass either way)
        def pick(k: int, cand: torch.Tensor) -> int:
            return int(sample(logits_to_probs(cand.unsqueeze(0), sampling), generator)[0])
        cols, chain_scores = choose_chain(self.selector, scores, hidden, int(tokens[-1]), to_ids, self.target.embed,
                                          self.target.lm_head.weight, pick)
        return Tree.chain(tokens[-1], to_ids(cols), to_vocab(logits_to_probs(chain_scores, sampling)))

    def _open(self, tokens: torch.Tensor, num_draft: int) -> torch.Tensor | None:
        """Start a proposal of g = min(num_draft, block_size - 1) tokens after tokens [n]: bring the draft's context
        up to date and return the block [g + 1] (the anchor, then MASK), or None when this step drafts nothing."""
        g = min(num_draft, self.block_size - 1)
        if g <= 0:
            return None
        n = tokens.shape[0]
        self._flush(tokens)
        assert self.ctx.length == (n - 1 if self.use_context else 0), "draft context out of step with the target"
        block = torch.full((g + 1,), self.draft.mask_token_id, dtype=torch.long, device=tokens.device)
        block[0] = tokens[-1]
        return block

    @classmethod
    @torch.no_grad()
    def prepare_rows(cls, proposers: list["DFlashProposer"], tokens: list[torch.Tensor],
                     num_drafts: list[int]) -> None:
        """Project the context positions verified since each drafting row last drafted (its prompt's, on its first
        step) into its draft context: work proportional to the positions waiting, which a row that skips drafting
        defers rather than saves."""
        for p, t, g in zip(proposers, tokens, num_drafts):
            if g > 0 and p.block_size > 1:
                p._flush(t)

    @classmethod
    @torch.no_grad()
    def propose_rows(cls, proposers: list["DFlashProposer"], tokens: list[torch.Tensor], num_drafts: list[int],
                     samplings: list[SamplingParams], generators: list) -> list[Tree]:
        """One draft forward for every row whose proposer shares a `LeanDraft` and drafts in one pass (the
        weights are read once for all the blocks; each block attends to its own row's context); rows that denoise
        in several passes, or draft through the module, propose one by one. Each row gets what `propose` gives it
        alone: the same operations on its block (the native stack's rows are computed independently)."""
        out: list[Tree | None] = [None] * len(proposers)
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(proposers):
            if p.lean is None or p.denoise_steps > 1:
                out[i] = p.propose(tokens[i], num_drafts[i], samplings[i], generators[i])
            else:
                groups.setdefault(id(p.lean), []).append(i)
        for rows in groups.values():
            blocks = {i: proposers[i]._open(tokens[i], num_drafts[i]) for i in rows}
            for i in rows:
                if blocks[i] is None:
                    out[i] = Tree.chain(tokens[i][-1])
            rows = [i for i in rows if blocks[i] is not None]
            if not rows:
                continue
            first = proposers[rows[0]]
            ids = torch.cat([blocks[i] for i in rows])
            pos = torch.cat([torch.arange(tokens[i].shape[0] - 1, tokens[i].shape[0] - 1 + blocks[i].shape[0],
                                          device=ids.device) for i in rows])
            counts = [blocks[i].shape[0] for i in rows]
            hidden = first.lean.forward_rows(first.target.embed(ids.unsqueeze(0))[0], pos,
                                             [proposers[i].ctx for i in rows], counts)
            # the anchors' rows predict nothing: drop them, then one head product for every row
            keep = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
            keep[[sum(counts[:j]) for j in range(len(counts))]] = False  # each block's first row
            hidden = hidden[keep].to(first.target.dtype)
            logits = first._head_logits(hidden)
            o = 0
            for i in rows:
                p, g, smp = proposers[i], blocks[i].shape[0] - 1, samplings[i]
                scores, to_ids, to_vocab = p._score(tokens[i], hidden[o:o + g], logits[o:o + g])
                o += g
                if p.selector is not None:
                    out[i] = p._chain(tokens[i], scores, to_ids, to_vocab, hidden[o - g:o], smp, generators[i])
                elif smp.greedy:
                    out[i] = Tree.chain(tokens[i][-1], to_ids(scores.argmax(-1)))
                else:
                    probs = logits_to_probs(scores, smp)
                    out[i] = Tree.chain(tokens[i][-1], to_ids(sample(probs, generators[i])), to_vocab(probs))
        return out
