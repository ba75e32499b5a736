"""The verifier as a pure function: hand-built cases and a distribution-level losslessness check."""

import pytest
import torch

from blockdraft.decode.verify import greedy_verify, rejection_verify

V = 7
HI, LO = 100.0, -100.0  # one-hot logits: the target is certain
ACCEPT_ALL, FIRST_REJECTED = 3, 0


def one_hot_logits(tokens: list[int]) -> torch.Tensor:
    """[1, len(tokens), V] logits whose argmax (and, softmaxed, whose only mass) is each given token."""
    x = torch.full((1, len(tokens), V), LO)
    x[0, torch.arange(len(tokens)), torch.tensor(tokens)] = HI
    return x


def test_greedy_all_accepted_takes_bonus():
    drafts = torch.tensor([[1, 2, 3]])
    tokens, acc = greedy_verify(drafts, one_hot_logits([1, 2, 3, 5]))
    assert acc.tolist() == [ACCEPT_ALL]
    assert tokens[0, : ACCEPT_ALL + 1].tolist() == [1, 2, 3, 5]  # the last one is the bonus


def test_greedy_first_rejected_recovers_target_token():
    tokens, acc = greedy_verify(torch.tensor([[4, 2, 3]]), one_hot_logits([1, 2, 3, 5]))
    assert acc.tolist() == [FIRST_REJECTED]
    assert tokens[0, :1].tolist() == [1]


def test_greedy_later_match_after_mismatch_does_not_count():
    tokens, acc = greedy_verify(torch.tensor([[1, 6, 3]]), one_hot_logits([1, 2, 3, 5]))
    assert acc.tolist() == [1]
    assert tokens[0, :2].tolist() == [1, 2]


def test_greedy_batch_rows_are_independent():
    drafts = torch.tensor([[1, 2], [0, 0]])
    logits = torch.cat([one_hot_logits([1, 2, 4]), one_hot_logits([0, 3, 4])])
    tokens, acc = greedy_verify(drafts, logits)
    assert acc.tolist() == [2, 1]
    assert tokens[1, :2].tolist() == [0, 3]


def test_shapes_are_checked():
    with pytest.raises(AssertionError):
        greedy_verify(torch.tensor([[1, 2]]), one_hot_logits([1, 2]))


def test_rejection_certain_target_behaves_like_greedy():
    g = torch.Generator().manual_seed(0)
    p = one_hot_logits([1, 2, 3, 5]).softmax(-1)
    q = torch.full((1, 3, V), 1.0 / V)
    tokens, acc = rejection_verify(torch.tensor([[1, 2, 3]]), q, p, g)
    assert acc.tolist() == [ACCEPT_ALL] and tokens[0].tolist() == [1, 2, 3, 5]
    tokens, acc = rejection_verify(torch.tensor([[1, 4, 3]]), q, p, g)
    assert acc.tolist() == [1] and tokens[0, :2].tolist() == [1, 2]  # recovered = the only token p allows


def test_rejection_point_mass_draft():
    """draft_probs=None (deterministic proposer): the recovered token never equals the rejected draft."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[[0.5, 0.5, 0, 0, 0, 0, 0]] * 2])
    for _ in range(50):
        tokens, acc = rejection_verify(torch.tensor([[0]]), None, p, g)
        if acc.item() == 0:
            assert tokens[0, 0].item() == 1


def _bigram(seed: int, v: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(v, v, generator=g) * 1.5, dim=-1)  # P[prev, next]


def test_rejection_sampling_is_lossless_over_two_tokens():
    """Run speculative steps against a bigram target with a mismatched draft until two tokens are committed and
    compare their joint distribution with the target's, by a chi-square test on 16 cells (df = 15).

    Threshold 42.6 is the 0.9999 quantile of chi2(15): with a random seed the false-failure rate would be 1e-4;
    the seed is fixed, so the test is deterministic.
    """
    v, g_len, n = 4, 3, 20000
    target = _bigram(1, v)
    draft = torch.softmax(torch.randn(g_len, v, generator=torch.Generator().manual_seed(2)), -1)  # q_i, i=1..G
    gen = torch.Generator().manual_seed(3)
    start = 0
    counts = torch.zeros(v, v)
    for _ in range(n):
        out: list[int] = []
        prev = start
        while len(out) < 2:
            d = torch.multinomial(draft, 1, generator=gen).view(1, g_len)
            ctx = [prev] + d[0].tolist()
            p = target[torch.tensor(ctx)].unsqueeze(0)  # rows: p(.|prev), p(.|d1), ...
            tokens, acc = rejection_verify(d, draft.unsqueeze(0), p, gen)
            step = tokens[0, : acc.item() + 1].tolist()
            out += step
            prev = out[-1]
        counts[out[0], out[1]] += 1
    expected = n * target[start].unsqueeze(1) * target
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 42.6, chi2


def test_rejection_all_rows_accept_when_draft_equals_target():
    v = 5
    p = torch.softmax(torch.randn(1, 4, v, generator=torch.Generator().manual_seed(0)), -1)
    gen = torch.Generator().manual_seed(1)
    d = torch.multinomial(p[0, :3], 1, generator=gen).view(1, 3)
    _, acc = rejection_verify(d, p[:, :3], p, gen)
    assert acc.item() == 3  # p/q = 1 at every position: acceptance is certain
