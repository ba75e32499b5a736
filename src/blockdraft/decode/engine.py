"""The decode engine: one step function for every caller (generate, chat, serve, bench, regeneration).

An `Engine` decodes up to `max_batch` sequences ("rows") at once; rows join and leave between steps, and a single
generation (`generate`, `stream`) is a batch of one through the same `step`. One step:
1. rows marked cancelled are dropped;
2. waiting rows are admitted while there is room: each is prefilled on its own cache (in chunks of `prefill_chunk`
   tokens), picks its first token and starts its proposer;
3. every row proposes: a chain of up to G_i drafts, or a candidate tree (its own width); rows whose proposers share
   a batched forward (the DFlash draft) draft in one call (`Proposer.propose_rows`);
4. ONE target forward verifies every row (`TargetModel.forward_rows`): the projections and the MLP read each weight
   once for all rows, each row attends over its own cache;
5. each row is verified on its own (greedy or rejection sampling with its own seeded generator, chain or tree),
   commits a_i + 1 tokens, crops (chain) or compacts (tree) its cache, and is checked for stops (EOS, stop ids,
   stop strings, max tokens), streaming only text that can no longer become a stop string.

Invariant at the top of every step, per row (n = committed tokens, prompt included): its cache holds n-1 positions
(the last committed token t is not in it yet) and a feature-conditioned proposer holds context for the same n-1.
A chain step feeds [t, d_1..d_G] at positions n-1..n-1+G, commits a+1 tokens and crops the cache to n+a; a tree step
feeds every node at position n-1+depth and keeps the accepted path's keys/values at n-1..n-1+a. With no proposer
(G = 0) the same step is plain autoregressive decoding, the fair baseline.

Each row has its own preallocated cache, so rows of any lengths share a step without padding or holes, and a row
leaving costs nothing. On the native stack a row's numbers do not depend on the other rows (every output row gets
the same float operations whatever the batch), so a batched row is its solo run bit for bit; the tests check
batched == solo == naive, token for token, in fp32 on tiny random models.

Large batches: drafting multiplies the tokens each step verifies, and on a CPU a verify of many rows is bound by
compute, not by reading the weights, so past some batch size drafting costs more than it commits. With
`batch_cost` (the target's measured verify cost per width, `calibrate.VerifyCost`) a step of two or more rows
drafts only when it is expected to commit more tokens per second than a plain step: expected tokens = the rows'
running tokens per drafted step, cost = verify(all rows' candidates) + the measured draft time, against rows /
verify(one token per row); every EXPLORE_EVERY plain steps in a row one step drafts anyway, so the figures stay
measured. A step that does not draft verifies each row's last token alone (its proposer's context is still kept up
to date). `draft_max_batch` is a fixed cap instead (no drafting while more rows are active); `max_step_tokens`
shares a budget of verified positions among the rows.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Iterator

import torch

from ..config import GenerationConfig, SamplingParams
from .proposers import NoDraft, Proposal, Proposer
from .sampling import argmax, logits_to_probs, make_generator, sample
from ..models.target import TargetModel
from .tree import ancestor_mask, check_tree
from .verify import greedy_verify, rejection_verify
from .verify_tree import greedy_verify_tree, rejection_verify_tree

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # prompt tokens per prefill forward: bounds the activations a long prompt needs at once
EXPLORE_EVERY = 16  # with batch_cost: after this many plain steps in a row, one step drafts to measure again
GAIN_PRIOR = 1.0  # tokens a drafted step commits beyond the verified one, before a row has measured its own


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verify step (a + 1)
    position_accepted: list[int] = field(default_factory=list)  # [B-1] times draft position i was accepted
    position_trials: list[int] = field(default_factory=list)  # [B-1] times draft position i was verified
    target_forwards: int = 0  # prefill included
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0  # a batched draft forward's wall time counts for every row in it
    verify_seconds: float = 0.0  # likewise the batched target forward's
    total_seconds: float = 0.0
    tree_nodes: list[int] = field(default_factory=list)  # tree methods: candidate nodes verified per step
    tree: dict | None = None  # tree methods: the proposer's settings (budget, calibration)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step (accepted drafts + the bonus/recovered token)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def decode_seconds(self) -> float:
        return self.total_seconds - self.prefill_seconds

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens committed by verify steps per second of decoding (prefill and its first token excluded)."""
        s = self.decode_seconds
        return sum(self.accept_lengths) / s if s > 0 else 0.0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        while len(self.position_trials) < num_drafted:
            self.position_trials.append(0)
            self.position_accepted.append(0)
        for i in range(num_drafted):
            self.position_trials[i] += 1
            if i < num_accepted:
                self.position_accepted[i] += 1

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "tau": self.tau,
            "accept_lengths": self.accept_lengths, "position_accepted": self.position_accepted,
            "position_trials": self.position_trials, "target_forwards": self.target_forwards,
            "prefill_seconds": self.prefill_seconds, "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds, "total_seconds": self.total_seconds,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            **({"tree_nodes": self.tree_nodes, "tree": self.tree} if self.tree is not None else {}),
        }


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens, a stop token included when one ended generation
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    stats: DecodeStats
    error: str | None = None  # with finish_reason "error": what failed this row (the other rows went on)
    exception: BaseException | None = field(default=None, repr=False, compare=False)  # ... and the exception


