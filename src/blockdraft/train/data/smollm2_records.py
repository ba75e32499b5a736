"""The default target's training records, shared by its recipes (`recipes/smollm2-135m-*.py`, run from the
repository's root): the regenerated answers (the regeneration's shards
when this checkout ran `smollm2-135m-regen.py`, else the packed copies committed in data/smollm2-regen), the held-out
split, and the original ShareGPT answers of the training prompt set."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from blockdraft.train.conversations import conversation_records
from blockdraft.train.data import select_regeneration_prompts, sharegpt_conversations
from blockdraft.train.records import load_packed, read_shards, validate_record

REGEN = Path("data/work/regen-smollm2")  # recipes/smollm2-135m-regen.py's output (not in git)
PACKED = Path("data/smollm2-regen")  # the regenerated records committed, packed (uint16)


def complete_records(directory: Path) -> list[dict]:
    """Records of the shards, skipping a final line still being written by a running regeneration."""
    out = []
    for path in sorted(directory.glob("shard-*.jsonl")):
        with open(path, encoding="utf-8") as f:  # file iteration splits on "\n" only (not on U+2028 in strings)
            lines = list(f)
        for line in lines:
            if line.endswith("\n") and line.strip():
                out.append(validate_record(json.loads(line), str(path)))
    return out


def regenerated_records() -> list[dict]:
    """The regeneration's shards when this checkout ran it, else the packed copies committed in data/smollm2-regen
    (the same records in the same order: train-000, -001, -002 are consecutive slices of the shards)."""
    if (REGEN / "shards").is_dir():
        return complete_records(REGEN / "shards")
    return [r for p in sorted(PACKED.glob("train-*.npz")) for r in load_packed(p)]


def heldout_records() -> list[dict]:
    if (REGEN / "shards-heldout").is_dir():
        return list(read_shards(REGEN / "shards-heldout"))
    return load_packed(PACKED / "heldout.npz")


def training_prompt_ids(tokenizer) -> list[str]:
    """Ids of the training prompt set (written by the regeneration; rebuilt deterministically if absent)."""
    path = REGEN / "prompts-train.jsonl"
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            return [json.loads(line)["id"] for line in f if line.strip()]
    train, _, _ = select_regeneration_prompts(tokenizer)  # regen_default.py's defaults
    return [p.id for p in train]


def build_records(tokenizer, max_len: int, n_raw: int, seed: int, regen_limit: int | None = None) -> list[dict]:
    regen = regenerated_records()
    # the regeneration appends in a fixed order, so the first N records are the same N in every later run: a
    # limit reproduces an earlier run's data while the regeneration goes on
    regen = regen[:regen_limit] if regen_limit is not None else regen
    for r in regen:
        r["input_ids"], r["loss_mask"] = r["input_ids"][:max_len], r["loss_mask"][:max_len]
    train_ids = set()
    for pid in training_prompt_ids(tokenizer):
        if pid.startswith("sharegpt/"):
            train_ids.add(pid.removeprefix("sharegpt/"))
    done = {r["id"].removeprefix("sharegpt/") for r in regen}
    convs = [(cid, m) for cid, m in sharegpt_conversations() if cid in train_ids and cid not in done]
    random.Random(seed).shuffle(convs)
    raw = conversation_records(tokenizer, convs[: n_raw * 2], max_len)[:n_raw]
    for r in raw:
        r["id"] = "raw/" + r["id"]
    recs = regen + raw
    random.Random(seed).shuffle(recs)
    logging.info("training records: %d regenerated + %d original ShareGPT answers", len(regen), len(raw))
    return recs
