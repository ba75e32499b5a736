"""The prompt set: sources deduplicated, decontaminated against the eval tasks and split into train and held-out
prompts by a hash of each prompt (stable when sources grow)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from ...prompts.base import Prompt
from .decontamination import Decontaminator, eval_decontaminator, prompt_key

@dataclass
class PromptSetReport:
    total: int = 0
    duplicates: int = 0
    contaminated: int = 0
    train: int = 0
    heldout: int = 0
    contaminated_ids: list[str] = field(default_factory=list)
    by_task: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def _is_heldout(key: str, seed: int, fraction: float) -> bool:
    h = hashlib.sha1(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def build_prompt_set(sources: Iterable[Iterable[Prompt]] | Mapping[str, Iterable[Prompt]], seed: int = 0,
                     heldout_fraction: float = 0.02, decontaminate: bool = True,
                     decontaminator: Decontaminator | None = None,
                     ) -> tuple[list[Prompt], list[Prompt], PromptSetReport]:
    """Merge prompt sources into (train, heldout, report).

    * dedupe: prompts with the same normalised text (all roles/turns) keep their first occurrence;
    * decontamination (on by default): drop prompts whose user text shares a 13-word n-gram with, or equals, any
      eval prompt (`blockdraft.prompts`: math, code, chat);
    * split: a prompt is held out iff a hash of (seed, its normalised text) falls under `heldout_fraction` - stable
      under adding or removing other prompts. Input order is kept in both lists.
    Prompt ids must be unique across sources (a clash with different text raises ValueError).
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    groups = sources.values() if isinstance(sources, Mapping) else sources
    deco = decontaminator if decontaminator is not None else (eval_decontaminator() if decontaminate else None)
    rep = PromptSetReport()
    seen_keys: set[str] = set()
    ids: dict[str, str] = {}
    train, held = [], []
    for group in groups:
        for p in group:
            rep.total += 1
            stats = rep.by_task.setdefault(p.task, {"total": 0, "duplicates": 0, "contaminated": 0})
            stats["total"] += 1
            key = prompt_key(p)
            if key in seen_keys:
                rep.duplicates += 1
                stats["duplicates"] += 1
                continue
            seen_keys.add(key)
            if p.id in ids:
                raise ValueError(f"prompt id {p.id!r} is used by two different prompts")
            ids[p.id] = key
            if deco is not None and p.user_text in deco:
                rep.contaminated += 1
                stats["contaminated"] += 1
                rep.contaminated_ids.append(p.id)
                continue
            (held if _is_heldout(key, seed, heldout_fraction) else train).append(p)
    rep.train, rep.heldout = len(train), len(held)
    return train, held, rep


def write_prompts_jsonl(prompts: Iterable[Prompt], path: str | Path) -> None:
    """Write prompts (id, task, messages, extra_turns) atomically; `jsonl_prompts` reads them back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------------
