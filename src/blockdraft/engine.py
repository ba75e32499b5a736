"""The decode loop: prefill -> propose -> verify -> commit -> crop, with stops, streaming and statistics.

Invariant at the top of every step (n = committed tokens, prompt included): the target cache holds n-1 positions
(the last committed token t is not in it yet) and a feature-conditioned proposer holds context for the same n-1.
A step feeds [t, d_1..d_G] to the target at positions n-1..n-1+G, commits a+1 tokens and crops the cache to n+a.
With no proposer (G = 0) the same loop is plain autoregressive decoding, the fair baseline.
A tree proposer (proposers/tree.py) proposes a candidate tree rooted at t instead of a chain; the target
verifies all its nodes in one forward, and the cache keeps the accepted path only (`_verify_tree`), so the invariant
holds the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .config import GenerationConfig, SamplingParams
from .proposers import NoDraft, Proposer
from .sampling import logits_to_probs, make_generator, sample
from .target import TargetModel
from .tree import Tree, ancestor_mask, check_tree
from .verify import greedy_verify, rejection_verify
from .verify_tree import greedy_verify_tree, rejection_verify_tree


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verify step (a + 1)
    position_accepted: list[int] = field(default_factory=list)  # [B-1] times draft position i was accepted
    position_trials: list[int] = field(default_factory=list)  # [B-1] times draft position i was verified
    target_forwards: int = 0  # prefill included
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    tree_nodes: list[int] = field(default_factory=list)  # tree methods: candidate nodes verified per step
    tree: dict | None = None  # tree methods: the proposer's settings (budget, calibration)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step (accepted drafts + the bonus/recovered token)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def decode_seconds(self) -> float:
        return self.total_seconds - self.prefill_seconds

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens committed by verify steps per second of decoding (prefill and its first token excluded)."""
        s = self.decode_seconds
        return sum(self.accept_lengths) / s if s > 0 else 0.0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        while len(self.position_trials) < num_drafted:
            self.position_trials.append(0)
            self.position_accepted.append(0)
        for i in range(num_drafted):
            self.position_trials[i] += 1
            if i < num_accepted:
                self.position_accepted[i] += 1

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "tau": self.tau,
            "accept_lengths": self.accept_lengths, "position_accepted": self.position_accepted,
            "position_trials": self.position_trials, "target_forwards": self.target_forwards,
            "prefill_seconds": self.prefill_seconds, "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds, "total_seconds": self.total_seconds,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            **({"tree_nodes": self.tree_nodes, "tree": self.tree} if self.tree is not None else {}),
        }


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens, a stop token included when one ended generation
    text: str
    finish_reason: str  # "stop" | "length"
    stats: DecodeStats


class Generation:
    """Iterator over text deltas of one generation; `.result` is set once it is exhausted."""

    def __init__(self, it: Iterator[str]) -> None:
        self._it = it
        self.result: GenerationResult | None = None

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> str:
        return next(self._it)


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