class StepError(RuntimeError):
    """A step failed outside any one row (the engine's own bookkeeping). `events` holds what the step had already
    produced (rows that finished or streamed before the failure): they must still reach their callers."""

    def __init__(self, message: str, events: list) -> None:
        super().__init__(message)
        self.events = events


@dataclass
class StepEvent:
    """What one step did for one row. A row may get two events in one step (its prefill token, then a verify).

    text: the new text delta (empty when held back, or when the row was added with text=False);
    num_tokens: the row's committed new-token count so far (after stop truncation);
    finished: the row is done; `result` then holds its GenerationResult (finish_reason "stop", "length",
    "cancelled" or "error"), and this is the row's last event.
    """

    request_id: Hashable
    text: str
    num_tokens: int
    finished: bool = False
    result: GenerationResult | None = None


class Generation:
    """Iterator over text deltas of one generation; `.result` is set once it is exhausted."""

    def __init__(self, it: Iterator[str]) -> None:
        self._it = it
        self.result: GenerationResult | None = None

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> str:
        return next(self._it)

    def close(self) -> None:
        """Stop early: the generation's row is dropped and the engine is free for the next one."""
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


def stop_text_cut(text: str, stop_strings) -> int:
    """Index where the earliest stop string starts in `text` (len(text) if none occurs)."""
    cuts = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(cuts) if cuts else len(text)


def tokens_through_stop(decode, new: list[int], start: int, stop_strings) -> int | None:
    """If decode(new) contains a stop string, how many tokens of `new` are needed to reach its end (None if no
    stop string occurs). `start` = tokens already scanned in earlier steps (a stop can straddle the boundary)."""
    full = decode(new)
    cut = stop_text_cut(full, stop_strings)
    if cut == len(full):
        return None
    end = next(cut + len(s) for s in stop_strings if full.find(s) == cut)
    for k in range(max(1, start - 8), len(new) + 1):
        if len(decode(new[:k])) >= end:
            return k
    return len(new)


