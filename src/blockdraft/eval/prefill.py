"""Prefill speed beside llama.cpp's prompt processing of the same GGUF file, methods interleaved.

One prompt of each `--tokens` length is fed to every method, rounds rotating the order; each run is timed as the
method itself reports it:
- `ar`, `dflash`: our engine (`build_engine`), one generation of one token; the figure is the engine's
  `prefill_seconds`, from admission to the first token (the prompt in the cache in chunks of the engine's prefill
  size, the last position's logits, the first token; `dflash` also taps the draft's layers and starts its proposer
  on the prompt's features, as it does when it serves a request);
- `llamacpp-server`: llama.cpp's own server on the target's GGUF (no prompt cache, the same token ids), one token;
  the figure is its own `timings.prompt_ms` over `prompt_n`, so HTTP and JSON never enter it.

The prompt is real text, not random ids: the chat-templated concatenation of the code and chat prompt sets, cut to
the length (the cost of a prefill does not depend on the text, but a real prompt rules out any shortcut that would).

    blockdraft prefill-bench --tokens 128,512 --rounds 5 --threads 2 --out benchmarks/prefill/run.json
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import GenerationConfig, SamplingParams
from ..decode.spec import METHODS as REGISTRY
from ..decode.spec import REFERENCES, DecodeSpec, build_engine
from ..models.loading import encode_prompt, load_draft, load_target, resolve_draft
from ..prompts import load_task
from .llamacpp_server import LlamaServer, server_missing
from .machine import machine_info
from .manifest import config_command, run_manifest

# what a prefill can differ in: plain decoding's, a DFlash method's (the draft's taps and its proposer's start:
# the same for every DFlash method) and llama-server's, each asked of the decode registry
METHODS = (next(m for m, e in REGISTRY.items() if not e.drafts),
           next(m for m, e in REGISTRY.items() if e.draft == "dflash"),
           next(m for m, r in REFERENCES.items() if r.runner == "llamacpp-server" and r.plain_llamacpp))


@dataclass(frozen=True)
class PrefillConfig:
    """`blockdraft prefill-bench` (see above): one prompt of each of tokens lengths per method of methods (METHODS),
    rounds rotating the order, on threads threads; draft: dflash's draft (None: the target's shipped one);
    llamacpp_gguf: llama-server's GGUF (None: the target's own file); out: also write the figures as JSON."""

    target: str | None = None
    dtype: str = "bf16"
    draft: str | None = None
    tokens: tuple[int, ...] = (512,)
    methods: tuple[str, ...] = METHODS
    rounds: int = 5
    threads: int = 2
    llamacpp_gguf: str | None = None
    out: str | None = None

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(f"--methods: unknown {bad or 'empty list'}; choose among {', '.join(METHODS)}")
        if not self.tokens or any(n < 1 for n in self.tokens) or self.rounds < 1:
            raise ValueError("--tokens and --rounds must be positive")


def prompt_ids(tokenizer, n: int) -> list[int]:
    """The first n token ids of one chat-templated user message made of the code and chat prompt sets' texts."""
    texts = [p.user_text for task in ("code", "chat") for p in load_task(task)]
    ids: list[int] = []
    k = 8
    while len(ids) < n:
        if k > len(texts):
            raise ValueError(f"the prompt sets hold fewer than {n} tokens of text")
        ids = encode_prompt(tokenizer, [{"role": "user", "content": "\n\n".join(texts[:k])}])
        k *= 2
    return list(ids[:n])