def check_prompt(target: TargetModel, prompt_ids) -> torch.Tensor:
    """Validate prompt token ids for `target` -> [n] int64 on its device (a clear ValueError otherwise)."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=target.device)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError("prompt must be a non-empty 1-D sequence of token ids")
    if int(ids.max()) >= target.vocab_size or int(ids.min()) < 0:
        raise ValueError(f"prompt has token ids outside the target's vocabulary (0..{target.vocab_size - 1})")
    if ids.numel() >= target.max_context:
        raise ValueError(f"prompt has {ids.numel()} tokens but the target's context is {target.max_context}"
                         " tokens (at least one must remain for the answer)")
    return ids


def pick_token(logits: torch.Tensor, sampling: SamplingParams, generator) -> torch.Tensor:
    """logits [V] -> one token (argmax, or a draw from the processed distribution)."""
    if sampling.greedy:
        return logits.argmax(-1)
    return sample(logits_to_probs(logits, sampling), generator)


class SpeculativeEngine:
    def __init__(self, target: TargetModel, proposer: Proposer | None = None, tokenizer=None) -> None:
        self.target = target
        self.proposer: Proposer = proposer or NoDraft()
        self.tokenizer = tokenizer if tokenizer is not None else target.tokenizer
        if self.proposer.layer_ids:
            target.set_layer_ids(self.proposer.layer_ids)

    # ------------------------------------------------------------------------------------------ public API
    def generate(self, prompt_ids, config: GenerationConfig | None = None,
                 sampling: SamplingParams | None = None) -> GenerationResult:
        gen = self.stream(prompt_ids, config, sampling, text=False)
        for _ in gen:
            pass
        assert gen.result is not None
        return gen.result

    def stream(self, prompt_ids, config: GenerationConfig | None = None, sampling: SamplingParams | None = None,
               text: bool = True) -> Generation:
        """Yield text deltas as tokens are committed (held back while they could still become a stop string or
        an incomplete UTF-8 sequence). With text=False nothing is decoded until the end."""
        config = config or GenerationConfig()
        sampling = sampling or SamplingParams()
        prompt = check_prompt(self.target, prompt_ids)
        if config.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        gen = Generation(iter(()))
        gen._it = self._stream(prompt, config, sampling, text, gen)
        return gen

    # ------------------------------------------------------------------------------------------- internals
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _stream(self, prompt: torch.Tensor, config: GenerationConfig, sampling: SamplingParams, text: bool,
                gen: Generation) -> Iterator[str]:
        new: list[int] = []
        emitted = 0
        finish = "length"
        stats = DecodeStats(prompt_tokens=prompt.numel())
        stops = set(config.stop_token_ids) | (set() if config.ignore_eos else set(self.target.eos_token_ids))
        hold = max((len(s) for s in config.stop_strings), default=0)
        for chunk in self._steps(prompt, config, sampling, stats):
            start = len(new)
            new.extend(chunk)
            del new[config.max_new_tokens:]
            hit = next((i for i in range(start, len(new)) if new[i] in stops), None)
            if hit is not None:
                del new[hit + 1:]
                finish = "stop"
            if config.stop_strings:
                cut = tokens_through_stop(self._decode, new, start, config.stop_strings)
                if cut is not None:
                    del new[cut:]
                    finish = "stop"
            if text:
                full = self._decode(new)
                done = finish == "stop" or len(new) >= config.max_new_tokens
                safe = len(full) if done else len(full) - hold
                while safe > emitted and full[safe - 1] == "\ufffd":  # an incomplete multi-byte character
                    safe -= 1
                if config.stop_strings and finish == "stop":
                    safe = min(safe, stop_text_cut(full, config.stop_strings))
                if safe > emitted:
                    yield full[emitted:safe]
                    emitted = safe
            if finish == "stop" or len(new) >= config.max_new_tokens:
                break
        stats.new_tokens = len(new)
        full = self._decode(new)
        if config.stop_strings:
            full = full[: stop_text_cut(full, config.stop_strings)]
        if text and len(full) > emitted:
            yield full[emitted:]
        gen.result = GenerationResult(token_ids=new, text=full, finish_reason=finish, stats=stats)

    @torch.no_grad()
    def _steps(self, prompt: torch.Tensor, config: GenerationConfig, sampling: SamplingParams,
               stats: DecodeStats) -> Iterator[list[int]]:
        """Yield lists of newly committed tokens: first the prefill's token, then a+1 per verify step."""
        target, proposer = self.target, self.proposer
        generator = None if sampling.greedy else make_generator(sampling.seed, target.device)
        block = config.block_size or getattr(proposer, "block_size", 1)
        tree_mode = hasattr(proposer, "propose_tree")
        tap = bool(proposer.layer_ids)
        if tap and target.layer_ids != tuple(proposer.layer_ids):
            # engines may share one target (bench, comparisons): tap what this engine's proposer reads
            target.set_layer_ids(proposer.layer_ids)
        t0 = time.perf_counter()
        # room for the whole generation plus one verify block, so the preallocated cache never has to grow
        width = getattr(proposer, "max_nodes", block) if tree_mode else block
        cache = target.new_decode_cache(min(target.max_context, prompt.numel() + config.max_new_tokens + width + 1))
        out = target.forward(prompt.unsqueeze(0), cache, last_only=True, tap=tap)
        stats.target_forwards += 1
        first = pick_token(out.logits[0, -1], sampling, generator)
        proposer.start(prompt, out.features)
        stats.prefill_seconds = time.perf_counter() - t0
        tokens = torch.cat([prompt, first.view(1)])
        yield [int(first)]
        produced = 1
        try:
            while produced < config.max_new_tokens:
                n = tokens.numel()
                room = target.max_context - n  # positions n-1 .. n-1+G must stay inside the context
                if room < 0:
                    return
                num_draft = max(0, min(block - 1, config.max_new_tokens - produced - 1, room))
                t1 = time.perf_counter()
                if tree_mode:
                    tree = proposer.propose_tree(tokens, num_draft, sampling, generator)
                    t2 = time.perf_counter()
                    if tree.max_depth > num_draft:
                        raise ValueError(f"malformed tree: depth {tree.max_depth} > the {num_draft} positions left")
                    step = self._verify_tree(tree, cache, tokens, sampling, generator, tap)
                    a, g = step.numel() - 1, tree.max_depth
                    stats.tree_nodes.append(tree.num_nodes - 1)
                else:
                    prop = proposer.propose(tokens, num_draft, sampling, generator)
                    t2 = time.perf_counter()
                    g = prop.tokens.numel()
                    ids = torch.cat([tokens[-1:], prop.tokens]).unsqueeze(0)
                    out = target.forward(ids, cache, tap=tap)
                    if sampling.greedy:
                        committed, acc = greedy_verify(prop.tokens.unsqueeze(0), out.logits)
                    else:
                        p = logits_to_probs(out.logits, sampling)
                        q = prop.probs.unsqueeze(0) if prop.probs is not None else None
                        committed, acc = rejection_verify(prop.tokens.unsqueeze(0), q, p, generator)
                    a = int(acc[0])
                    cache.crop(n + a)
                    if tap:
                        proposer.accept(out.features[:, : a + 1], a + 1)
                    step = committed[0, : a + 1]
                stats.target_forwards += 1
                t3 = time.perf_counter()
                stats.draft_seconds += t2 - t1
                stats.verify_seconds += t3 - t2
                stats.accept_lengths.append(a + 1)
                stats.record(g, a)
                tokens = torch.cat([tokens, step])
                produced += a + 1
                yield step.tolist()
        finally:
            stats.total_seconds = time.perf_counter() - t0
            if tree_mode:
                stats.tree = proposer.describe()

    def _verify_tree(self, tree: Tree, cache, tokens: torch.Tensor, sampling: SamplingParams, generator,
                     tap: bool) -> torch.Tensor:
        """One target forward over the whole tree (node i at position n-1+depth[i], attending to the cache and to
        its ancestors), acceptance, then the cache keeps only the accepted path (in path order, at positions
        n-1 .. n-1+a). tokens [n] committed so far. Returns the committed tokens [a + 1]; the proposer gets the
        path's features."""
        target, n = self.target, tokens.numel()
        check_tree(tree, target.vocab_size)
        if int(tree.tokens[0]) != int(tokens[-1]):
            raise ValueError("malformed tree: its root must be the last committed token")
        if tree.is_chain:  # a chain (e.g. a lookup-only step) takes the plain causal path: its ancestor mask is
            #                the causal mask, so nothing needs building (and calibrate.py prices it as a chain)
            out = target.forward(tree.tokens.unsqueeze(0), cache, tap=tap)
        else:
            pos = (tree.depth + (n - 1)).unsqueeze(0)
            out = target.forward(tree.tokens.unsqueeze(0), cache, tap=tap, positions=pos,
                                 tree_mask=ancestor_mask(tree.parents))
        if sampling.greedy:
            path, committed = greedy_verify_tree(tree, out.logits[0])
        else:
            rows = out.logits[0]
            path, committed = rejection_verify_tree(tree, lambda i: logits_to_probs(rows[i], sampling), generator)
        keep = torch.tensor(path, dtype=torch.long, device=tree.tokens.device)
        cache.compact(n - 1, keep)
        self.proposer.accept_tree(tree, path, out.features[:, keep] if tap else None)
        return torch.tensor(committed, dtype=torch.long, device=tree.tokens.device)