def check_prompt(target: TargetModel, prompt_ids) -> torch.Tensor:
    """Validate prompt token ids for `target` -> [n] int64 on its device (a clear ValueError otherwise)."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=target.device)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError("prompt must be a non-empty 1-D sequence of token ids")
    if int(ids.max()) >= target.vocab_size or int(ids.min()) < 0:
        raise ValueError(f"prompt has token ids outside the target's vocabulary (0..{target.vocab_size - 1})")
    if ids.numel() >= target.max_context:
        raise ValueError(f"prompt has {ids.numel()} tokens but the target's context is {target.max_context}"
                         " tokens (at least one must remain for the answer)")
    return ids


def pick_token(logits: torch.Tensor, sampling: SamplingParams, generator) -> torch.Tensor:
    """logits [V] -> one token (argmax, or a draw from the processed distribution)."""
    if sampling.greedy:
        return argmax(logits)
    return sample(logits_to_probs(logits, sampling), generator)


class Sequence:
    """One row: its committed tokens, cache, proposer, generator, stop and streaming bookkeeping, statistics."""

    def __init__(self, rid: Hashable, prompt: torch.Tensor, config: GenerationConfig, sampling: SamplingParams,
                 text: bool, proposer: Proposer, stops: set[int], decode) -> None:
        self.rid, self.prompt, self.config, self.sampling, self.text = rid, prompt, config, sampling, text
        self.proposer = proposer
        self.block = config.block_size or proposer.block_size
        self.stops = stops
        self._decode = decode
        self.hold = max((len(s) for s in config.stop_strings), default=0)
        self.generator: torch.Generator | None = None
        self.cache = None  # the target cache, made at admission
        self.tokens = prompt  # committed tokens, prompt included
        self.produced = 0  # tokens committed by the decode loop (before stop truncation)
        self.new: list[int] = []  # new tokens after stop truncation
        self.emitted = 0  # characters of text already streamed
        self.finish = "length"
        self.cancelled = False
        self.done = False
        self.stats = DecodeStats(prompt_tokens=prompt.numel())
        self.t0 = 0.0
        self.prefilled = 0  # prompt tokens already in the cache
        self.prompt_features: list[torch.Tensor] = []  # tapped features of the prefilled chunks
        self.last_logits: torch.Tensor | None = None  # the last prefilled position's logits
        self.gain: float | None = None  # running mean of the tokens a drafted step committed beyond one

    def push(self, chunk: list[int]) -> tuple[str, bool]:
        """Add newly committed tokens; return (text delta, whether the row is finished). Text is held back while
        it could still become a stop string or ends in an incomplete UTF-8 sequence."""
        cfg, new = self.config, self.new
        start = len(new)
        new.extend(chunk)
        del new[cfg.max_new_tokens:]
        hit = next((i for i in range(start, len(new)) if new[i] in self.stops), None)
        if hit is not None:
            del new[hit + 1:]
            self.finish = "stop"
        if cfg.stop_strings:
            cut = tokens_through_stop(self._decode, new, start, cfg.stop_strings)
            if cut is not None:
                del new[cut:]
                self.finish = "stop"
        done = self.finish == "stop" or len(new) >= cfg.max_new_tokens
        delta = ""
        if self.text:
            full = self._decode(new)
            safe = len(full) if done else len(full) - self.hold
            while safe > self.emitted and full[safe - 1] == "\ufffd":  # an incomplete multi-byte character
                safe -= 1
            if cfg.stop_strings and self.finish == "stop":
                safe = min(safe, stop_text_cut(full, cfg.stop_strings))
            if safe > self.emitted:
                delta = full[self.emitted:safe]
                self.emitted = safe
        return delta, done

    def finalize(self) -> tuple[str, GenerationResult]:
        """The last text delta and the result."""
        self.stats.new_tokens = len(self.new)
        self.stats.total_seconds = time.perf_counter() - self.t0 if self.t0 else 0.0
        if self.proposer.proposes_trees:
            self.stats.tree = self.proposer.describe()
        full = self._decode(self.new)
        if self.config.stop_strings:
            full = full[: stop_text_cut(full, self.config.stop_strings)]
        delta = full[self.emitted:] if self.text and len(full) > self.emitted else ""
        self.emitted = max(self.emitted, len(full))
        finish = "cancelled" if self.cancelled else self.finish
        self.cache = None  # its memory goes as soon as the row is done
        return delta, GenerationResult(token_ids=list(self.new), text=full, finish_reason=finish, stats=self.stats)


@dataclass
class _Plan:
    """One row's part of a step: what it feeds the target and how to verify it."""

    row: Sequence
    ids: torch.Tensor  # [W] the last committed token, then the candidates
    positions: torch.Tensor | None  # [W], None = consecutive after the cache
    tree_mask: torch.Tensor | None  # [W, W] for a tree that is not a chain
    proposal: Proposal | None = None  # a chain
    tree: object | None = None  # a tree.Tree


