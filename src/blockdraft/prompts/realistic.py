"""Prompts written the way users write them, for evaluation only: everyday math word problems, small coding tasks
in several languages and everyday chat, twelve of each (`data/realistic.jsonl`).

The benchmark's own prompt sets share a format with what the drafts learn from (GSM-style templates, HumanEval
completions that repeat their signature), so a draft can look good on them by remembering that format. These
prompts follow no template and never enter training (the training prompt set is decontaminated against every eval
task, this one included), so tau on them measures how a draft generalises. Tasks: `user-math`, `user-code`,
`user-chat`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from .base import Prompt, iter_jsonl

DATA = Path(__file__).with_name("data") / "realistic.jsonl"
KINDS = ("math", "code", "chat")


@lru_cache(maxsize=1)
def _all() -> tuple[Prompt, ...]:
    out = []
    for obj, where, _ in iter_jsonl(DATA):
        if obj.get("task") not in KINDS or not isinstance(obj.get("prompt"), str):
            raise ValueError(f"{where}: expected {{'id', 'task' in {KINDS}, 'prompt': str}}")
        out.append(Prompt(id=obj["id"], task=f"user-{obj['task']}",
                          messages=[{"role": "user", "content": obj["prompt"]}]))
    return tuple(out)


def loader(kind: str):
    """The loader of task `user-<kind>` (a tuple of its prompts in file order)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")

    def load_all() -> tuple[Prompt, ...]:
        return tuple(p for p in _all() if p.task == f"user-{kind}")

    return load_all
