"""When and how wide to draft: one home for every "does drafting pay?" decision, from measured costs.

Speculative decoding is lossless whatever is drafted (verification decides what is committed), so these policies
only trade speed: a drafted token costs verify width and draft time, and pays only when it is accepted. Each
decision compares expected committed tokens per second, using
- the target's verify cost per width (`calibrate.VerifyCost`, measured once per machine and cached),
- draft times measured as decoding runs (`CallTime`: the uncontended time, as the calibration's verify costs are),
- acceptance measured as decoding runs (`Acceptance`, or a row's running gain).

A policy that stops drafting would never measure again, so each one drafts anyway after a run of skipped steps
(`Explorer`): per row after EXPLORE_ROW steps that drafted less than they could, twice the chosen width (at least
one token: a narrowed chain never reaches, so never measures, the positions it leaves out); per batched step after
EXPLORE_BATCH plain steps. Explorations that keep confirming the skip are spaced ever further apart (up to
EXPLORE_BACKOFF times), so that where drafting does not pay the policy costs next to nothing over plain decoding.

Policies:
- `WidthPolicy` (per row): how many tokens a chain drafts this step, 0 .. limit;
- `BatchPolicy` (per engine): whether a step of two or more rows drafts at all (a wide verify of many rows is
  compute-bound on a CPU, where drafting can cost more than it commits);
- `lookup_draft_pays` (per tree step): whether the DFlash draft adds enough to a lookup-only tree.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

EXPLORE_ROW = 8  # per row: after this many steps without drafting, one step drafts to measure again
EXPLORE_BATCH = 16  # per engine: after this many plain steps of several rows, one step drafts to measure again
EXPLORE_BACKOFF = 16  # explorations the policy does not follow stretch its interval, up to this many times
SMOOTHING = 0.2  # weight of the newest sample in every running mean
GAIN_PRIOR = 1.0  # tokens a drafted step commits beyond the verified one, before a row has measured its own
POOL_TRIALS = 8.0  # a new row's acceptance starts from the engine's pooled one, weighted as this many trials
CALL_WINDOW = 16  # recent draft calls a draft's price is read from


class RunningMean:
    """An exponential running mean: None until the first sample, then mean <- (1 - a) mean + a x."""

    __slots__ = ("value",)

    def __init__(self, value: float | None = None) -> None:
        self.value = value

    def update(self, x: float) -> float:
        self.value = x if self.value is None else (1.0 - SMOOTHING) * self.value + SMOOTHING * x
        return self.value


class CallTime:
    """What a draft call costs, as the policies price it: the lower quartile of the last CALL_WINDOW calls after
    the first (None until then: the first call pays one-time costs, allocations and the first touch of the
    weights, and a policy that believed it would stop drafting). The verify costs it is weighed against are
    minimums over repetitions (`calibrate`), so the draft's price must be its uncontended time too. A running mean
    would let a few calls slowed by another process stand for the draft's cost, and a policy that then stops
    drafting measures it again only at its ever rarer explorations: on a 2-core machine shared with another job,
    a 1.5B target's draft calls of ~2 ms came interleaved with ones of 50-70 ms and its adaptive width stopped
    drafting on code. A lasting change of cost moves the price within a window's worth of calls."""

    __slots__ = ("_recent", "_calls")

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=CALL_WINDOW)
        self._calls = 0

    @property
    def value(self) -> float | None:
        if not self._recent:
            return None
        return sorted(self._recent)[(len(self._recent) - 1) // 4]

    def update(self, seconds: float) -> float | None:
        self._calls += 1
        if self._calls > 1:
            self._recent.append(seconds)
        return self.value


class Explorer:
    """When a policy that chose not to draft (or to draft less) must draft anyway to measure again: `due` once
    `interval` skipped steps have gone by in a row. An exploration the policy does not follow (the next step skips
    again) doubles the interval, up to EXPLORE_BACKOFF times `every`: a draft that keeps not paying is measured ever
    more rarely, so that its measurements cost a vanishing share of the steps; a step that drafts by the policy's
    own choice brings the interval back to `every`."""

    __slots__ = ("every", "interval", "run", "_explored")

    def __init__(self, every: int) -> None:
        self.every, self.interval, self.run, self._explored = every, every, 0, False

    @property
    def due(self) -> bool:
        return self.run >= self.interval

    def skip(self) -> None:
        """This step did not draft (or drafted less than it could)."""
        if self._explored:
            self.interval = min(2 * self.interval, EXPLORE_BACKOFF * self.every)
            self._explored = False
        self.run += 1

    def explore(self) -> None:
        """This step drafted because exploring was due."""
        self.run, self._explored = 0, True

    def draft(self) -> None:
        """This step drafted by the policy's own choice."""
        self.run, self._explored, self.interval = 0, False, self.every


class Acceptance:
    """Running conditional acceptance per draft position: P(position i accepted | positions < i accepted), from the
    verifies that reached it. Before its own measurements a row leans on a prior: the pooled acceptance of the
    engine's rows (`pool`, weighted as POOL_TRIALS trials), else one accept in two trials. Without the pool a row's
    first few unlucky verifies could make drafting look unprofitable, and a row that stops drafting measures only
    what its rare explorations show."""

    def __init__(self, positions: int, pool: "Acceptance | None" = None) -> None:
        self.accepted, self.trials = [0.0] * positions, [0.0] * positions
        self.pool = pool  # every observation is also added here (the engine's rows together)

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify of `drafted` tokens accepted the first `accepted`: positions 0..accepted-1 were accepted,
        position `accepted` (if drafted) rejected, the ones after it were never reached."""
        for i in range(min(accepted + 1, drafted)):
            self.trials[i] += 1
            self.accepted[i] += i < accepted
        if self.pool is not None:
            self.pool.observe(drafted, accepted)

    def rates(self) -> list[float]:
        return [a / n for a, n in self._counts()]

    def upper(self) -> list[float]:
        """The rates plus one standard error: optimistic where little is measured, so that a few unlucky early
        verifies do not stop a row from drafting; the bonus shrinks as trials accumulate."""
        return [min(1.0, a / n + math.sqrt((a / n) * (1.0 - a / n) / n)) for a, n in self._counts()]

    def _counts(self) -> list[tuple[float, float]]:
        """(accepted, trials) per position, the prior's pseudo-counts included."""
        if self.pool is None:
            prior, weight = [0.5] * len(self.trials), 2.0
        else:
            prior, weight = self.pool.rates(), POOL_TRIALS
        return [(a + weight * q, t + weight) for a, t, q in zip(self.accepted, self.trials, prior)]


class SharedMeasures:
    """What the width policies of one engine's rows share: acceptance pooled per (positions, greedy or sampled), so
    that one row's early luck does not decide its width, and the draft call's price (`CallTime`)."""

    def __init__(self) -> None:
        self.pools: dict[tuple[int, bool], Acceptance] = {}
        self.draft_seconds = CallTime()

    def pool(self, positions: int, greedy: bool) -> Acceptance:
        return self.pools.setdefault((positions, greedy), Acceptance(positions))


class WidthPolicy:
    """Per row: the width of this step's chain. Fixed (`verify_cost` None): always the limit. Adaptive: the g in
    0..limit maximising (1 + sum_i P(first i drafts accepted)) / (verify(g + 1) + draft time if g > 0), from the
    calibration, the row's measured draft time and its per-position acceptance (optimistic by one standard error,
    `Acceptance.upper`)."""

    def __init__(self, block_size: int, verify_cost=None, pool: Acceptance | None = None,
                 draft_seconds: CallTime | None = None) -> None:
        """pool: the engine's pooled acceptance for chains of this block size (`Acceptance`), None: this row's own;
        draft_seconds: the engine's draft-call price, shared by its rows (None: this row's own)."""
        self.verify_cost = verify_cost
        self.acceptance = Acceptance(max(0, block_size - 1), pool)
        self.draft_seconds = draft_seconds if draft_seconds is not None else CallTime()  # one draft call
        self.explorer = Explorer(EXPLORE_ROW)
        self.widths: list[int] = []  # tokens drafted per step
        self._exploring = False  # the last `choose` explored

    @property
    def adaptive(self) -> bool:
        return self.verify_cost is not None

    def choose(self, limit: int) -> int:
        """Tokens to draft now, 0..limit: the best width, the whole limit on the first step (nothing measured yet),
        twice the best width (at least one token) when exploring is due."""
        self._exploring = False
        if self.verify_cost is None or limit <= 0:
            return max(0, limit)
        draft_s = self.draft_seconds.value
        if draft_s is None:
            return limit
        best = self._best(limit, draft_s)
        if best < limit and self.explorer.due:
            self._exploring = True
            return min(limit, max(1, 2 * best))
        return best

    def _best(self, limit: int, draft_s: float) -> int:
        cost = self.verify_cost.chain
        rates = self.acceptance.upper()
        best, best_rate, reach, expected = 0, 1.0 / cost(1), 1.0, 1.0
        for g in range(1, limit + 1):
            reach *= rates[g - 1]
            expected += reach
            rate = expected / (cost(g + 1) + draft_s)
            if rate > best_rate:
                best, best_rate = g, rate
        return best

    def record(self, width: int, limit: int) -> None:
        """The width this step drafted (after the batch policy) of the `limit` it could have."""
        self.widths.append(width)
        if limit <= 0:
            return
        if width == 0 or (width < limit and not self._exploring):
            self.explorer.skip()
        elif self._exploring:
            self.explorer.explore()
        else:
            self.explorer.draft()

    def drafted(self, seconds: float) -> None:
        self.draft_seconds.update(seconds)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.acceptance.observe(drafted, accepted)


class BatchPolicy:
    """Per engine: whether a step of two or more rows drafts. With `draft_max_batch`, never while more rows are
    active. With `verify_cost`, only when expected tokens per second beat a plain step's: expected tokens = each
    row's 1 + its running gain (tokens a drafted step committed beyond one, GAIN_PRIOR until measured, at most its
    width), cost = verify(all rows' candidates) + the measured draft time per drafting row, against
    rows / verify(one token per row)."""

    def __init__(self, verify_cost=None, draft_max_batch: int | None = None) -> None:
        self.verify_cost, self.draft_max_batch = verify_cost, draft_max_batch
        self.draft_row_seconds = CallTime()
        self.explorer = Explorer(EXPLORE_BATCH)

    def drafts(self, rows: list[tuple[float | None, int]]) -> bool:
        """rows: (running gain or None, tokens it may draft) per active row; a single row always drafts."""
        if len(rows) <= 1 or self._pays(rows):
            self.explorer.draft()
            return True
        if self.explorer.due and (self.draft_max_batch is None or len(rows) <= self.draft_max_batch):
            self.explorer.explore()
            return True
        self.explorer.skip()
        return False

    def _pays(self, rows: list[tuple[float | None, int]]) -> bool:
        if self.draft_max_batch is not None and len(rows) > self.draft_max_batch:
            return False
        cost = self.verify_cost
        if cost is None or not any(g for _, g in rows):
            return True
        b = len(rows)
        width = sum(g + 1 for _, g in rows)
        expected = sum(1.0 + min(g, gain if gain is not None else GAIN_PRIOR) for gain, g in rows)
        drafting = sum(1 for _, g in rows if g > 0)
        seconds = cost.chain(width) + (self.draft_row_seconds.value or 0.0) * drafting
        return expected / seconds > b / cost.chain(b)

    def drafted(self, seconds: float, rows: int) -> None:
        """A batched draft call took `seconds` for `rows` drafting rows."""
        if rows:
            self.draft_row_seconds.update(seconds / rows)


@dataclass(frozen=True)
class TreeStepCosts:
    """What a tree step's choice to run the draft reads: the lookup-only tree's expected tokens and best rate, the
    draft's running gain (tokens it added) and node count, its measured time and the verify cost of both trees."""

    lookup_expected: float  # expected tokens of the lookup branches' tree (the root included)
    lookup_nodes: int  # its nodes below the root
    lookup_rate: float  # the best expected tokens per second without the draft
    gain: float  # tokens the draft's nodes are expected to add
    draft_nodes: float  # running mean of the draft's nodes in a tree with both
    draft_seconds: float


def lookup_draft_pays(c: TreeStepCosts, verify_cost) -> bool:
    """Whether running the draft is expected to raise tokens per second over the lookup branches alone."""
    cost = c.draft_seconds + verify_cost(1 + c.lookup_nodes + round(c.draft_nodes))
    return (c.lookup_expected + c.gain) / cost > c.lookup_rate


def expected_seconds_per_token(widths_cost: list[float], accept_rates: list[float], width: int,
                               draft_seconds: float) -> float:
    """Expected seconds per committed token of a chain drafting `width` tokens with conditional acceptance rates
    `accept_rates` (per position) and verify cost widths_cost[w - 1] for w tokens: what `WidthPolicy` maximises
    the inverse of, written out for tests and simulations."""
    reach, expected = 1.0, 1.0
    for i in range(width):
        reach *= accept_rates[i]
        expected += reach
    return (widths_cost[width] + (draft_seconds if width > 0 else 0.0)) / expected
