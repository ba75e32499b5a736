"""Wider training prompt families: what a draft needs to see to generalise past the few templates it was first
trained on.

Sources (each deterministic for its seed; all merged, deduplicated and decontaminated by `build_prompt_set`):
- `sharegpt-turn`: later user turns of ShareGPT conversations, with the conversation so far as context (the first
  turns are `data.sharegpt_prompts`);
- `rgym`: every reasoning-gym task family (puzzles, logic, strings, lists, arithmetic, ...), training seeds only;
  gsm_symbolic stays with `data.gsm_prompts`, which keeps the math benchmark's templates out;
- `evals`: the chat prompts of the OpenAI `evals` registry data files (hundreds of small tasks of every kind);
- `instruct`: everyday instructions, explanations, writing and small coding tasks in several languages, each task
  phrased several ways.
The eval tasks (`blockdraft.prompts`: the benchmark's math/code/chat and the `user-*` prompts) are the
decontamination references, so none of these ever shares a 13-word n-gram with an evaluation prompt.
"""

from __future__ import annotations

import glob
import json
import logging
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..models.loading import load_hf_target
from ..prompts.base import Prompt
from .data import (TRAIN_SEED_OFFSET, build_prompt_set, chat_token_ids, gsm_prompts, sharegpt_conversations,
                   sharegpt_prompts)
from .live import prompt_of
from .records import load_records

log = logging.getLogger(__name__)

MAX_PROMPT_CHARS = 2400  # longer prompts cost prefill and rarely fit the token cap anyway
CONTEXT_TURN_CHARS = 1200  # an earlier assistant turn kept as context is cut to this many characters


def sharegpt_turn_prompts(max_turn: int = 3) -> list[Prompt]:
    """User turns 2..max_turn of every ShareGPT conversation, each with the conversation before it (earlier
    assistant turns cut to CONTEXT_TURN_CHARS): the draft sees follow-up questions, not only openers."""
    out = []
    seen: set[str] = set()
    for cid, msgs in sharegpt_conversations():
        history: list[dict] = []
        n_user = 0
        for m in msgs:
            if m["role"] == "system":
                if not history:
                    history.append(m)
                continue
            if m["role"] == "user":
                if not m["content"].strip():
                    break
                n_user += 1
                if n_user >= 2 and history and history[-1]["role"] == "assistant":
                    pid = f"sharegpt-turn/{cid}/{n_user}"
                    if pid not in seen and len(m["content"]) <= MAX_PROMPT_CHARS:
                        seen.add(pid)
                        out.append(Prompt(id=pid, task="sharegpt-turn", messages=history + [dict(m)]))
                if n_user >= max_turn:
                    break
                history = history + [dict(m)]
            else:
                history = history + [{"role": "assistant", "content": m["content"][:CONTEXT_TURN_CHARS]}]
    return out


# families whose questions are mostly long grids or dumps, or that need an extra argument
_RGYM_SKIP = {"composite", "gsm_symbolic", "codeio", "rectangle_count", "boxnet", "mahjong_puzzle", "arc_agi",
              "rearc", "needle_haystack"}


