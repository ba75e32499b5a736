"""Batched speculative decoding with continuous batching: many sequences share one target forward per step.

`BatchedEngine` decodes up to `max_batch` sequences ("rows") at once; rows join and leave between steps. One step:
1. rows marked cancelled are dropped;
2. waiting rows are admitted while there is room: each is prefilled *alone* (exactly as `SpeculativeEngine` does,
   so its first token and its proposer's context are those of a solo run) and its KV is merged into the batch cache;
3. every active row proposes up to G_i drafts with its own proposer (the DFlash draft runs per row: it is cheap);
4. ONE batched target forward verifies all rows: row i feeds [t_i, d_1..d_Gi] at its own positions, padded to the
   step width W = max_i(G_i + 1);
5. each row is verified on its own (greedy or rejection sampling with its own seeded generator), commits a_i + 1
   tokens, and is checked for stops (EOS, stop ids, stop strings, max tokens) exactly as the single-sequence engine
   checks them (so nothing past a stop is ever emitted).

Cache with ragged lengths: the batch has ONE Hugging Face `DynamicCache` whose length L (slots) is shared by all
rows and grows by W every step. A boolean `valid` mask [B, L] says which slots hold a row's real tokens; rejected
drafts and padding become permanent holes, hidden from attention by an explicit 2-D attention mask, while explicit
per-row `position_ids` give every token its true position (the keys are stored already rotated, so where a token
sits in the slot axis does not matter). A new row is padded with holes to the batch length (or the batch to its
length) and concatenated along the batch axis. When holes exceed a fraction of the cache, rows are compacted
(valid slots gathered to the front, in order).

Greedy decoding through this engine is token-for-token what `SpeculativeEngine` produces for each request alone
(up to floating-point ties: the batched kernels may round differently in the last bit; the tests check fp32 exactness
on random tiny models). Sampling is per row with the row's own seeded generator, drawn in the same order as the
single-sequence engine does.

Only full-attention caches (plain `DynamicLayer`s: LLaMA/SmolLM2, Qwen2/2.5/3, Mistral without sliding window...)
can be batched this way; sliding-window layers are refused at construction.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

import torch
import torch.nn.functional as F

from .config import GenerationConfig, SamplingParams
from .engine import DecodeStats, GenerationResult, check_prompt, pick_token, stop_text_cut, tokens_through_stop
from .proposers import NoDraft, Proposer
from .sampling import logits_to_probs, make_generator
from .target import TargetModel
from .verify import greedy_verify, rejection_verify

ProposerFactory = Callable[[], Proposer]


@dataclass
class StepEvent:
    """What one step did for one row. A row may get two events in one step (its prefill token, then a verify).

    text: the new text delta (empty when held back, or when the row was added with text=False);
    num_tokens: the row's committed new-token count so far (after stop truncation);
    finished: the row is done; `result` then holds its GenerationResult (finish_reason "stop", "length" or
    "cancelled"), and this is the row's last event.
    """

    request_id: Hashable
    text: str
    num_tokens: int
    finished: bool = False
    result: GenerationResult | None = None


def proposer_factory_for(proposer: Proposer | None) -> ProposerFactory:
    """A factory giving each row its own proposer. Stateless proposers (no draft, prompt lookup) are shared; a DFlash
    proposer is cloned around the same draft weights (each row needs its own draft context cache)."""
    from .proposers.dflash import DFlashProposer
    from .proposers.lookup import PromptLookupProposer

    if proposer is None:
        shared: Proposer = NoDraft()
        return lambda: shared
    if isinstance(proposer, DFlashProposer):
        p = proposer
        # the clones share the prototype's prepacked draft weights (building them costs ~10-20 ms and a copy)
        return lambda: DFlashProposer(p.draft, p.target, p.block_size, p.denoise_steps,
                                      lean=p.lean if p.lean is not None else False)
    if isinstance(proposer, (NoDraft, PromptLookupProposer)):
        return lambda: proposer
    raise ValueError(f"cannot tell whether proposer {type(proposer).__name__} keeps per-sequence state: "
                     "pass proposer_factory= (a callable returning a fresh proposer per row)")


class _Row:
    """One sequence: its committed tokens, proposer, generator, stop bookkeeping and statistics."""

    def __init__(self, rid, prompt: torch.Tensor, config: GenerationConfig, sampling: SamplingParams, text: bool,
                 proposer: Proposer, stops: set[int], decode: Callable[[list[int]], str]) -> None:
        self.rid = rid
        self.prompt = prompt
        self.config = config
        self.sampling = sampling
        self.text = text
        self.proposer = proposer
        self.block = config.block_size or getattr(proposer, "block_size", 1)
        self.stops = stops
        self._decode = decode
        self.hold = max((len(s) for s in config.stop_strings), default=0)
        self.generator: torch.Generator | None = None
        self.tokens = prompt  # committed tokens, prompt included
        self.produced = 0  # tokens committed by the decode loop (before stop truncation)
        self.new: list[int] = []  # new tokens after stop truncation
        self.emitted = 0  # characters of text already streamed
        self.finish = "length"
        self.cancelled = False
        self.done = False
        self.stats = DecodeStats(prompt_tokens=prompt.numel())
        self.t0 = 0.0

    # ------------------------------------------------ the single-sequence engine's stop and streaming rules
    def push(self, chunk: list[int]) -> tuple[str, bool]:
        """Add newly committed tokens; return (text delta, whether the row is finished)."""
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
        full = self._decode(self.new)
        if self.config.stop_strings:
            full = full[: stop_text_cut(full, self.config.stop_strings)]
        delta = full[self.emitted:] if self.text and len(full) > self.emitted else ""
        self.emitted = max(self.emitted, len(full))
        finish = "cancelled" if self.cancelled else self.finish
        return delta, GenerationResult(token_ids=list(self.new), text=full, finish_reason=finish, stats=self.stats)


class BatchedEngine:
    """Continuous-batching speculative decoder. Not thread-safe: one thread owns it and calls `step` (the server's
    worker does); `cancel` only sets a flag and may be called from anywhere.

    target: the TargetModel; proposer: a template proposer (None: plain decoding) from which one proposer per row is
    made (see `proposer_factory_for`), or pass `proposer_factory` directly; tokenizer: for text and stop strings
    (default: the target's); max_batch: rows decoded together (more are kept waiting); max_step_tokens: optional
    budget of verified positions per step, shared evenly by the rows (each row then drafts at most
    max_step_tokens // rows - 1 tokens: on a compute-bound device, wide blocks for many rows cost more than they
    save; greedy output is unchanged, only the acceptance statistics differ from a solo run); compact_fraction:
    compact the cache when more than this fraction of its slots are holes.
    """

    def __init__(self, target: TargetModel, proposer: Proposer | None = None, tokenizer=None, *,
                 max_batch: int = 8, proposer_factory: ProposerFactory | None = None,
                 max_step_tokens: int | None = None, compact_fraction: float = 0.25,
                 compact_min_holes: int = 8) -> None:
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if max_step_tokens is not None and (not isinstance(max_step_tokens, int) or max_step_tokens < 1):
            raise ValueError(f"max_step_tokens must be an integer >= 1 or None, got {max_step_tokens!r}")
        self.max_step_tokens = max_step_tokens
        self.target = target
        self.tokenizer = tokenizer if tokenizer is not None else target.tokenizer
        self.max_batch = max_batch
        self._factory = proposer_factory or proposer_factory_for(proposer)
        probe = self._factory()
        self.proposer_name = getattr(probe, "name", type(probe).__name__)
        self.block_size = getattr(probe, "block_size", 1)
        self._tap = bool(probe.layer_ids)
        if probe.layer_ids:
            target.set_layer_ids(probe.layer_ids)
        self.compact_fraction = compact_fraction
        self.compact_min_holes = compact_min_holes
        self._check_cache_kind()
        self._ids = itertools.count()
        self._pending: list[_Row] = []
        self._active: list[_Row] = []  # aligned with the batch axis of the cache
        self._by_id: dict[Hashable, _Row] = {}
        self._cache = None  # TargetCache of the active rows (None when there are none)
        self._valid: torch.Tensor | None = None  # [B, L] bool: slot holds a real token of that row
        # counters, for tests and metrics
        self.steps = 0
        self.batched_forwards = 0
        self.compactions = 0
        self.max_cache_slots = 0

    # ------------------------------------------------------------------------------------------ public API
    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def has_work(self) -> bool:
        return bool(self._active or self._pending)

    @property
    def cache_slots(self) -> int:
        return 0 if self._valid is None else int(self._valid.shape[1])

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
        row = _Row(rid, prompt, config, sampling, text, self._factory(), stops, self._decode)
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
        self._active.clear()
        self._by_id.clear()
        self._cache, self._valid = None, None
        return ids

    def step(self) -> list[StepEvent]:
        """One scheduling step: drop cancelled rows, admit waiting rows, verify all active rows in one forward."""
        events: list[StepEvent] = []
        with torch.no_grad():
            self._drop_cancelled(events)
            while self._pending and len(self._active) < self.max_batch:
                self._admit(self._pending.pop(0), events)
            if self._active:
                self._verify_step(events)
            self._remove_finished()
            self._maybe_compact()
        self.steps += 1
        return events

    def run(self, requests: Iterable[tuple], text: bool = False) -> list[GenerationResult]:
        """Convenience: decode (prompt_ids, config, sampling) tuples to completion, batched; results in order."""
        ids = [self.add(*req, text=text) for req in requests]
        results: dict = {}
        while len(results) < len(ids):
            for ev in self.step():
                if ev.finished:
                    results[ev.request_id] = ev.result
        return [results[i] for i in ids]

    # ------------------------------------------------------------------------------------------- internals
    def _check_cache_kind(self) -> None:
        from transformers.cache_utils import DynamicLayer

        layers = getattr(self.target.new_cache().hf, "layers", None)
        if layers is None or any(type(layer) is not DynamicLayer for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers or []})
            raise NotImplementedError(f"batched decoding supports full-attention caches only (DynamicLayer), this "
                                      f"target's cache has {kinds or 'no layers'}")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _emit(self, row: _Row, chunk: list[int], events: list[StepEvent]) -> None:
        delta, done = row.push(chunk)
        if done:
            self._finish(row, events, delta)
        else:
            events.append(StepEvent(row.rid, delta, len(row.new)))

    def _finish(self, row: _Row, events: list[StepEvent], delta: str = "") -> None:
        last, result = row.finalize()
        row.done = True
        self._by_id.pop(row.rid, None)
        events.append(StepEvent(row.rid, delta + last, len(row.new), finished=True, result=result))

    def _drop_cancelled(self, events: list[StepEvent]) -> None:
        for row in [r for r in self._pending if r.cancelled]:
            self._pending.remove(row)
            self._finish(row, events)
        for row in self._active:
            if row.cancelled and not row.done:
                self._finish(row, events)
        self._remove_finished()

    def _admit(self, row: _Row, events: list[StepEvent]) -> None:
        """Prefill one row alone (as the single-sequence engine does), then merge its KV into the batch cache."""
        target = self.target
        if not row.sampling.greedy:
            row.generator = make_generator(row.sampling.seed, target.device)
        row.t0 = time.perf_counter()
        cache = target.new_cache()
        out = target.forward(row.prompt.unsqueeze(0), cache, last_only=True, tap=self._tap)
        row.stats.target_forwards += 1
        first = pick_token(out.logits[0, -1], row.sampling, row.generator)
        row.proposer.start(row.prompt, out.features)
        row.stats.prefill_seconds = time.perf_counter() - row.t0
        row.tokens = torch.cat([row.prompt, first.view(1)])
        row.produced = 1
        self._emit(row, [int(first)], events)
        if row.done:
            return
        self._merge(cache, row.prompt.numel())
        self._active.append(row)

    def _layers(self, cache=None):
        return (cache or self._cache).hf.layers

    def _merge(self, cache, n0: int) -> None:
        """Append a prefilled row (cache of n0 positions) to the batch axis, padding whichever side is shorter."""
        row_valid = torch.ones(1, n0, dtype=torch.bool, device=self.target.device)
        if self._cache is None:
            self._cache, self._valid = cache, row_valid
            return
        length = self._valid.shape[1]
        new_len = max(length, n0)
        for bl, rl in zip(self._layers(), self._layers(cache)):
            bl.keys = torch.cat([F.pad(bl.keys, (0, 0, 0, new_len - length)),
                                 F.pad(rl.keys, (0, 0, 0, new_len - n0))], dim=0)
            bl.values = torch.cat([F.pad(bl.values, (0, 0, 0, new_len - length)),
                                   F.pad(rl.values, (0, 0, 0, new_len - n0))], dim=0)
        self._valid = torch.cat([F.pad(self._valid, (0, new_len - length), value=False),
                                 F.pad(row_valid, (0, new_len - n0), value=False)], dim=0)

    def _verify_step(self, events: list[StepEvent]) -> None:
        target = self.target
        max_ctx = target.max_context
        props: list = []
        per_row = None
        if self.max_step_tokens is not None:
            per_row = max(1, self.max_step_tokens // max(1, sum(not r.done for r in self._active)))
        for row in self._active:
            if row.done:
                props.append(None)
                continue
            n = row.tokens.numel()
            room = max_ctx - n  # positions n-1 .. n-1+G must stay inside the context
            if room < 0:
                self._finish(row, events)
                props.append(None)
                continue
            num_draft = max(0, min(row.block - 1, row.config.max_new_tokens - row.produced - 1, room))
            if per_row is not None:
                num_draft = min(num_draft, per_row - 1)
            t1 = time.perf_counter()
            props.append(row.proposer.propose(row.tokens, num_draft, row.sampling, row.generator))
            row.stats.draft_seconds += time.perf_counter() - t1
        if all(p is None for p in props):
            return
        b = len(self._active)
        widths = [0 if p is None else p.tokens.numel() + 1 for p in props]
        width = max(widths)
        device = target.device
        ids = torch.zeros(b, width, dtype=torch.long, device=device)
        pos = torch.zeros(b, width, dtype=torch.long, device=device)
        new_mask = torch.zeros(b, width, dtype=torch.bool, device=device)
        for i, (row, p) in enumerate(zip(self._active, props)):
            n = row.tokens.numel()
            pos[i] = (torch.arange(width, device=device) + n - 1).clamp(max=max_ctx - 1)
            if p is None:  # a finished row still in the batch: its slots become holes
                continue
            ids[i, 0] = row.tokens[-1]
            ids[i, 1: widths[i]] = p.tokens
            new_mask[i, : widths[i]] = True
        attn = torch.cat([self._valid, new_mask], dim=1)
        t2 = time.perf_counter()
        hidden, feats = self._forward(ids, pos, attn)
        # LM head over the real positions only (padding would waste a [W, V] product per short row)
        flat_logits = target.logits(hidden[new_mask])  # [sum of widths, V], row-major like the mask
        t3 = time.perf_counter()
        self.batched_forwards += 1
        committed_mask = torch.zeros_like(new_mask)
        chunks: list[tuple[_Row, list[int]]] = []
        offset = 0
        for i, (row, p) in enumerate(zip(self._active, props)):
            if p is None:
                continue
            g = widths[i] - 1
            row_logits = flat_logits[offset: offset + g + 1].unsqueeze(0)
            offset += g + 1
            if row.sampling.greedy:
                committed, acc = greedy_verify(p.tokens.unsqueeze(0), row_logits)
            else:
                probs = logits_to_probs(row_logits, row.sampling)
                q = p.probs.unsqueeze(0) if p.probs is not None else None
                committed, acc = rejection_verify(p.tokens.unsqueeze(0), q, probs, row.generator)
            a = int(acc[0])
            committed_mask[i, : a + 1] = True
            if self._tap:
                row.proposer.accept(feats[i: i + 1, : a + 1], a + 1)
            row.stats.target_forwards += 1
            row.stats.verify_seconds += t3 - t2  # the shared forward's wall time
            row.stats.accept_lengths.append(a + 1)
            row.stats.record(g, a)
            step = committed[0, : a + 1]
            row.tokens = torch.cat([row.tokens, step])
            row.produced += a + 1
            chunks.append((row, step.tolist()))
        self._valid = torch.cat([self._valid, committed_mask], dim=1)
        self.max_cache_slots = max(self.max_cache_slots, self._valid.shape[1])
        for row, chunk in chunks:
            self._emit(row, chunk, events)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, attn: torch.Tensor):
        """The batched target forward over [B, W] new tokens with explicit positions and a 2-D slot mask ->
        (final hidden states [B, W, H], tapped features [B, W, K*H] or None)."""
        hidden, feats = self.target.hidden(ids, self._cache, positions=pos, attention_mask=attn, tap=self._tap)
        expected = attn.shape[1]
        if self._cache.length != expected:
            raise RuntimeError(f"batch cache has {self._cache.length} slots after the forward, expected {expected}")
        return hidden, feats

    def _remove_finished(self) -> None:
        keep = [i for i, r in enumerate(self._active) if not r.done]
        if len(keep) == len(self._active):
            return
        self._active = [self._active[i] for i in keep]
        if not keep:
            self._cache, self._valid = None, None
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.target.device)
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, idx)
            layer.values = layer.values.index_select(0, idx)
        self._valid = self._valid.index_select(0, idx)
        # drop slots that are holes in every remaining row (cheap, no gather)
        used = self._valid.any(0).nonzero()
        last = int(used.max()) + 1 if used.numel() else 0
        if last < self._valid.shape[1]:
            for layer in self._layers():
                layer.keys = layer.keys[:, :, :last]
                layer.values = layer.values[:, :, :last]
            self._valid = self._valid[:, :last]

    def _maybe_compact(self) -> None:
        if self._valid is None:
            return
        length = self._valid.shape[1]
        counts = self._valid.sum(1)
        longest = int(counts.max())
        holes = length - longest
        if holes < self.compact_min_holes or holes <= self.compact_fraction * length:
            return
        # valid slots first, in their order (a stable sort of the hole flags), cut to the longest row
        order = torch.sort((~self._valid).to(torch.int8), dim=1, stable=True).indices[:, :longest]
        for layer in self._layers():
            b, h, _, d = layer.keys.shape
            idx = order[:, None, :, None].expand(b, h, longest, d)
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
        self._valid = torch.arange(longest, device=self._valid.device).unsqueeze(0) < counts.unsqueeze(1)
        self.compactions += 1
