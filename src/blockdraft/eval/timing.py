"""Timing several cases against each other on a noisy machine: every repeat runs each case once per width, the
cases in a rotating order, so that drift in the machine's speed hits all of them alike."""

from __future__ import annotations


def measure(cases: dict, max_n: int, repeats: int, warmup: int) -> dict:
    """cases: {name: f(N) -> seconds}, timed at N = 1..max_n -> {name: {N: [seconds per repeat]}}, the order of the
    cases rotated per (repeat, N); `warmup` untimed rounds first."""
    names = list(cases)
    for _ in range(warmup):
        for n in range(1, max_n + 1):
            for m in names:
                cases[m](n)
    times = {m: {n: [] for n in range(1, max_n + 1)} for m in names}
    for r in range(repeats):
        for n in range(1, max_n + 1):
            k = (r + n) % len(names)
            for m in names[k:] + names[:k]:
                times[m][n].append(cases[m](n))
    return times