def rgym_prompts(per_family: int, seed: int = 3) -> list[Prompt]:
    """`per_family` questions from every reasoning-gym family (training seeds; see _RGYM_SKIP)."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    out = []
    for name in sorted(DATASETS):
        if name in _RGYM_SKIP:
            continue
        try:
            ds = reasoning_gym.create_dataset(name, size=per_family,
                                              seed=TRAIN_SEED_OFFSET + seed * 1000 + zlib.crc32(name.encode()) % 1000)
            items = [ds[i]["question"] for i in range(per_family)]
        except Exception as e:  # noqa: BLE001 - a family that fails to build is left out, the rest stand
            log.warning("reasoning-gym %s left out (%s)", name, e)
            continue
        out += [Prompt(id=f"rgym/s{seed}/{name}-{i}", task="rgym", messages=[{"role": "user", "content": q}])
                for i, q in enumerate(items) if len(q) <= MAX_PROMPT_CHARS]
    return out


def _mostly_ascii(text: str) -> bool:
    return sum(c.isascii() for c in text) >= 0.9 * max(1, len(text))


def evals_prompts(per_file: int, seed: int = 5) -> list[Prompt]:
    """Up to `per_file` chat prompts from each data file of the `evals` registry (seeded choice): lines whose
    `input` is a message list ending with a user turn, mostly ASCII, at most MAX_PROMPT_CHARS in all."""
    import importlib.util

    spec = importlib.util.find_spec("evals")
    if spec is None or not spec.submodule_search_locations:
        log.warning("the evals package is not installed: no evals prompts")
        return []
    root = Path(list(spec.submodule_search_locations)[0]) / "registry" / "data"
    out = []
    for path in sorted(root.rglob("*.jsonl")):
        if path.stat().st_size > 64 << 20:
            continue
        rel = path.relative_to(root).as_posix()
        items = []
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.startswith("version https://git-lfs"):
                        break
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    msgs = obj.get("input") if isinstance(obj, dict) else None
                    if not isinstance(msgs, list) or not msgs:
                        continue
                    clean = [{"role": m.get("role"), "content": m.get("content")} for m in msgs if isinstance(m, dict)]
                    if (len(clean) != len(msgs) or clean[-1]["role"] != "user"
                            or any(m["role"] not in ("system", "user", "assistant") or not isinstance(m["content"], str)
                                   for m in clean)):
                        continue
                    text = "".join(m["content"] for m in clean)
                    if len(text) <= MAX_PROMPT_CHARS and _mostly_ascii(text) and clean[-1]["content"].strip():
                        items.append(clean)
        except (OSError, UnicodeDecodeError):
            continue
        rng = random.Random(f"{seed}:{rel}")
        rng.shuffle(items)
        out += [Prompt(id=f"evals/{rel}#{i}", task="evals", messages=m) for i, m in enumerate(items[:per_file])]
    return out


# ------------------------------------------------------------------------------------------- templated instructions
_LANGS = ("Python", "JavaScript", "TypeScript", "Java", "C", "C++", "C#", "Go", "Rust", "Ruby", "PHP", "Kotlin",
          "Swift", "Bash")
_CODE_TASKS = (
    "reverses the words in a sentence", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "finds the second largest value in a list", "flattens a nested list",
    "converts Celsius to Fahrenheit", "checks whether two strings are anagrams", "removes duplicates from a list "
    "while keeping the order", "merges two sorted lists into one sorted list", "computes the factorial of a number",
    "validates an email address", "finds the most frequent element in a list", "rotates an array by k positions",
    "checks whether a string is a palindrome", "converts a number to its binary representation",
    "splits a list into chunks of a given size", "computes the greatest common divisor of two numbers",
    "sums the digits of an integer", "capitalizes the first letter of every word", "returns the intersection of "
    "two lists", "finds all pairs in a list that sum to a target", "implements binary search",
    "implements bubble sort", "implements a simple queue", "counts the lines in a text file",
    "parses a date string and returns the day of the week", "generates a random password of a given length",
    "computes the average of the numbers in a list", "finds the longest word in a sentence",
    "converts a Roman numeral to an integer", "checks whether a year is a leap year", "transposes a matrix",
    "computes the running total of a list", "groups words by their first letter", "counts word frequencies in a text",
    "reads a JSON file and prints one field", "computes compound interest", "formats a number with thousands "
    "separators", "returns the difference in days between two dates", "checks balanced parentheses in a string",
    "finds the missing number in a list from 1 to n", "truncates a string to a maximum length with an ellipsis",
    "implements a simple stack", "converts a string to snake_case", "finds the median of a list",
    "calculates the area of a circle", "returns the unique characters of a string", "shuffles a list",
    "implements a linked list with insert and delete",
)
_CODE_ASKS = (
    "Write a {lang} function that {task}.", "How do I write a function in {lang} that {task}?",
    "Can you show me {lang} code that {task}?", "I need a {lang} function that {task}. Please explain it briefly.",
    "Write a short {lang} program that {task}, with an example.", "In {lang}, what's a clean way to write code that "
    "{task}?",
)
_TOPICS = (
    "photosynthesis", "inflation", "the water cycle", "black holes", "vaccines", "compound interest", "machine "
    "learning", "the stock market", "climate change", "DNA", "the immune system", "electric cars", "blockchain",
    "the French Revolution", "plate tectonics", "how the internet works", "supply and demand", "the Roman Empire",
    "renewable energy", "how airplanes fly", "the greenhouse effect", "antibiotics", "recycling", "gravity",
    "the human heart", "solar panels", "cryptocurrency", "the moon's phases", "evolution", "earthquakes",
    "sleep", "meditation", "credit scores", "the Renaissance", "volcanoes", "nutrition labels", "time zones",
    "cloud computing", "open source software", "the printing press", "democracy", "taxes", "insurance",
    "the periodic table", "rainbows", "tides", "batteries", "microwaves", "GPS", "password security",
    "the Industrial Revolution", "coral reefs", "bees and pollination", "the speed of light", "interest rates",
    "photosynthesis in the ocean", "artificial intelligence", "budgeting", "composting", "jet lag",
)
_EXPLAIN = (
    "Explain {topic} in simple terms.", "Can you explain {topic} to a 10-year-old?", "What is {topic}?",
    "Give me a short overview of {topic}.", "How does {topic} work?", "What are three interesting facts about "
    "{topic}?", "Why does {topic} matter?", "Write a short paragraph about {topic} for a school report.",
)
_WRITING = (
    "Write a short email to my {who} asking to {what}.", "Help me write a polite message to my {who} to {what}.",
    "Draft a text message to my {who} to {what}.", "Write a friendly note to my {who} to {what}.",
)
_WHO = ("manager", "neighbor", "landlord", "teacher", "colleague", "friend", "doctor's office", "team", "client",
        "sister", "coach")
_WHAT = ("reschedule our meeting", "say thank you for their help", "ask for a day off next Friday",
         "apologize for missing the deadline", "invite them to a dinner party", "ask about the project status",
         "complain politely about noise at night", "ask for feedback on my work", "confirm an appointment",
         "ask to borrow a ladder", "share some good news", "ask for a recommendation letter")
_EVERYDAY = (
    "What are some tips for {x}?", "How can I get better at {x}?", "Give me a simple plan for {x}.",
    "What mistakes should I avoid when {x}?", "I want to start {x}. Where do I begin?",
)
_X = ("saving money", "learning a new language", "cooking healthy meals", "running a 5k", "staying focused while "
      "studying", "keeping houseplants alive", "public speaking", "writing a resume", "moving to a new city",
      "planning a wedding", "traveling on a budget", "learning to play guitar", "organizing my closet",
      "getting more sleep", "making friends as an adult", "negotiating a salary", "starting a small business",
      "training a puppy", "reducing stress", "learning to code", "taking better photos", "hosting a dinner party",
      "studying for exams", "buying a first home", "growing vegetables on a balcony")
_CREATIVE = (
    "Write a short poem about {s}.", "Write a four-line rhyme about {s}.", "Write a short story (under 200 words) "
    "about {s}.", "Give me five creative names for a business about {s}.", "Write a product description for {s}.",
)
_S = ("autumn leaves", "a lost cat", "the ocean at night", "a robot learning to paint", "a rainy Monday",
      "friendship", "a small bakery", "a trip to the mountains", "the first day of school", "a dragon who is afraid "
      "of fire", "coffee", "a city at dawn", "a reusable water bottle", "a time traveler", "a garden in spring")


def instruction_prompts(seed: int = 11) -> list[Prompt]:
    """Everyday instructions, explanations, writing and coding tasks in several languages: every (task, slot)
    pair once, each with a phrasing chosen at random (seeded), so one task never appears in one wording only."""
    rng = random.Random(seed)
    plans = (  # kind, its slots, the phrasings one slot gets (drawn in this order: the seed fixes every text)
        ("code", [{"task": t, "lang": lang} for t in _CODE_TASKS for lang in _LANGS], lambda: [rng.choice(_CODE_ASKS)]),
        ("explain", [{"topic": t} for t in _TOPICS], lambda: rng.sample(_EXPLAIN, 4)),
        ("write", [{"who": w, "what": x} for w in _WHO for x in _WHAT], lambda: [rng.choice(_WRITING)]),
        ("everyday", [{"x": x} for x in _X], lambda: rng.sample(_EVERYDAY, 3)),
        ("creative", [{"s": s} for s in _S], lambda: list(_CREATIVE)),
    )
    items = [(kind, ask.format(**slot)) for kind, slots, asks in plans for slot in slots for ask in asks()]
    return [Prompt(id=f"instruct/{kind}-{i}", task="instruct", messages=[{"role": "user", "content": text}])
            for i, (kind, text) in enumerate(items)]


def wide_sources(rgym_per_family: int = 120, evals_per_file: int = 24, n_gsm: int = 6000,
                 seed: int = 0) -> dict[str, list[Prompt]]:
    """Every source of the wide prompt set, first turns first (so that dedupe keeps the older prompts' ids)."""
    return {
        "sharegpt": sharegpt_prompts(),
        "gsm": gsm_prompts(n_gsm, seed=seed + 1),
        "sharegpt-turn": sharegpt_turn_prompts(),
        "rgym": rgym_prompts(rgym_per_family),
        "evals": evals_prompts(evals_per_file),
        "instruct": instruction_prompts(),
    }


def wide_prompt_set(sources: dict[str, Sequence[Prompt]], seed: int = 0, heldout_fraction: float = 0.02):
    """(train, heldout, report) over the wide sources: deduped, decontaminated against every eval task, split by a
    stable hash; each side shuffled (seeded) so that any prefix is a mix of all families."""
    train, held, rep = build_prompt_set(sources, seed=seed, heldout_fraction=heldout_fraction)
    random.Random(seed + 7).shuffle(train)
    random.Random(seed + 8).shuffle(held)
    return train, held, rep


# ------------------------------------------------------------------------------------------- tokenized prompt files
def write_tokenized(tokenizer, prompts: Sequence[Prompt], path: str | Path, max_prompt_tokens: int = 512,
                    skip: set[tuple[int, ...]] = frozenset()) -> dict[str, int]:
    """Chat-format and tokenize `prompts` into one compressed `.npz` (`tokens` flat uint16, or uint32 for a
    vocabulary over 65,536 tokens, `offsets` [n+1],
    `ids`, `tasks`): what a GPU regeneration round reads (no tokenizer or data package needed there). Prompts over
    `max_prompt_tokens`, and prompts whose token ids are in `skip` (already answered), are left out. Returns the
    count kept per task."""

    kept: list[tuple[str, str, list[int]]] = []
    for p in prompts:
        ids = chat_token_ids(tokenizer, p.messages)
        if len(ids) <= max_prompt_tokens and tuple(ids) not in skip:
            kept.append((p.id, p.task, ids))
    dtype = np.uint32 if any(max(ids) > 0xFFFF for _, _, ids in kept) else np.uint16
    offsets = np.zeros(len(kept) + 1, dtype=np.int64)
    np.cumsum([len(ids) for _, _, ids in kept], out=offsets[1:])
    tokens = (np.concatenate([np.asarray(ids, dtype=dtype) for _, _, ids in kept]) if kept
              else np.zeros(0, dtype))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, tokens=tokens, offsets=offsets, ids=np.array([k[0] for k in kept], dtype=str),
                            tasks=np.array([k[1] for k in kept], dtype=str))
    tmp.replace(path)
    counts: dict[str, int] = {}
    for _, task, _ in kept:
        counts[task] = counts.get(task, 0) + 1
    return counts


