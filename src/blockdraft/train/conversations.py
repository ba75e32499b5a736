"""Training records from existing conversations (no regeneration): the first user turn rendered with the target's
chat template, followed by the dataset's own first answer as the loss-masked response.

Regenerated answers (train/data.py) match the target's own distribution and are what the paper trains on; existing
answers are free, so on a CPU budget they are mixed in to cover more text than regeneration can produce in time.
"""

from __future__ import annotations

from typing import Iterable

from .data import chat_token_ids


def conversation_record(tokenizer, cid: str, messages: list[dict], max_len: int) -> dict | None:
    """(id, messages) -> record with input_ids = prompt + first answer (+ end-of-turn), or None if there is no
    user turn followed by an assistant answer."""
    for i, m in enumerate(messages):
        if m["role"] == "user" and m["content"].strip():
            if i + 1 < len(messages) and messages[i + 1]["role"] == "assistant" and messages[i + 1]["content"].strip():
                prompt = chat_token_ids(tokenizer, [m])
                answer = tokenizer.encode(messages[i + 1]["content"], add_special_tokens=False)
                if tokenizer.eos_token_id is not None:
                    answer = answer + [int(tokenizer.eos_token_id)]
                ids = (prompt + answer)[:max_len]
                if len(ids) <= len(prompt) + 1:
                    return None
                return {"id": cid, "input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * (len(ids) - len(prompt))}
            return None
    return None


def conversation_records(tokenizer, conversations: Iterable[tuple[str, list[dict]]], max_len: int = 512,
                         keep_ids: set[str] | None = None) -> list[dict]:
    """Records for every usable conversation whose id is in keep_ids (when given)."""
    out = []
    for cid, msgs in conversations:
        if keep_ids is not None and cid not in keep_ids:
            continue
        rec = conversation_record(tokenizer, cid, msgs, max_len)
        if rec is not None:
            out.append(rec)
    return out
