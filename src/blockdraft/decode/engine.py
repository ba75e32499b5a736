"""The decode engine: one step function for every caller (generate, chat, serve, bench, regeneration).

An `Engine` decodes up to `max_batch` sequences ("rows") at once; rows join and leave between steps, and a single
generation (`generate`, `stream`) is a batch of one through the same `step`. One step:
1. rows marked cancelled are dropped;
2. waiting rows are admitted while there is room: each is prefilled on its own cache (in chunks of `prefill_chunk`
   tokens), picks its first token and starts its proposer;
3. every row proposes a candidate tree of depth <= G_i (a chain of G_i drafts is the tree whose parents are i - 1);
   rows of one proposer class propose in one call, one forward where they share one (the DFlash draft,
   `Proposer.propose_rows`);
4. ONE target forward verifies every row (`TargetModel.forward_rows`): the projections and the MLP read each weight
   once for all rows, each row attends over its own cache;
5. each row is verified on its own by the one verifier (verify.py: greedy, or rejection sampling with the row's own
   seeded generator), commits a_i + 1 tokens, keeps the accepted path's keys/values (a chain's: a crop), and is
   checked for stops (EOS, stop ids, stop strings, max tokens), streaming only text that can no longer become a
   stop string.

Invariant at the top of every step, per row (n = committed tokens, prompt included): its cache holds n-1 positions
(the last committed token t is not in it yet) and a feature-conditioned proposer holds context for the same n-1.
A step feeds every node at position n-1+depth (a chain [t, d_1..d_G] causally at n-1..n-1+G, with no mask to
build), commits a+1 tokens and keeps the accepted path's keys/values at n-1..n-1+a (a chain's: the cache cropped to
n+a). With no proposer (G = 0) the same step is plain autoregressive decoding, the fair baseline.

Each row has its own preallocated cache: rows of any lengths share a step without padding, and a row leaving costs
nothing. On the native stack a row's numbers do not depend on the other rows, so a batched row is its solo run bit
for bit (tests: batched == solo == naive, token for token, in fp32 on tiny random models).

How much to draft is policy.py's call, from measured costs: per row, its chain's width (`width_cost`: adaptive, else
the full block; a tree proposer sizes its own tree within the depth it is given); per step, whether several rows
draft at all (`batch_cost`, `draft_max_batch`); a step that does not draft verifies each row's last token alone.
`max_step_tokens` shares a budget of verified positions.
Pieces: row.py (a row), step.py (per plan), stats.py (results, events), stops.py (stop strings, streaming)."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Hashable, Iterable, Iterator

import torch

from ..config import GenerationConfig, SamplingParams
from ..models.target import TargetModel
from .policy import BatchPolicy, SharedMeasures
from .proposers import NoDraft, Proposer
from .row import Sequence, check_prompt, pick_token
from .stats import DecodeStats, GenerationResult, StepError, StepEvent
from .step import Plan, forward_plans, prefill_chunk, propose, verify
from .stops import Generation

__all__ = ["DecodeStats", "Engine", "Generation", "GenerationResult", "StepError", "StepEvent"]

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # prompt tokens per prefill forward: bounds the activations a long prompt needs at once


class Engine:
    """Speculative decoding of many sequences with one target and one proposer (None: plain decoding). Not
    thread-safe: one thread owns it and calls `step` (the server's worker does); `cancel` only sets a flag and may
    be called from anywhere.

    max_batch: rows decoded together (more wait); max_step_tokens: optional budget of verified positions per step,
    shared evenly by the rows (each drafts at most max_step_tokens // rows - 1); draft_max_batch: draft only while at
    most this many rows are active (None: no cap); batch_cost: a `calibrate.VerifyCost` of this target, for the
    measured per-step choice between drafting and a plain step when two or more rows are active (None: always
    draft); width_cost: the same calibration for each row's adaptive chain width (None: full blocks; see
    policy.py); prefill_chunk: prompt tokens per prefill forward. Greedy output never depends on these, only the
    acceptance statistics and the speed do.
    """

    def __init__(self, target: TargetModel, proposer: Proposer | None = None, tokenizer=None, *,
                 max_batch: int = 8, max_step_tokens: int | None = None, draft_max_batch: int | None = None,
                 batch_cost=None, width_cost=None, prefill_chunk: int = PREFILL_CHUNK) -> None:
        for name, v, low in (("max_batch", max_batch, 1), ("prefill_chunk", prefill_chunk, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        for name, v in (("max_step_tokens", max_step_tokens), ("draft_max_batch", draft_max_batch)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {v!r}")
        self.target = target
        self.proposer: Proposer = proposer if proposer is not None else NoDraft()
        if not isinstance(self.proposer, Proposer):
            raise TypeError(f"{type(self.proposer).__name__} is not a Proposer (subclass proposers.Proposer)")
        self.tokenizer = tokenizer if tokenizer is not None else target.tokenizer
        self.max_batch, self.max_step_tokens = max_batch, max_step_tokens
        self.batch_policy = BatchPolicy(batch_cost, draft_max_batch)
        self.width_cost = width_cost
        self.shared = SharedMeasures()  # what the rows' width policies measure together
        self.prefill_chunk = prefill_chunk
        self.spec = None  # the `spec.DecodeSpec` it was built from, when `spec.build_engine` built it
        # the target layers this engine's proposer reads, passed with every forward (engines may share a target)
        self.taps = tuple(self.proposer.layer_ids)
        self._ids = itertools.count()
        self._pending: list[Sequence] = []
        self._prefilling: list[Sequence] = []  # admitted, prompt not yet fully in the cache (see step)
        self._active: list[Sequence] = []
        self._by_id: dict[Hashable, Sequence] = {}
        self._template_used = False  # the first row gets the proposer itself, later ones forks of it
        # counters, for tests and metrics
        self.steps = 0
        self.batched_forwards = 0  # target forwards that verified more than one row
        self.plain_steps = 0  # steps of two or more rows that did not draft (draft_max_batch or batch_cost)

    # ------------------------------------------------------------------------------------------ public API
    @property
    def batch_cost(self):
        return self.batch_policy.verify_cost

    @batch_cost.setter
    def batch_cost(self, cost) -> None:
        self.batch_policy.verify_cost = cost

    @property
    def draft_max_batch(self) -> int | None:
        return self.batch_policy.draft_max_batch

    @property
    def name(self) -> str:
        return self.proposer.name

    @property
    def num_active(self) -> int:
        """Rows holding a slot: decoding, or admitted and still prefilling their prompt."""
        return len(self._active) + len(self._prefilling)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def cache_positions(self) -> int:
        """Key/value positions held by the active rows' caches. Read by the server's HTTP thread while the worker
        steps: the list is copied and each cache read once, since the worker may drop a row's cache in between."""
        total = 0
        for r in list(self._active) + list(self._prefilling):
            cache = r.cache
            if cache is not None:
                total += cache.length
        return total

    @property
    def has_work(self) -> bool:
        return bool(self._active or self._pending or self._prefilling)

    def add(self, prompt_ids, config: GenerationConfig | None = None, sampling: SamplingParams | None = None, *,
            request_id: Hashable | None = None, text: bool = True) -> Hashable:
        """Queue a request; it is admitted (prefilled) by a later `step`. Returns its request id.
        Raises ValueError for a bad prompt (empty, outside the vocabulary, longer than the context)."""
        config = config or GenerationConfig()
        sampling = sampling or SamplingParams()
        prompt = check_prompt(self.target, prompt_ids)
        if config.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        rid = next(self._ids) if request_id is None else request_id
        if rid in self._by_id:
            raise ValueError(f"request id {rid!r} is already in use")
        stops = set(config.stop_token_ids) | (set() if config.ignore_eos else set(self.target.eos_token_ids))
        row = Sequence(rid, prompt, config, sampling, text, self._row_proposer(), stops, self._decode,
                       self.width_cost, self.shared)
        self._pending.append(row)
        self._by_id[rid] = row
        return rid

    def proposer_of(self, request_id: Hashable) -> Proposer:
        """The proposer of a queued or running request (a `FeatureRecorder` holds what its request recorded)."""
        if request_id not in self._by_id:
            raise KeyError(f"no request {request_id!r} in this engine")
        return self._by_id[request_id].proposer

    def cancel(self, request_id: Hashable) -> bool:
        """Mark a request cancelled; it is dropped at the next step (with a finished event, reason "cancelled")."""
        row = self._by_id.get(request_id)
        if row is None or row.done:
            return False
        row.cancelled = True
        return True

    def reset(self) -> list[Hashable]:
        """Drop every row (after an error); returns the ids that were dropped."""
        ids = list(self._by_id)
        self._pending.clear()
        self._prefilling.clear()
        self._active.clear()
        self._by_id.clear()
        return ids

    def step(self) -> list[StepEvent]:
        """One scheduling step: drop cancelled rows, admit waiting rows, verify all active rows in one forward.

        Prompts are prefilled in chunks of `prefill_chunk` tokens. While other rows are decoding, a step prefills
        at most one chunk before it decodes, so a long prompt admitted beside running streams delays each of their
        steps by one chunk's forward, not by the whole prompt's; with no row decoding, prompts are prefilled whole.

        An error in one row's admission, proposal or verification fails that row alone (a finished event with
        finish_reason "error"); the others go on. An error outside any row raises StepError, which carries the
        events the step had already produced."""
        events: list[StepEvent] = []
        try:
            with torch.no_grad():
                self._drop_cancelled(events)
                while self._pending and self.num_active < self.max_batch:
                    row = self._pending.pop(0)
                    try:
                        self._admit(row)
                    except Exception as e:  # noqa: BLE001 - this row's trouble, not the batch's
                        self._fail_row(row, events, "admission", e)
                self._prefill(events)
                if self._active:
                    self._decode_step(events)
                self._active = [r for r in self._active if not r.done]
        except Exception as e:
            self._active = [r for r in self._active if not r.done]
            raise StepError(f"{type(e).__name__}: {e}", events) from e
        self.steps += 1
        return events

    def run(self, requests: Iterable[tuple], text: bool = False) -> list[GenerationResult]:
        """Decode (prompt_ids, config, sampling) tuples to completion, batched; results in order."""
        ids = [self.add(*req, text=text) for req in requests]
        results: dict = {}
        while len(results) < len(ids):
            for ev in self.step():
                if ev.finished:
                    results[ev.request_id] = ev.result
        return [results[i] for i in ids]

    def generate(self, prompt_ids, config: GenerationConfig | None = None,
                 sampling: SamplingParams | None = None) -> GenerationResult:
        """One generation to completion (a batch of one)."""
        gen = self.stream(prompt_ids, config, sampling, text=False)
        for _ in gen:
            pass
        assert gen.result is not None
        return gen.result

    def stream(self, prompt_ids, config: GenerationConfig | None = None, sampling: SamplingParams | None = None,
               text: bool = True) -> Generation:
        """One generation as an iterator of text deltas (a batch of one; the engine must have no other work).
        With text=False nothing is decoded until the end. A bad request raises here, before iteration."""
        if self.has_work:
            raise RuntimeError("stream() runs one generation on an idle engine; use add() / step() for many")
        rid = self.add(prompt_ids, config, sampling, text=text)
        gen = Generation(iter(()))
        gen._it = self._follow(rid, gen)
        return gen

    # ------------------------------------------------------------------------------------------- internals
    def _follow(self, rid: Hashable, gen: Generation) -> Iterator[str]:
        try:
            while True:
                for ev in self.step():
                    if ev.text:
                        yield ev.text
                    if ev.finished:
                        if ev.result.finish_reason == "error" and ev.result.exception is not None:
                            raise ev.result.exception  # one generation: its failure is the caller's error
                        gen.result = ev.result
                        return
        finally:
            if rid in self._by_id:  # the caller stopped iterating early: the row goes, the engine stays usable
                self.cancel(rid)
                self.reset()

    def _row_proposer(self) -> Proposer:
        if not self.has_work:
            self._template_used = False  # an idle engine's rows are all gone: the template is free again
        if self._template_used:
            return self.proposer.fork()
        self._template_used = True
        return self.proposer

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _emit(self, row: Sequence, chunk: list[int], events: list[StepEvent]) -> None:
        delta, done = row.push(chunk)
        if done:
            self._finish(row, events, delta)
        else:
            events.append(StepEvent(row.rid, delta, len(row.new)))

    def _fail_row(self, row: Sequence, events: list[StepEvent], phase: str, err: Exception) -> None:
        """End one row with an error event (the tokens it committed so far, finish_reason "error")."""
        if row.done:
            return
        log.warning("request %r failed in %s: %s: %s", row.rid, phase, type(err).__name__, err)
        row.done = True
        row.cache = None
        self._by_id.pop(row.rid, None)
        row.stats.new_tokens = len(row.new)
        result = GenerationResult(token_ids=list(row.new), text="", finish_reason="error", stats=row.stats,
                                  error=f"{phase} failed: {type(err).__name__}: {err}", exception=err)
        events.append(StepEvent(row.rid, "", len(row.new), finished=True, result=result))

    def _finish(self, row: Sequence, events: list[StepEvent], delta: str = "") -> None:
        last, result = row.finalize()
        row.done = True
        self._by_id.pop(row.rid, None)
        events.append(StepEvent(row.rid, delta + last, len(row.new), finished=True, result=result))

    def _drop_cancelled(self, events: list[StepEvent]) -> None:
        for row in [r for r in self._pending if r.cancelled]:
            self._pending.remove(row)
            self._finish(row, events)
        for row in self._active + self._prefilling:
            if row.cancelled and not row.done:
                self._finish(row, events)
        self._active = [r for r in self._active if not r.done]
        self._prefilling = [r for r in self._prefilling if not r.done]

    def _admit(self, row: Sequence) -> None:
        """Give a row its slot (`Sequence.admit`); its prompt is prefilled by `_prefill`."""
        row.admit(self.target)
        self._prefilling.append(row)

    def _prefill(self, events: list[StepEvent]) -> None:
        """Prefill waiting prompts chunk by chunk, oldest row first: everything when no row is decoding, else one
        chunk this step (see `step`). A row whose prompt is done picks its first token and starts decoding."""
        one_chunk = bool(self._active)
        while self._prefilling:
            row = self._prefilling[0]
            try:
                prefill_chunk(self.target, row, self.prefill_chunk, self.taps)
                if row.prefilled == row.prompt.numel():
                    self._prefilling.pop(0)
                    self._first_token(row, events)
            except Exception as e:  # noqa: BLE001 - this row's trouble, not the batch's
                if row in self._prefilling:
                    self._prefilling.remove(row)
                self._fail_row(row, events, "admission", e)
            if one_chunk:
                break

    def _first_token(self, row: Sequence, events: list[StepEvent]) -> None:
        """The prompt is in the cache: pick the first token, start the proposer, emit."""
        first = pick_token(row.last_logits, row.sampling, row.generator)
        feats = row.prompt_features
        row.proposer.start(row.prompt, (torch.cat(feats, dim=1) if len(feats) > 1 else feats[0]) if feats else None)
        if row.proposer.observes_logits:
            row.proposer.observe(row.last_logits.unsqueeze(0))
        row.prompt_features, row.last_logits = [], None
        row.stats.prefill_seconds = time.perf_counter() - row.t0
        row.tokens = torch.cat([row.prompt, first.view(1)])
        row.produced = 1
        self._emit(row, [int(first)], events)
        if not row.done:
            self._active.append(row)

    def _limits(self, rows: list[Sequence], events: list[StepEvent]) -> list[tuple[Sequence, int]]:
        """(row, the tokens it drafts this step) for the rows that still have room in the context: at most what its
        block, max_new_tokens, the context and max_step_tokens leave, as the width policy of the row and the batch
        policy of the step choose (policy.py)."""
        per_row = None
        if self.max_step_tokens is not None:
            per_row = max(1, self.max_step_tokens // max(1, len(rows)))
        out = []
        for row in rows:
            n = row.tokens.numel()
            room = self.target.max_context - n  # positions n-1 .. n-1+G must stay inside the context
            if room < 0:
                self._finish(row, events)
                continue
            g = max(0, min(row.block - 1, row.config.max_new_tokens - row.produced - 1, room))
            if per_row is not None:
                g = min(g, per_row - 1)
            out.append((row, g))
        limits = [g for _, g in out]
        out = [(row, row.width.choose(g)) for row, g in out]
        if not self.batch_policy.drafts([(row.gain.value, g) for row, g in out]):
            self.plain_steps += 1
            out = [(row, 0) for row, _ in out]
        for (row, g), limit in zip(out, limits):
            row.width.record(g, limit)
        return out

    def _propose(self, limits: list[tuple[Sequence, int]], events: list[StepEvent]) -> list[Plan]:
        """Every row's candidates, in one call per proposer class. A row whose proposal fails is failed alone (a
        call that raises is retried row by row to find it)."""
        plans: dict[int, Plan] = {}
        groups: dict[type, list[int]] = {}
        for i, (row, _) in enumerate(limits):
            groups.setdefault(type(row.proposer), []).append(i)
        for cls, idx in groups.items():
            try:
                plans.update(self._propose_rows(cls, limits, idx))
            except Exception:  # noqa: BLE001 - find the row(s) at fault; the others draft alone
                for i in idx:
                    try:
                        plans.update(self._propose_rows(cls, limits, [i]))
                    except Exception as e:  # noqa: BLE001
                        self._fail_row(limits[i][0], events, "drafting", e)
        return [plans[i] for i in range(len(limits)) if i in plans]

    def _propose_rows(self, cls: type, limits: list[tuple[Sequence, int]], idx: list[int]) -> dict[int, Plan]:
        made, dt = propose(cls, [limits[i][0] for i in idx], [limits[i][1] for i in idx], self.target.vocab_size)
        self.batch_policy.drafted(dt, sum(1 for p in made if p.tree.num_nodes > 1))
        return dict(zip(idx, made))

    def _decode_step(self, events: list[StepEvent]) -> None:
        limits = self._limits([r for r in self._active if not r.done], events)
        if not limits:
            return
        plans = self._propose(limits, events)
        if not plans:
            return
        t2 = time.perf_counter()
        try:
            outs = forward_plans(self.target, plans, self.taps)
        except Exception:  # noqa: BLE001 - find the row(s) at fault: each row again on its own
            outs = []
            kept = []
            for p in plans:
                try:
                    outs += forward_plans(self.target, [p], self.taps)
                    kept.append(p)
                except Exception as e:  # noqa: BLE001
                    self._fail_row(p.row, events, "verification", e)
            plans = kept
        dt = time.perf_counter() - t2
        self.batched_forwards += len(plans) > 1
        for plan, out in zip(plans, outs):
            row = plan.row
            n = row.tokens.numel()
            try:
                step, g = verify(plan, out, n, bool(self.taps))
            except Exception as e:  # noqa: BLE001
                self._fail_row(row, events, "verification", e)
                continue
            a = step.numel() - 1
            if g > 0:
                row.gain.update(a)
                row.width.observe(g, a)
            row.stats.target_forwards += 1
            row.stats.verify_seconds += dt
            row.stats.accept_lengths.append(a + 1)
            row.stats.record(g, a)
            row.tokens = torch.cat([row.tokens, step])
            row.produced += a + 1
            self._emit(row, step.tolist(), events)


