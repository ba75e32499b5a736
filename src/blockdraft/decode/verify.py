"""Verification of a drafted block against the target: pure tensor functions, no model state.

Vocabulary (shared with the engine and the benchmark):
- a step verifies G drafted tokens d_1..d_G, using target logits at G+1 positions (the target saw the last committed
  token followed by the G drafts, so row i predicts the token after d_i, row 0 the token after the committed one);
- **accepted**: the longest prefix d_1..d_a that passes (greedy: d_i equals the target's argmax; sampling: d_i passes
  the test u * q(d_i) < p(d_i));
- **recovered**: when d_{a+1} is rejected, the replacement token drawn from norm(max(0, p - q)) at that position;
- **bonus**: when all G drafts are accepted, one extra token drawn from the target's row G;
- a step therefore always commits a + 1 tokens (1 <= a + 1 <= G + 1): accepted drafts + one recovered/bonus token.

With these rules the committed sequence is distributed exactly as the target's own (greedy: identical tokens).
"""

from __future__ import annotations

import torch

from .sampling import argmax


def _check(draft_tokens: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    assert draft_tokens.dim() == 2, f"draft_tokens must be [B, G], got {tuple(draft_tokens.shape)}"
    b, g = draft_tokens.shape
    assert target.dim() == 3 and target.shape[:2] == (b, g + 1), (
        f"target logits/probs must be [B, G+1, V] = [{b}, {g + 1}, V], got {tuple(target.shape)}"
    )
    return b, g


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    draft_tokens: [B, G] int64; target_logits: [B, G+1, V].
    Returns (tokens [B, G+1], num_accepted [B]); row b commits tokens[b, :num_accepted[b] + 1].
    """
    _check(draft_tokens, target_logits)
    posterior = argmax(target_logits)  # [B, G+1]
    matches = draft_tokens == posterior[:, :-1]
    num_accepted = matches.to(torch.int64).cumprod(dim=1).sum(dim=1)
    # Accepted drafts equal the target's argmax, so the committed tokens are simply the argmax row.
    return posterior, num_accepted


def rejection_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    draft_tokens: [B, G] int64, drawn from draft_probs.
    draft_probs: [B, G, V] float, the distribution each draft was sampled from (q); None means each draft was
        proposed deterministically (a point mass, as prompt lookup or an oracle does).
    target_probs: [B, G+1, V] float, processed target distribution (p) at the G+1 verified positions.
    Returns (tokens [B, G+1], num_accepted [B]); row b commits tokens[b, :num_accepted[b] + 1].
    """
    b, g = _check(draft_tokens, target_probs)
    idx = draft_tokens.unsqueeze(-1)
    p_draft = target_probs[:, :g].gather(-1, idx).squeeze(-1)  # [B, G]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        assert draft_probs.shape == (b, g, target_probs.shape[-1]), (
            f"draft_probs must be [B, G, V], got {tuple(draft_probs.shape)}"
        )
        q_draft = draft_probs.gather(-1, idx).squeeze(-1)
    u = torch.rand(p_draft.shape, generator=generator, device=p_draft.device)
    accept = u * q_draft < p_draft  # u < p/q without dividing by a possibly tiny q
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]

    rows = torch.arange(b, device=draft_tokens.device)
    p_next = target_probs[rows, num_accepted]  # [B, V]: row a is where the recovered/bonus token is drawn
    rejected = num_accepted < g
    if rejected.any():
        a = num_accepted.clamp(max=g - 1)
        if draft_probs is None:
            residual = p_next.scatter(-1, draft_tokens[rows, a].unsqueeze(-1), 0.0)
        else:
            residual = (p_next - draft_probs[rows, a]).clamp_min(0.0)
        mass = residual.sum(-1, keepdim=True)
        # mass == 0 only when p == q at that row, where rejection has probability 0; keep p as a safe fallback.
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
        p_next = torch.where(rejected.unsqueeze(-1), residual, p_next)
    last = torch.multinomial(p_next, 1, generator=generator).squeeze(-1)  # [B]

    tokens = draft_tokens.new_zeros(b, g + 1)
    tokens[:, :g] = draft_tokens
    tokens[rows, num_accepted] = last
    return tokens, num_accepted
