"""Stop strings and streaming: where a stop string cuts the text, how many tokens reach it, and the iterator of text
deltas that one generation streams."""

from __future__ import annotations

from typing import Iterator

from .stats import GenerationResult


class Generation:
    """Iterator over text deltas of one generation; `.result` is set once it is exhausted."""

    def __init__(self, it: Iterator[str]) -> None:
        self._it = it
        self.result: GenerationResult | None = None

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> str:
        return next(self._it)

    def close(self) -> None:
        """Stop early: the generation's row is dropped and the engine is free for the next one."""
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


def stop_text_cut(text: str, stop_strings) -> int:
    """Index where the earliest stop string starts in `text` (len(text) if none occurs)."""
    cuts = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(cuts) if cuts else len(text)


def tokens_through_stop(decode, new: list[int], start: int, stop_strings) -> int | None:
    """If decode(new) contains a stop string, how many tokens of `new` are needed to reach its end (None if no
    stop string occurs). `start` = tokens already scanned in earlier steps (a stop can straddle the boundary)."""
    full = decode(new)
    cut = stop_text_cut(full, stop_strings)
    if cut == len(full):
        return None
    end = next(cut + len(s) for s in stop_strings if full.find(s) == cut)
    for k in range(max(1, start - 8), len(new) + 1):
        if len(decode(new[:k])) >= end:
            return k
    return len(new)

