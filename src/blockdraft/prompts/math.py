"""Math evaluation prompts: GSM-style problems from reasoning-gym's `gsm_symbolic` generator plus the word-problem
sets shipped in OpenAI `evals`' registry data.

`gsm_symbolic` instantiates ~85 templates (GSM8K problems with their numbers and names made variables). Two items
of the same template share long word n-grams, so the templates are split once, deterministically, into an eval
half (used here) and a training half (used by `blockdraft.train.data.gsm_prompts`); training data can then hold
GSM-style problems without overlapping the eval set.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache

from .base import Prompt, package_data_path

TASK = "math"
GSM_SEED = 0  # reasoning-gym seed of the eval items; training uses other seeds
GSM_EVAL_SIZE = 200
_TEMPLATE_SPLIT_SEED = 20240611

# (directory, file) under evals/registry/data: word problems whose user turn is a self-contained question.
EVALS_WORD_PROBLEMS = (
    ("algebra_word_problems", "samples.jsonl"),
    ("multistep-word-problems", "samples.jsonl"),
    ("probabilities-word-problems", "samples.jsonl"),
    ("math_for_5th-grader", "samples.jsonl"),
    ("simple_math", "simple_math.jsonl"),
)


def _gsm_templates() -> list[int]:
    try:
        from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import tasks_ok
    except ImportError:  # layout changed: no split; decontamination still protects the eval set
        return []
    return sorted(tasks_ok)


@lru_cache(maxsize=1)
def gsm_template_split() -> tuple[frozenset[int], frozenset[int]]:
    """(eval_templates, train_templates): a fixed, seeded half/half split of gsm_symbolic's template ids."""
    t = _gsm_templates()
    random.Random(_TEMPLATE_SPLIT_SEED).shuffle(t)
    half = len(t) // 2
    return frozenset(t[:half]), frozenset(t[half:])


def gsm_symbolic_items(seed: int, count: int, templates: frozenset[int] | None):
    """Yield (index, question) for the first `count` gsm_symbolic items of `seed` whose template is in
    `templates` (None or empty: any template). Deterministic."""
    import reasoning_gym

    start, size, got = 0, max(64, count * 3), 0
    while True:  # item i depends only on (seed, i), so growing the dataset keeps earlier items unchanged
        ds = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
        tids = getattr(ds, "task_indices", None)
        for idx in range(start, size):
            if templates and tids is not None and tids[idx] not in templates:
                continue
            yield idx, ds[idx]["question"]
            got += 1
            if got >= count:
                return
        start, size = size, size * 2


def _evals_word_problems() -> list[Prompt]:
    out = []
    seen = set()
    for dirname, fname in EVALS_WORD_PROBLEMS:
        try:
            path = package_data_path("evals", "registry", "data", dirname, fname)
        except FileNotFoundError:
            continue
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue  # (git-LFS pointer or damaged line): not a sample
                msgs = obj.get("input") if isinstance(obj, dict) else None
                if not isinstance(msgs, list):
                    continue
                users = [m.get("content") for m in msgs if isinstance(m, dict) and m.get("role") == "user"]
                if not users or not isinstance(users[-1], str) or not users[-1].strip():
                    continue
                q = users[-1].strip()
                if q in seen:
                    continue
                seen.add(q)
                out.append(Prompt(id=f"{TASK}/evals-{dirname}-{lineno}", task=TASK,
                                  messages=[{"role": "user", "content": q}]))
    return out


@lru_cache(maxsize=1)
def load_all() -> tuple[Prompt, ...]:
    """Every math eval prompt in canonical order: gsm_symbolic items first, then the evals word problems."""
    eval_templates, _ = gsm_template_split()
    items = [Prompt(id=f"{TASK}/gsm-{idx:05d}", task=TASK, messages=[{"role": "user", "content": q}])
             for idx, q in gsm_symbolic_items(GSM_SEED, GSM_EVAL_SIZE, eval_templates)]
    return tuple(items + _evals_word_problems())
