"""Benchmark arithmetic on hand-made step logs with known answers."""

import math

import pytest

from blockdraft.eval import metrics as M


def test_tau():
    assert M.tau([1, 3, 2, 2]) == 2.0
    assert M.tau([]) == 0.0
    # pooled over generations: every step weighs the same (9 tokens / 4 steps), not the mean of per-log taus (2.75)
    assert M.pooled_tau([[4], [1, 2, 2]]) == 9 / 4
    assert M.pooled_tau([[], []]) == 0.0


def test_accept_length_histogram():
    assert M.accept_length_histogram([1, 3, 3, 4, 1, 1], 4) == [3, 0, 2, 1]
    assert M.accept_length_histogram([1, 3, 3, 4], 4, normalize=True) == [0.25, 0.0, 0.5, 0.25]
    assert M.accept_length_histogram([], 3, normalize=True) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        M.accept_length_histogram([5], 4)
    with pytest.raises(ValueError):
        M.accept_length_histogram([0], 4)


def test_position_acceptance():
    # two generations with block size 4 (3 draft positions); the second never verified position 3
    acc, tri = M.sum_position_counts([([3, 2, 1], [4, 4, 4]), ([1, 0], [2, 2])])
    assert (acc, tri) == ([4, 2, 1], [6, 6, 4])
    assert M.position_acceptance(acc, tri) == [4 / 6, 2 / 6, 1 / 4]
    rate = M.position_acceptance([1], [2], length=3)
    assert rate[0] == 0.5 and math.isnan(rate[1]) and math.isnan(rate[2])
    with pytest.raises(ValueError):
        M.sum_position_counts([([3], [2])])  # accepted more often than tried
    with pytest.raises(ValueError):
        M.sum_position_counts([([1, 1], [2])])


def test_position_counts_agree_with_the_engine_bookkeeping():
    from blockdraft.decode.engine import DecodeStats

    s = DecodeStats()
    for g, a in [(3, 3), (3, 0), (3, 1), (2, 2)]:
        s.record(g, a)
    assert (s.position_accepted, s.position_trials) == ([3, 2, 1], [4, 4, 3])
    assert M.position_acceptance(s.position_accepted, s.position_trials) == [0.75, 0.5, 1 / 3]


def test_paired_ratios_and_summaries():
    ar_tps = {"p1": 10.0, "p2": 20.0, "p3": 40.0, "p4": 5.0}
    m_tps = {"p1": 25.0, "p2": 30.0, "p3": 40.0, "p5": 99.0}  # p4 missing for the method, p5 for ar
    r = M.paired_ratios(m_tps, ar_tps)
    assert r == {"p1": 2.5, "p2": 1.5, "p3": 1.0}
    s = M.throughput_speedup(m_tps, ar_tps)
    assert s == {"n": 3, "median": 1.5, "min": 1.0, "max": 2.5, "mean": 5.0 / 3}
    # times: speedup is ar / method
    t = M.time_speedup({"p1": 2.0, "p2": 4.0}, {"p1": 4.0, "p2": 2.0})
    assert t == {"n": 2, "median": 1.25, "min": 0.5, "max": 2.0, "mean": 1.25}
    # zero or missing denominators are dropped, not turned into inf
    assert M.paired_ratios({"a": 1.0, "b": 2.0}, {"a": 0.0, "b": None}) == {}
    assert M.summarize([]) == {"n": 0, "median": None, "min": None, "max": None, "mean": None}
    assert M.summarize([float("nan"), 3.0])["n"] == 1


def test_share_and_match_rate():
    assert M.share([1.0, 2.0], [4.0, 8.0]) == 0.25
    assert M.share([], []) is None
    assert M.match_rate([True, False, True, None]) == 2 / 3
    assert M.match_rate([None]) is None
