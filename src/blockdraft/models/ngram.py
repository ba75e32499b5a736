"""N-gram lookup in committed tokens: what followed the most recent earlier occurrence of the current suffix.

Shared by prompt-lookup decoding (`proposers/lookup.py`), the tree proposer's lookup branches, and the draft's copy
gate (`copy_gate.py`, in decoding and in training), so it sits below all of them: plain functions of token ids,
no model involved.
"""

from __future__ import annotations

import numpy as np
import torch


def find_continuation(tokens: torch.Tensor, num_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> torch.Tensor:
    """tokens [L] -> up to `num_tokens` tokens that followed the most recent earlier occurrence of the longest
    matching suffix n-gram (max_ngram >= n >= min_ngram); an empty tensor when nothing matches."""
    return lookup_continuation(tokens, num_tokens, max_ngram, min_ngram)[0]


def lookup_continuation(tokens: torch.Tensor, num_tokens: int, max_ngram: int = 3,
                        min_ngram: int = 1) -> tuple[torch.Tensor, int]:
    """`find_continuation` and the length n of the suffix n-gram that matched (0 when nothing matched)."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    L = tokens.numel()
    empty = tokens.new_zeros(0)
    if num_tokens <= 0:
        return empty, 0
    # numpy on a CPU view: a decode step calls this once per draft, and torch's per-op overhead was most of its cost
    t = tokens.numpy() if tokens.device.type == "cpu" else tokens.cpu().numpy()
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        if n < 1:
            break
        # n-grams starting at 0 .. L-n-1: every one that ends before the last position (the suffix itself, which
        # starts at L-n, is excluded, and each earlier one has at least one token after it)
        hit = t[: L - n] == t[L - n]
        for i in range(1, n):
            hit &= t[i: L - n + i] == t[L - n + i]
        starts = np.flatnonzero(hit)
        if starts.size:
            start = int(starts[-1]) + n
            return tokens[start: start + num_tokens].clone(), n
    return empty, 0


def lookup_table(tokens: np.ndarray, num_tokens: int, max_ngram: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """`lookup_continuation` of every prefix at once, in one pass: row p is what it returns for tokens[:p+1]
    (min_ngram 1). -> (cont [L, num_tokens] int64 with -1 past a continuation's end, n [L] int64, 0 = no match).
    Training uses it to give each block the candidates decoding would see at that anchor; one dict per n-gram
    length holds the end of its most recent occurrence, so the pass is O(L * max_ngram) instead of O(L^2)."""
    toks = np.asarray(tokens, dtype=np.int64).tolist()
    L = len(toks)
    cont = np.full((L, num_tokens), -1, dtype=np.int64)
    nmatch = np.zeros(L, dtype=np.int64)
    last_end: list[dict] = [dict() for _ in range(max_ngram + 1)]  # n -> {n-gram: end index of latest occurrence}
    for p in range(L):
        if p >= 1:  # n-grams ending at p-1 become searchable: each has at least one token after it within [:p+1]
            for n in range(1, min(max_ngram, p) + 1):
                last_end[n][tuple(toks[p - n: p])] = p - 1
        for n in range(min(max_ngram, p), 0, -1):
            e = last_end[n].get(tuple(toks[p - n + 1: p + 1]))
            if e is not None:
                c = toks[e + 1: min(e + 1 + num_tokens, p + 1)]
                cont[p, : len(c)] = c
                nmatch[p] = n
                break
    return cont, nmatch


def find_continuations(tokens: torch.Tensor, num_tokens: int, max_ngram: int = 3, min_ngram: int = 1,
                       max_branches: int = 2) -> list[tuple[list[int], int]]:
    """Up to `max_branches` different continuations, each as (tokens: up to `num_tokens` of them, n: the length of
    the suffix n-gram that matched): the one `find_continuation` returns first, then those after other occurrences
    (longest n-gram first, most recent first). n is worth keeping: a longer match is a more reliable copy (on the
    default target, a 3-gram match's next token is right ~0.7 of the time, a 1-gram's ~0.3). A continuation that
    is a prefix of one already found is skipped: a tree would merge it away."""
    tokens = torch.as_tensor(tokens, dtype=torch.long).cpu()
    L = tokens.numel()
    found: list[tuple[list[int], int]] = []
    if num_tokens <= 0 or max_branches <= 0:
        return found
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        if n < 1:
            break
        windows = tokens[: L - 1].unfold(0, n, 1)
        hits = (windows == tokens[L - n:]).all(dim=-1).nonzero().flatten().tolist()
        for h in reversed(hits):
            cont = tokens[h + n: h + n + num_tokens].tolist()
            if not cont or any(f[: len(cont)] == cont for f, _ in found):
                continue
            longer = next((i for i, (f, _) in enumerate(found) if cont[: len(f)] == f), None)
            if longer is not None:  # it extends one already found (cut short by the end of the text): replace it
                found[longer] = (cont, found[longer][1])
                continue
            found.append((cont, n))
            if len(found) == max_branches:
                return found
    return found
