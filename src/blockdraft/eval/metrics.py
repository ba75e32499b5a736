"""Benchmark arithmetic as pure functions on step logs (no models, no clocks).

A step log is what one generation records (`DecodeStats`): `accept_lengths` (tokens committed per verify step, a+1,
between 1 and the block size B), `position_accepted` / `position_trials` (for draft positions 1..B-1, how often each
was verified and accepted). Several generations pool by concatenating steps and summing counts.

Paired ratios compare a method with the `ar` baseline on the same prompt: throughput ratios are method/ar, time
speedups ar/method (both > 1 when the method is faster). They are summarised by median, min, max and mean.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Mapping, Sequence


def tau(accept_lengths: Iterable[int]) -> float:
    """Mean tokens committed per verify step (0.0 for no steps)."""
    xs = list(accept_lengths)
    return sum(xs) / len(xs) if xs else 0.0


def pooled_tau(logs: Iterable[Sequence[int]]) -> float:
    """tau over the steps of several generations together (each step weighs the same, not each generation)."""
    total = steps = 0
    for log in logs:
        total += sum(log)
        steps += len(log)
    return total / steps if steps else 0.0


def accept_length_histogram(accept_lengths: Iterable[int], block_size: int, normalize: bool = False) -> list[float]:
    """Counts of accept lengths 1..block_size (index i holds length i+1); fractions if `normalize`.
    A length outside 1..block_size is an error: it means the log and the block size disagree."""
    counts = [0] * block_size
    for a in accept_lengths:
        if not 1 <= a <= block_size:
            raise ValueError(f"accept length {a} outside 1..{block_size}")
        counts[a - 1] += 1
    if normalize:
        n = sum(counts)
        return [c / n if n else 0.0 for c in counts]
    return counts


def sum_position_counts(pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> tuple[list[int], list[int]]:
    """Sum (position_accepted, position_trials) pairs of several generations; shorter lists are padded with 0."""
    acc: list[int] = []
    tri: list[int] = []
    for a, t in pairs:
        if len(a) != len(t):
            raise ValueError(f"position_accepted has {len(a)} entries but position_trials has {len(t)}")
        for i, (x, y) in enumerate(zip(a, t)):
            if x > y:
                raise ValueError(f"position {i + 1}: accepted {x} > trials {y}")
            if i == len(acc):
                acc.append(0)
                tri.append(0)
            acc[i] += x
            tri[i] += y
    return acc, tri


def position_acceptance(accepted: Sequence[int], trials: Sequence[int], length: int | None = None) -> list[float]:
    """Acceptance rate accepted/trials of draft positions 1..len (NaN where a position was never verified).
    `length` (B-1) pads or cuts the result to a fixed number of positions."""
    if len(accepted) != len(trials):
        raise ValueError("accepted and trials must have the same length")
    n = len(trials) if length is None else length
    out = []
    for i in range(n):
        t = trials[i] if i < len(trials) else 0
        out.append(accepted[i] / t if t else math.nan)
    return out


def paired_ratios(values: Mapping, baseline: Mapping, invert: bool = False) -> dict:
    """Per key present in both (e.g. a prompt): values[k] / baseline[k], or baseline[k] / values[k] with `invert`
    (time -> speedup). Keys whose numerator or denominator is missing, zero or NaN are left out."""
    out = {}
    for k, v in values.items():
        b = baseline.get(k)
        num, den = (b, v) if invert else (v, b)
        if num is None or den is None or _bad(num) or _bad(den) or den == 0:
            continue
        out[k] = num / den
    return out


def _bad(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


def summarize(xs: Iterable[float]) -> dict:
    """{'n', 'median', 'min', 'max', 'mean'} of the finite values (the statistics are None when there are none)."""
    v = [float(x) for x in xs if x is not None and math.isfinite(x)]
    if not v:
        return {"n": 0, "median": None, "min": None, "max": None, "mean": None}
    return {"n": len(v), "median": statistics.median(v), "min": min(v), "max": max(v), "mean": sum(v) / len(v)}


def throughput_speedup(method_tps: Mapping, ar_tps: Mapping) -> dict:
    """Summary of per-prompt decode tokens/s ratios method/ar."""
    return summarize(paired_ratios(method_tps, ar_tps).values())


def time_speedup(method_seconds: Mapping, ar_seconds: Mapping) -> dict:
    """Summary of per-prompt end-to-end speedups ar_seconds/method_seconds."""
    return summarize(paired_ratios(method_seconds, ar_seconds, invert=True).values())


def share(part: Iterable[float], whole: Iterable[float]) -> float | None:
    """sum(part) / sum(whole): e.g. the share of decode time spent drafting, pooled over generations."""
    p, w = sum(part), sum(whole)
    return p / w if w > 0 else None


def match_rate(flags: Iterable[bool | None]) -> float | None:
    """Fraction of True among the known flags (None = not compared)."""
    v = [bool(f) for f in flags if f is not None]
    return sum(v) / len(v) if v else None