def run(cfg: PrefillConfig) -> int:
    """`blockdraft prefill-bench` (see above)."""
    torch.set_num_threads(cfg.threads)
    torch.set_grad_enabled(False)
    methods, lengths = list(cfg.methods), list(cfg.tokens)
    target, src = load_target(cfg.target, cfg.dtype, weights="auto")
    if max(lengths) + 2 > target.max_context:
        raise SystemExit(f"--tokens {max(lengths)} exceeds the target's context of {target.max_context}")
    gguf = Path(cfg.llamacpp_gguf) if cfg.llamacpp_gguf else (
        Path(src.path) / src.gguf_file if src.gguf_file else None)
    notes: list[str] = []

    runners = {}
    draft_dir = None
    if "ar" in methods:
        runners["ar"] = _engine_runner(build_engine(target, None, DecodeSpec("ar")))
    if "dflash" in methods:
        draft_dir = resolve_draft(cfg.draft, src.name)
        if draft_dir is None:
            raise SystemExit("dflash needs a draft: this target has no shipped one (--draft DIR)")
        runners["dflash"] = _engine_runner(build_engine(target, load_draft(draft_dir, target), DecodeSpec("dflash")))
    server = None
    if "llamacpp-server" in methods:
        why = server_missing() or (None if gguf is not None else
                                   "the target is not a GGUF file (--llamacpp-gguf PATH)")
        if why is None:
            server = LlamaServer(gguf, cfg.threads, max(lengths) + 16)
            runners["llamacpp-server"] = _server_runner(server)
        else:
            notes.append(f"llamacpp-server skipped: {why}")
            print(notes[-1])
    if not runners:
        raise SystemExit("nothing to measure: " + "; ".join(notes))
    try:
        prompts = {n: prompt_ids(target.tokenizer, n) for n in lengths}
        order = list(runners)
        for name in order:  # warm-up: first calls allocate and touch every weight
            runners[name](prompts[lengths[0]])
        secs: dict[str, dict[int, list[float]]] = {m: {n: [] for n in lengths} for m in order}
        for r in range(cfg.rounds):
            rot = order[r % len(order):] + order[:r % len(order)]
            for n in lengths:
                for name in rot:
                    secs[name][n].append(runners[name](prompts[n]))
    finally:
        if server is not None:
            server.close()

    table = {m: {n: {"seconds": statistics.median(v), "tokens_per_s": n / statistics.median(v)}
                 for n, v in by_n.items()} for m, by_n in secs.items()}
    # paired per round: each round's methods ran back to back, so their ratio cancels the machine's drift
    ratios = {}
    if "llamacpp-server" in secs:
        for m in order:
            if m != "llamacpp-server":
                ratios[m] = {n: statistics.median(ll / ours for ours, ll in zip(secs[m][n], secs["llamacpp-server"][n]))
                             for n in lengths}
    print(f"prefill, tokens/s (median of {cfg.rounds} rounds), {cfg.threads} threads")
    print("| method | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for m in order:
        cells = []
        for n in lengths:
            c = f"{table[m][n]['tokens_per_s']:.0f}"
            if m in ratios:
                c += f" ({ratios[m][n]:.2f}x)"
            cells.append(c)
        print(f"| {m} | " + " | ".join(cells) + " |")
    if ratios:
        print("(x: paired per round against llamacpp-server's own prompt timing)")
    if cfg.out:
        out = Path(cfg.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "manifest": run_manifest(command=config_command("prefill-bench", cfg), draft=draft_dir, target_file=gguf),
            "machine": machine_info(), "weights": target.weights.describe(), "notes": notes,
            "seconds": {m: {str(n): v for n, v in by_n.items()} for m, by_n in secs.items()},
            "median": {m: {str(n): v for n, v in by_n.items()} for m, by_n in table.items()},
            "ratio_to_llamacpp_server": {m: {str(n): v for n, v in r.items()} for m, r in ratios.items()},
        }, indent=1))
        print(f"wrote {out}")
    return 0


def _engine_runner(engine):
    def run_one(ids: list[int]) -> float:
        res = engine.generate(ids, GenerationConfig(max_new_tokens=1), SamplingParams())
        return res.stats.prefill_seconds

    return run_one


def _server_runner(server: LlamaServer):
    def run_one(ids: list[int]) -> float:
        res = server.complete(ids, 1, 0.0, 0)
        tm = res.get("timings") or {}
        if tm.get("prompt_n") != len(ids) or not tm.get("prompt_ms"):
            raise RuntimeError(f"llama-server processed {tm.get('prompt_n')} of {len(ids)} prompt tokens "
                               f"(timings {tm}): its figure would not be this prompt's prefill")
        return tm["prompt_ms"] / 1e3

    return run_one
