"""One row of the engine: a sequence's committed tokens, cache, proposer, policies, stops and streaming state."""

from __future__ import annotations

import time
from typing import Hashable

import torch

from ..config import GenerationConfig, SamplingParams
from ..models.target import TargetModel
from .policy import RunningMean, SharedMeasures, WidthPolicy
from .proposers import Proposer
from .sampling import argmax, logits_to_probs, make_generator, sample
from .stats import DecodeStats, GenerationResult
from .stops import stop_text_cut, tokens_through_stop


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
                 text: bool, proposer: Proposer, stops: set[int], decode, width_cost=None,
                 shared: SharedMeasures | None = None) -> None:
        """width_cost: a `calibrate.VerifyCost` for an adaptive chain width (`policy.WidthPolicy`), None: fixed;
        shared: what the engine's rows measure together (`policy.SharedMeasures`)."""
        self.rid, self.prompt, self.config, self.sampling, self.text = rid, prompt, config, sampling, text
        self.proposer = proposer
        self.block = proposer.block_size  # the engine's spec, resolved once for every row
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
        self.gain = RunningMean()  # tokens a drafted step committed beyond one (the batch policy reads it)
        cost = width_cost if proposer.adapts_width else None
        pool = shared.pool(max(0, proposer.block_size - 1), sampling.greedy) if shared and cost else None
        self.width = WidthPolicy(proposer.block_size, cost, pool, shared.draft_seconds if shared else None)
        self.stats.widths = self.width.widths

    def admit(self, target: TargetModel) -> None:
        """Take a slot: the row's generator and its cache (room for the whole generation plus one verify, so the
        preallocated cache never has to grow)."""
        if not self.sampling.greedy:
            self.generator = make_generator(self.sampling.seed, target.device)
        self.t0 = time.perf_counter()
        width = max(self.block, self.proposer.max_width)
        self.cache = target.new_decode_cache(min(target.max_context,
                                                 self.prompt.numel() + self.config.max_new_tokens + width + 1))
        self.prefilled = 0
        self.prompt_features = []

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
        self.stats.tree = self.proposer.describe()
        full = self._decode(self.new)
        if self.config.stop_strings:
            full = full[: stop_text_cut(full, self.config.stop_strings)]
        delta = full[self.emitted:] if self.text and len(full) > self.emitted else ""
        self.emitted = max(self.emitted, len(full))
        finish = "cancelled" if self.cancelled else self.finish
        self.cache = None  # its memory goes as soon as the row is done
        return delta, GenerationResult(token_ids=list(self.new), text=full, finish_reason=finish, stats=self.stats)

