"""Training data for the draft: prompt sources, a deduplicated + decontaminated prompt set with a held-out split,
regeneration of the answers by the target itself into resumable JSONL shards (the shard and packing formats:
`records.py`).

The draft learns to predict what the *target* would write, so only prompts are taken from the datasets; answers are
regenerated with the target's own chat template and decoding (greedy by default).

Record format (one JSON object per line in `shard-NNNNN.jsonl`)::

    {"id": str, "input_ids": [prompt tokens + response tokens], "loss_mask": [0 per prompt token, 1 per response token]}

Modules: sources.py (ShareGPT, GSM-style math, JSONL), decontamination.py, prompt_set.py (dedup, decontamination,
held-out split), regeneration.py (the target's answers into shards, the prompts a run answers, and with a
`RecordSpec` the answers' teacher data from the same pass), smollm2_records.py (the default target's records as its
recipes read them).
"""

from .decontamination import NGRAM, Decontaminator, eval_decontaminator, normalize_text, prompt_key
from .prompt_set import PromptSetReport, build_prompt_set, write_prompts_jsonl
from .regeneration import (SORT_WINDOW_BATCHES, RecordSpec, RegenReport, chat_token_ids, pending_of_task,
                           plan_batches, regenerate, run_regeneration, select_regeneration_prompts)
from .sources import (GSM_SYMBOLIC_SHARE, OTHER_MATH_GENERATORS, SHAREGPT_FILE, TRAIN_SEED_OFFSET, gsm_prompts,
                      jsonl_prompts, parse_json_array_tolerant, sharegpt_conversations, sharegpt_path,
                      sharegpt_prompts)

__all__ = ["GSM_SYMBOLIC_SHARE", "NGRAM", "OTHER_MATH_GENERATORS", "SHAREGPT_FILE", "SORT_WINDOW_BATCHES",
           "TRAIN_SEED_OFFSET", "Decontaminator", "PromptSetReport", "RecordSpec", "RegenReport", "build_prompt_set",
           "chat_token_ids", "eval_decontaminator", "gsm_prompts", "jsonl_prompts", "normalize_text",
           "parse_json_array_tolerant", "pending_of_task", "plan_batches", "prompt_key", "regenerate",
           "run_regeneration", "select_regeneration_prompts", "sharegpt_conversations", "sharegpt_path",
           "sharegpt_prompts", "write_prompts_jsonl"]
