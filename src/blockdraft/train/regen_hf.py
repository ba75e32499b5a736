"""Regeneration through HF `generate` in large left-padded batches: the path for GPUs.

On a CPU the engine (`data.regenerate`) writes the target's answers as it serves them, on the target's own quantized
weights. A GPU has the throughput to answer tens of thousands of prompts in minutes, through the HF modules on float
weights (for a GGUF target, the file's blocks dequantized): greedy answers that agree with the engine's token for
token except where two candidates are within rounding of each other, which is what training data needs.

Prompts are given as chat-formatted token ids; answers keep the end-of-turn token when the model wrote one, like the
engine's records (`records.py` format: prompt + answer, loss mask on the answer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .data import plan_batches


@dataclass
class HFRegenStats:
    prompts: int = 0  # prompts given
    answered: int = 0  # answers produced before the deadline
    new_tokens: int = 0  # answer tokens (end-of-turn included)
    finished: int = 0  # answers that ended with an end-of-turn token (the rest hit max_new_tokens)
    batches: int = 0
    splits: int = 0  # batches answered in halves because the device ran out of memory
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def cut_answer(row: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """A generated row [new tokens, then padding] -> the answer: up to and including the first end-of-turn token,
    else the whole row."""
    eos = set(int(e) for e in eos_ids)
    out = []
    for t in row:
        out.append(int(t))
        if int(t) in eos:
            break
    return out


def _generate_rows(model, prompts: Sequence[Sequence[int]], eos: list[int], pad_id: int, max_new_tokens: int,
                   device: torch.device) -> list[list[int]]:
    """One left-padded batch through `generate` -> each row's new tokens (padding after an end-of-turn included)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        att[r, width - len(p):] = 1
    out = model.generate(input_ids=ids.to(device), attention_mask=att.to(device), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad_id,
                         temperature=None, top_p=None, top_k=None)
    return out[:, width:].tolist()


@torch.no_grad()
def generate_batched(model, prompts: Sequence[Sequence[int]], *, eos_ids: Sequence[int], pad_id: int,
                     max_new_tokens: int, batch_size: int, window: int = 2, deadline: float | None = None,
                     on_batch: Callable[[list[int], list[list[int]]], None] | None = None) -> HFRegenStats:
    """Greedy answers of `prompts` (token ids) through `model.generate` in left-padded batches of `batch_size`,
    longest first within windows of `window` batches (`plan_batches`). After each batch, on_batch(indices into
    prompts, their answers) is called, so a caller can write them as they come; no batch starts after `deadline`
    (time.time()). A batch that runs out of device memory is answered in halves. Returns the totals."""
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError("batch_size and max_new_tokens must be >= 1")
    device = next(model.parameters()).device
    stats = HFRegenStats(prompts=len(prompts))
    t0 = time.perf_counter()
    eos = [int(e) for e in eos_ids]
    pending = [list(b) for b in plan_batches([len(p) for p in prompts], batch_size, window * batch_size)]
    while pending:
        if deadline is not None and time.time() >= deadline:
            break
        idx = pending.pop(0)
        try:
            rows = _generate_rows(model, [prompts[i] for i in idx], eos, pad_id, max_new_tokens, device)
        except torch.OutOfMemoryError:
            # a batch too large for the device's memory is answered in halves: the answers are the same (each row
            # is its own greedy decode), only the batch's shape changes
            if len(idx) == 1:
                raise
            if device.type == "cuda":
                torch.cuda.empty_cache()
            half = len(idx) // 2
            pending[:0] = [idx[:half], idx[half:]]
            stats.splits += 1
            continue
        answers = [cut_answer(r, eos) for r in rows]
        stats.batches += 1
        stats.answered += len(idx)
        stats.new_tokens += sum(len(a) for a in answers)
        stats.finished += sum(1 for a in answers if a and a[-1] in eos)
        if on_batch is not None:
            on_batch(list(idx), answers)
    stats.seconds = time.perf_counter() - t0
    return stats
