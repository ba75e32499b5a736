"""What decoding reports: per-generation statistics, a generation's result, and the per-step events of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable


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
    widths: list[int] = field(default_factory=list)  # chain methods: tokens drafted per step (`policy.WidthPolicy`)

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

