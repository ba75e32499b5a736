"""Evaluation prompt sets: `load_task("math" | "code" | "chat", n, seed)` and user JSONL files.

Every set has a canonical order; `load_task` applies a shuffle seeded by `seed`, so `load_task(name, n=k, seed=s)`
is always a prefix of `load_task(name, seed=s)`. Parsed sets are cached in memory for the process.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

from . import chat, code, math, realistic
from .base import Prompt, read_prompts_jsonl

TASKS: dict[str, Callable[[], tuple[Prompt, ...]]] = {
    "math": math.load_all,
    "code": code.load_all,
    "chat": chat.load_all,
    # prompts as users write them (no template shared with training): generalisation, reported apart
    "user-math": realistic.loader("math"),
    "user-code": realistic.loader("code"),
    "user-chat": realistic.loader("chat"),
}


def load_task(name: str, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """The prompts of task `name`, shuffled deterministically with `seed`; the first `n` of them if `n` is given."""
    try:
        loader = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}") from None
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    items = list(loader())
    random.Random(seed).shuffle(items)
    return items if n is None else items[:n]


def load_prompts_file(path: str | Path) -> list[Prompt]:
    """Prompts from a user JSONL file: one `{"prompt": str}` or `{"messages": [...]}` object per line (optional
    `id`, `extra_turns`). A corrupt line raises ValueError naming the file and line number."""
    return read_prompts_jsonl(path, task=Path(path).stem)


__all__ = ["Prompt", "TASKS", "load_task", "load_prompts_file"]
