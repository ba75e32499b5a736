"""The verifier on chains (a chain is the tree whose parents are i - 1): hand-built cases, a naive reference for
greedy acceptance, and a distribution-level losslessness check of rejection sampling."""

import pytest
import torch

from blockdraft.decode.tree import Tree
from blockdraft.decode.verify import greedy_verify, rejection_verify

V = 7
HI, LO = 100.0, -100.0  # one-hot logits: the target is certain
ROOT = 0  # the last committed token; its value does not enter acceptance


def one_hot_logits(tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] logits whose argmax (and, softmaxed, whose only mass) is each given token."""
    x = torch.full((len(tokens), V), LO)
    x[torch.arange(len(tokens)), torch.tensor(tokens)] = HI
    return x


def chain(drafts: list[int], q: torch.Tensor | None = None) -> Tree:
    return Tree.chain(ROOT, torch.tensor(drafts, dtype=torch.long), q)


def naive_greedy(drafts: list[int], logits: torch.Tensor) -> list[int]:
    """The committed tokens of a greedy chain step, position by position: the target's argmax after each accepted
    draft, stopping at the first draft that differs from it (which is replaced by that argmax)."""
    out = []
    for i, want in enumerate(logits.argmax(-1).tolist()):
        out.append(want)
        if i == len(drafts) or drafts[i] != want:
            return out
    return out


def test_greedy_all_accepted_takes_bonus():
    path, committed = greedy_verify(chain([1, 2, 3]), one_hot_logits([1, 2, 3, 5]))
    assert path == [0, 1, 2, 3]
    assert committed == [1, 2, 3, 5]  # the last one is the bonus


def test_greedy_first_rejected_recovers_target_token():
    path, committed = greedy_verify(chain([4, 2, 3]), one_hot_logits([1, 2, 3, 5]))
    assert path == [0] and committed == [1]


def test_greedy_later_match_after_mismatch_does_not_count():
    path, committed = greedy_verify(chain([1, 6, 3]), one_hot_logits([1, 2, 3, 5]))
    assert path == [0, 1] and committed == [1, 2]


def test_greedy_matches_the_naive_reference_on_random_chains():
    """Random logits and drafts that agree with the argmax for a random prefix: every acceptance length, ties in
    the logits included (rounded to halves, so maxima repeat; argmax takes the first)."""
    g = torch.Generator().manual_seed(7)
    for _ in range(200):
        n = int(torch.randint(0, 6, (1,), generator=g))
        logits = (torch.randn(n + 1, V, generator=g) * 2).round() / 2
        want = logits.argmax(-1).tolist()
        keep = int(torch.randint(0, n + 1, (1,), generator=g))
        drafts = want[:keep] + torch.randint(0, V, (n - keep,), generator=g).tolist()
        path, committed = greedy_verify(chain(drafts), logits)
        assert committed == naive_greedy(drafts, logits)
        assert path == list(range(len(committed)))


def test_shapes_are_checked():
    with pytest.raises(AssertionError):
        greedy_verify(chain([1, 2]), one_hot_logits([1, 2]))


def test_rejection_certain_target_behaves_like_greedy():
    g = torch.Generator().manual_seed(0)
    p = one_hot_logits([1, 2, 3, 5]).softmax(-1)
    q = torch.full((3, V), 1.0 / V)
    path, committed = rejection_verify(chain([1, 2, 3], q), p, g)
    assert path == [0, 1, 2, 3] and committed == [1, 2, 3, 5]
    path, committed = rejection_verify(chain([1, 4, 3], q), p, g)
    assert path == [0, 1] and committed == [1, 2]  # recovered = the only token p allows


def test_rejection_point_mass_draft():
    """A deterministic proposal (no q): the recovered token never equals the rejected draft."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.5, 0, 0, 0, 0, 0]] * 2)
    rejected = 0
    for _ in range(50):
        path, committed = rejection_verify(chain([0]), p, g)
        if path == [0]:
            rejected += 1
            assert committed == [1]
    assert 0 < rejected < 50  # p(0) = 1/2: both outcomes occur in 50 seeded draws


def _bigram(seed: int, v: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(v, v, generator=g) * 1.5, dim=-1)  # P[prev, next]


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_is_lossless_over_two_tokens(point_mass):
    """Run speculative steps against a bigram target with a mismatched draft until two tokens are committed and
    compare their joint distribution with the target's, by a chi-square test on 16 cells (df = 15). point_mass: the
    drafts are proposed as deterministic tokens (prompt lookup's case) rather than with their q.

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
            d = torch.multinomial(draft, 1, generator=gen).view(g_len)
            ctx = [prev] + d.tolist()
            p = target[torch.tensor(ctx)]  # rows: p(.|prev), p(.|d1), ...
            _, step = rejection_verify(Tree.chain(prev, d, None if point_mass else draft), p, gen)
            out += step
            prev = out[-1]
        counts[out[0], out[1]] += 1
    expected = n * target[start].unsqueeze(1) * target
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 42.6, chi2


def test_rejection_all_rows_accept_when_draft_equals_target():
    v = 5
    p = torch.softmax(torch.randn(4, v, generator=torch.Generator().manual_seed(0)), -1)
    gen = torch.Generator().manual_seed(1)
    d = torch.multinomial(p[:3], 1, generator=gen).view(3)
    path, _ = rejection_verify(Tree.chain(ROOT, d, p[:3]), p, gen)
    assert len(path) - 1 == 3  # p/q = 1 at every position: acceptance is certain
