"""Decontamination: no training prompt may share a long word n-gram with an eval prompt (the benchmark's math,
code and chat and the user-* sets), boilerplate of the eval tasks' instructions aside."""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from typing import Iterable, Sequence

from ...prompts import TASKS, code
from ...prompts.base import Prompt

# Prompt set: dedupe, decontamination, held-out split
# ----------------------------------------------------------------------------------------------------------------

NGRAM = 13
_WORD = re.compile(r"\w+")


def normalize_text(text: str) -> str:
    return " ".join(text.lower().split())


def prompt_key(p: Prompt) -> str:
    """Normalised text of a prompt (all roles and turns); equal keys are duplicates."""
    parts = [f"{m['role']}: {m['content']}" for m in p.messages] + [f"user: {t}" for t in p.extra_turns]
    return hashlib.sha1(normalize_text("\n".join(parts)).encode()).hexdigest()


def _boilerplate() -> tuple[str, ...]:
    """Instruction text our eval tasks add around the real question; it must not count as overlap."""
    return ("Give the result as your final answer. Do not include units.", code.INSTRUCTION)


def _words(text: str, boilerplate: Sequence[str] = ()) -> list[str]:
    for b in boilerplate:
        text = text.replace(b, " ")
    return _WORD.findall(text.lower())


class Decontaminator:
    """Flags texts that share a `n`-word n-gram with, or equal (normalised), any reference text."""

    def __init__(self, references: Iterable[str], n: int = NGRAM, boilerplate: Sequence[str] = ()):
        self.n = n
        self.boilerplate = tuple(boilerplate)
        self.exact: set[str] = set()
        self.grams: set[int] = set()
        self.first_words: set[str] = set()
        for text in references:
            norm = normalize_text(text)
            if norm:
                self.exact.add(norm)
            w = _words(text, self.boilerplate)
            for i in range(len(w) - n + 1):
                self.grams.add(hash(tuple(w[i:i + n])))
                self.first_words.add(w[i])

    def __contains__(self, text: str) -> bool:
        if normalize_text(text) in self.exact:
            return True
        w = _words(text, self.boilerplate)
        n, fw, grams = self.n, self.first_words, self.grams
        return any(w[i] in fw and hash(tuple(w[i:i + n])) in grams for i in range(len(w) - n + 1))


@lru_cache(maxsize=1)
def eval_decontaminator() -> Decontaminator:
    """Reference n-grams of every eval prompt (math, code, chat): each user message and every extra turn."""
    refs = []
    for loader in TASKS.values():
        for p in loader():
            refs += [m["content"] for m in p.messages if m["role"] == "user"] + list(p.extra_turns)
            refs.append(p.user_text)
    return Decontaminator(refs, boilerplate=_boilerplate())