class Engine:
    """Speculative decoding of many sequences with one target and one proposer (None: plain decoding). Not
    thread-safe: one thread owns it and calls `step` (the server's worker does); `cancel` only sets a flag and may
    be called from anywhere.

    max_batch: rows decoded together (more wait); max_step_tokens: optional budget of verified positions per step,
    shared evenly by the rows (each drafts at most max_step_tokens // rows - 1); draft_max_batch: draft only while at
    most this many rows are active (None: no cap); batch_cost: a `calibrate.VerifyCost` of this target, for the
    measured per-step choice between drafting and a plain step when two or more rows are active (None: always
    draft); prefill_chunk: prompt tokens per prefill forward. Greedy output never depends on these, only the
    acceptance statistics and the speed do.
    """

    def __init__(self, target: TargetModel, proposer: Proposer | None = None, tokenizer=None, *,
                 max_batch: int = 8, max_step_tokens: int | None = None, draft_max_batch: int | None = None,
                 batch_cost=None, prefill_chunk: int = PREFILL_CHUNK) -> None:
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
        self.max_batch, self.max_step_tokens, self.draft_max_batch = max_batch, max_step_tokens, draft_max_batch
        self.batch_cost = batch_cost
        self._draft_row_s: float | None = None  # running mean of the draft's time per drafting row in a step
        self._plain_run = 0  # plain steps in a row (batch_cost's exploration)
        self.prefill_chunk = prefill_chunk
        self._tap = bool(self.proposer.layer_ids)
        if self._tap:
            target.set_layer_ids(self.proposer.layer_ids)
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
        row = Sequence(rid, prompt, config, sampling, text, self._row_proposer(), stops, self._decode)
        self._pending.append(row)
        self._by_id[rid] = row
        return rid

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
            if self._tap and self.target.layer_ids != tuple(self.proposer.layer_ids):
                # engines may share one target (bench, comparisons): tap what this engine's proposer reads
                self.target.set_layer_ids(self.proposer.layer_ids)
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
        """Give a row its slot: its generator and its cache; its prompt is prefilled by `_prefill`."""
        target, prompt = self.target, row.prompt
        if not row.sampling.greedy:
            row.generator = make_generator(row.sampling.seed, target.device)
        row.t0 = time.perf_counter()
        # room for the whole generation plus one verify, so the preallocated cache never has to grow
        width = max(row.block, row.proposer.max_width)
        row.cache = target.new_decode_cache(min(target.max_context,
                                                prompt.numel() + row.config.max_new_tokens + width + 1))
        row.prefilled = 0
        row.prompt_features = []
        self._prefilling.append(row)

    def _prefill(self, events: list[StepEvent]) -> None:
        """Prefill waiting prompts chunk by chunk, oldest row first: everything when no row is decoding, else one
        chunk this step (see `step`). A row whose prompt is done picks its first token and starts decoding."""
        one_chunk = bool(self._active)
        while self._prefilling:
            row = self._prefilling[0]
            try:
                self._prefill_chunk(row)
                if row.prefilled == row.prompt.numel():
                    self._prefilling.pop(0)
                    self._first_token(row, events)
            except Exception as e:  # noqa: BLE001 - this row's trouble, not the batch's
                if row in self._prefilling:
                    self._prefilling.remove(row)
                self._fail_row(row, events, "admission", e)
            if one_chunk:
                break

    def _prefill_chunk(self, row: Sequence) -> int:
        """One prefill forward of the row's next prompt chunk (chunk boundaries at multiples of prefill_chunk,
        whatever else the step does); returns the tokens it took."""
        a = row.prefilled
        chunk = row.prompt[a:a + self.prefill_chunk]
        out = self.target.forward(chunk.unsqueeze(0), row.cache, last_only=True, tap=self._tap)
        row.stats.target_forwards += 1
        if self._tap:
            row.prompt_features.append(out.features)
        row.prefilled = a + chunk.numel()
        row.last_logits = out.logits[0, -1]
        return chunk.numel()

    def _first_token(self, row: Sequence, events: list[StepEvent]) -> None:
        """The prompt is in the cache: pick the first token, start the proposer, emit."""
        first = pick_token(row.last_logits, row.sampling, row.generator)
        feats = row.prompt_features
        row.proposer.start(row.prompt, (torch.cat(feats, dim=1) if len(feats) > 1 else feats[0]) if feats else None)
        row.prompt_features, row.last_logits = [], None
        row.stats.prefill_seconds = time.perf_counter() - row.t0
        row.tokens = torch.cat([row.prompt, first.view(1)])
        row.produced = 1
        self._emit(row, [int(first)], events)
        if not row.done:
            self._active.append(row)

    def _limits(self, rows: list[Sequence], events: list[StepEvent]) -> list[tuple[Sequence, int]]:
        """(row, the most tokens it may draft this step) for the rows that still have room in the context."""
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
        if len(out) > 1 and not self._drafting_pays(out):
            self.plain_steps += 1
            self._plain_run += 1
            return [(row, 0) for row, _ in out]
        self._plain_run = 0
        return out

    def _drafting_pays(self, limits: list[tuple[Sequence, int]]) -> bool:
        """Whether this step of several rows should draft (see the module docstring)."""
        if self.draft_max_batch is not None and len(limits) > self.draft_max_batch:
            return False
        cost = self.batch_cost
        if cost is None or not any(g for _, g in limits) or self._plain_run >= EXPLORE_EVERY:
            return True
        b = len(limits)
        width = sum(g + 1 for _, g in limits)
        expected = sum(1.0 + (min(g, row.gain) if row.gain is not None else min(g, GAIN_PRIOR)) for row, g in limits)
        drafting = sum(1 for _, g in limits if g > 0)
        seconds = cost.chain(width) + (self._draft_row_s or 0.0) * drafting
        return expected / seconds > b / cost.chain(b)

    def _propose(self, limits: list[tuple[Sequence, int]], events: list[StepEvent]) -> list[_Plan]:
        """Every row's candidates: trees one by one, chains in batched calls per proposer class. A row whose
        proposal fails is failed alone (a batched call that raises is retried row by row to find it)."""
        plans: dict[int, _Plan] = {}
        chains: dict[type, list[int]] = {}
        for i, (row, g) in enumerate(limits):
            if row.proposer.proposes_trees:
                try:
                    plans[i] = self._propose_tree(row, g)
                except Exception as e:  # noqa: BLE001
                    self._fail_row(row, events, "drafting", e)
            else:
                chains.setdefault(type(row.proposer), []).append(i)
        for cls, idx in chains.items():
            try:
                plans.update(self._propose_chains(cls, limits, idx))
            except Exception:  # noqa: BLE001 - find the row(s) at fault; the others draft alone
                for i in idx:
                    try:
                        plans.update(self._propose_chains(cls, limits, [i]))
                    except Exception as e:  # noqa: BLE001
                        self._fail_row(limits[i][0], events, "drafting", e)
        return [plans[i] for i in range(len(limits)) if i in plans]

    def _propose_tree(self, row: Sequence, g: int) -> _Plan:
        """One row's candidate tree, checked."""
        t1 = time.perf_counter()
        tree = row.proposer.propose_tree(row.tokens, g, row.sampling, row.generator)
        row.stats.draft_seconds += time.perf_counter() - t1
        if tree.max_depth > g:
            raise ValueError(f"malformed tree: depth {tree.max_depth} > the {g} positions left")
        check_tree(tree, self.target.vocab_size)
        if int(tree.tokens[0]) != int(row.tokens[-1]):
            raise ValueError("malformed tree: its root must be the last committed token")
        n = row.tokens.numel()
        # a chain (e.g. a lookup-only step) takes the plain causal path: its ancestor mask is the causal
        # mask, so nothing needs building (and calibrate.py prices it as a chain)
        pos = None if tree.is_chain else tree.depth + (n - 1)
        mask = None if tree.is_chain else ancestor_mask(tree.parents)
        return _Plan(row, tree.tokens, pos, mask, tree=tree)

    def _propose_chains(self, cls: type, limits: list[tuple[Sequence, int]], idx: list[int]) -> dict[int, _Plan]:
        plans: dict[int, _Plan] = {}
        rows = [limits[i][0] for i in idx]
        t1 = time.perf_counter()
        props = cls.propose_rows([r.proposer for r in rows], [r.tokens for r in rows],
                                 [limits[i][1] for i in idx], [r.sampling for r in rows],
                                 [r.generator for r in rows])
        dt = time.perf_counter() - t1
        drafted = sum(1 for p in props if p.tokens.numel())
        if drafted:
            per = dt / drafted
            self._draft_row_s = per if self._draft_row_s is None else 0.8 * self._draft_row_s + 0.2 * per
        for i, row, prop in zip(idx, rows, props):
            row.stats.draft_seconds += dt
            ids = torch.cat([row.tokens[-1:], prop.tokens])
            plans[i] = _Plan(row, ids, None, None, proposal=prop)
        return plans

    def _decode_step(self, events: list[StepEvent]) -> None:
        limits = self._limits([r for r in self._active if not r.done], events)
        if not limits:
            return
        plans = self._propose(limits, events)
        if not plans:
            return
        t2 = time.perf_counter()
        try:
            outs = self._forward(plans)
        except Exception:  # noqa: BLE001 - find the row(s) at fault: each row again on its own
            outs = []
            kept = []
            for p in plans:
                try:
                    outs += self._forward([p])
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
                if plan.tree is not None:
                    step, g = self._verify_tree(plan, out, n)
                else:
                    step, g = self._verify_chain(plan, out, n)
            except Exception as e:  # noqa: BLE001
                self._fail_row(row, events, "verification", e)
                continue
            a = step.numel() - 1
            if g > 0:
                row.gain = a if row.gain is None else 0.8 * row.gain + 0.2 * a
            row.stats.target_forwards += 1
            row.stats.verify_seconds += dt
            row.stats.accept_lengths.append(a + 1)
            row.stats.record(g, a)
            row.tokens = torch.cat([row.tokens, step])
            row.produced += a + 1
            self._emit(row, step.tolist(), events)

    def _forward(self, plans: list[_Plan]) -> list:
        """The target over every plan's tokens in one batched forward. Each row's cache is put back to its length
        before the call if the call fails, so a retry starts from the same state."""
        lengths = [p.row.cache.length for p in plans]
        if any(p.positions is not None for p in plans):
            positions = [p.positions if p.positions is not None else
                         torch.arange(p.row.tokens.numel() - 1, p.row.tokens.numel() - 1 + p.ids.numel(),
                                      device=p.ids.device) for p in plans]
        else:
            positions = None
        try:
            return self.target.forward_rows([p.ids for p in plans], [p.row.cache for p in plans],
                                            positions=positions, tree_masks=[p.tree_mask for p in plans],
                                            tap=self._tap)
        except Exception:
            for p, n in zip(plans, lengths):
                if p.row.cache is not None and p.row.cache.length > n:
                    p.row.cache.crop(n)
            raise

    def _verify_chain(self, plan: _Plan, out, n: int) -> tuple[torch.Tensor, int]:
        row, prop = plan.row, plan.proposal
        if row.sampling.greedy:
            committed, acc = greedy_verify(prop.tokens.unsqueeze(0), out.logits)
        else:
            p = logits_to_probs(out.logits, row.sampling)
            q = prop.probs.unsqueeze(0) if prop.probs is not None else None
            committed, acc = rejection_verify(prop.tokens.unsqueeze(0), q, p, row.generator)
        a = int(acc[0])
        row.cache.crop(n + a)
        if self._tap:
            row.proposer.accept(out.features[:, : a + 1], a + 1)
        return committed[0, : a + 1], prop.tokens.numel()

    def _verify_tree(self, plan: _Plan, out, n: int) -> tuple[torch.Tensor, int]:
        """Acceptance over the tree's nodes, then the cache keeps only the accepted path (in path order, at
        positions n-1 .. n-1+a) and the proposer gets the path's features."""
        row, tree = plan.row, plan.tree
        if row.sampling.greedy:
            path, committed = greedy_verify_tree(tree, out.logits[0])
        else:
            rows = out.logits[0]
            path, committed = rejection_verify_tree(tree, lambda i: logits_to_probs(rows[i], row.sampling),
                                                    row.generator)
        keep = torch.tensor(path, dtype=torch.long, device=tree.tokens.device)
        row.cache.compact(n - 1, keep)
        row.proposer.accept_tree(tree, path, out.features[:, keep] if self._tap else None)
        row.stats.tree_nodes.append(tree.num_nodes - 1)
        return torch.tensor(committed, dtype=torch.long, device=tree.tokens.device), tree.max_depth