def read_tokenized(path: str | Path) -> tuple[list[str], list[list[int]]]:
    """(ids, token id lists) back from `write_tokenized`'s file; ValueError if its arrays disagree."""

    z = np.load(path)
    tok, off, ids = z["tokens"].astype(np.int64), z["offsets"], z["ids"]
    if len(off) != len(ids) + 1 or off[0] != 0 or off[-1] != len(tok) or (np.diff(off) < 0).any():
        raise ValueError(f"{path}: {len(ids)} ids, {len(off)} offsets and {len(tok)} tokens disagree")
    return [str(i) for i in ids], [tok[off[k]:off[k + 1]].tolist() for k in range(len(ids))]


def prompt_ids_of_records(records) -> set[tuple[int, ...]]:
    """The prompt token ids of regenerated records (the part before the loss mask starts)."""
    return {tuple(prompt_of(r)) for r in records}


@dataclass(frozen=True)
class WidePromptsConfig:
    """`blockdraft wide-prompts`: out: the directory written (prompts-train.npz, prompts-heldout.npz,
    prompt-card.json); exclude: a glob of records (packed, or JSONL shard directories) whose prompts are already
    answered; heldout: held-out prompts written (of the ~2% held out)."""

    out: str
    target: str | None = None
    exclude: str | None = None
    max_prompt_tokens: int = 512
    heldout: int = 480
    seed: int = 0


def write_wide_prompts(cfg: WidePromptsConfig) -> dict:
    """The wide prompt set, tokenized with the target's tokenizer into cfg.out; returns the prompt card."""
    _, tok, _ = load_hf_target(cfg.target, dtype="bf16")
    train, held, rep = wide_prompt_set(wide_sources(seed=cfg.seed), seed=cfg.seed)
    done = prompt_ids_of_records(r for f in sorted(glob.glob(cfg.exclude)) for r in load_records(f)) \
        if cfg.exclude else set()
    out = Path(cfg.out)
    card = {"prompt_set": {k: v for k, v in rep.to_json().items() if k != "contaminated_ids"},
            "already_answered": len(done), "max_prompt_tokens": cfg.max_prompt_tokens,
            "train": write_tokenized(tok, train, out / "prompts-train.npz", cfg.max_prompt_tokens, done),
            "heldout": write_tokenized(tok, held[: cfg.heldout], out / "prompts-heldout.npz",
                                       cfg.max_prompt_tokens, done)}
    (out / "prompt-card.json").write_text(json.dumps(card, indent=1) + "\n")
    return card
