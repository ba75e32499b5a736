"""`blockdraft bench`: paired speed benchmark of decoding methods on one shared target.

Methods:
- the decoding methods of the registry (`decode/spec.py`, the README's "Decoding methods"), each built from its
  `DecodeSpec` by `build_engine` on the shared target: `ar` (the baseline of every ratio), `dflash`,
  `dflash-adaptive`, `dflash-tree`, `dflash+lookup`, `lookup-tree`, `pld`, `eagle` (chains of --gamma tokens; needs
  --eagle-draft). A method whose draft is missing is skipped with a note; the methods whose choices read the target's
  verify cost share one calibration measured when the benchmark starts;
- `ar-hf`, `dflash-hf`: `ar` and `dflash` with the target run through its Hugging Face modules and dynamic cache
  instead of the lean path (`lean.py`): the "before" of the lean path, for the per-step time split;
- `hf`: Hugging Face `generate` (eager) on the same HF model, plain decoding: what a transformers user gets;
- `hf-pld`: Hugging Face `generate(prompt_lookup_num_tokens=...)` on the same HF model (greedy only, end-to-end
  time only);
- `llamacpp`, `llamacpp-pld`: llama.cpp through llama-cpp-python on the target's GGUF file (`--llamacpp-gguf`, or
  the GGUF the target was loaded from), plain and with its prompt-lookup draft (greedy only); skipped with a note
  when llama-cpp-python is not installed. llama.cpp runs the GGUF's own quantized kernels (Q4_1 for the default
  target), so its tokens can differ from the bf16 target's.
- `llamacpp-bf16`: `llamacpp` on a bf16 GGUF of the target (`--llamacpp-bf16-gguf`, default: exported once from the
  target's GGUF into the cache dir): the weights our bf16 engine runs, in llama.cpp's kernels;
- `llamacpp-dflash`, `llamacpp-dflash-bf16`: our DFlash draft (exported to GGUF) in llama.cpp's own DFlash
  (`llama-server --spec-type draft-dflash` on a loopback port, built by `make llamacpp`) on the `llamacpp` and
  `llamacpp-bf16` files, greedy only; tau is llama.cpp's mean acceptance length, and `plain match` says whether the
  greedy output equals the plain method's on the same file. Skipped with a note when the tools are not
  built.
- `llamacpp-spec`, `llamacpp-spec-n`: llama.cpp's classic speculative decoding (`llama-server -md`, `--spec-type
  draft-simple`) with a smaller model of the target's family as the draft model (`--llamacpp-spec-gguf`, default:
  the packaged sibling, Qwen2.5-Coder-0.5B for `qwen2.5-coder-1.5b`), at llama.cpp's default draft settings and at
  `--llamacpp-spec-n` drafted tokens at most; greedy only, `plain match` against `llamacpp-server`. What a user of
  that target can pick today.

Fairness: one target instance serves every method; one short warm-up generation per method is not measured;
methods run prompt by prompt in a rotating order so that machine drift hits all of them alike. Every ratio is
paired: the same prompt (and turn, and temperature) decoded by the method and by `ar`.

Outputs in --out: results.json (config, machine, every per-prompt record, the summary), report.md and PNG plots
(written by `report.py`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import GenerationConfig, SamplingParams
from ..decode.spec import METHODS as METHODS_REGISTRY
from ..decode.spec import REFERENCES
from ..models.loading import encode_prompt
from ..models.quant import WEIGHT_MODES, kernel_isa
from ..prompts import TASKS, load_prompts_file, load_task
from .engines import BENCH_METHODS, build_all
from .external import hf_generate
from .llamacpp_server import ServerExited
from .machine import machine_info
from .manifest import run_manifest
from .report import fmt_temperature, make_plots, render_report, summarize_records

log = logging.getLogger(__name__)

# engine methods are names of the decode registry (`decode.spec.METHODS`); the others are its `REFERENCES`
METHODS = BENCH_METHODS
DEFAULT_METHODS = tuple(m for m in METHODS if (METHODS_REGISTRY.get(m) or REFERENCES.get(m)).bench_default)
# external references that run at temperature 0 only
GREEDY_ONLY = tuple(m for m, r in REFERENCES.items() if r.greedy_only)
# a drafted reference's greedy output is compared with its plain reference's on the same weights
PLAIN_REFERENCE = {m: r.plain for m, r in REFERENCES.items() if r.plain}
QUICK = dict(n=2, max_new_tokens=64, temperatures=(0.0,))
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class BenchConfig:
    target: str | None = None  # HF id, local dir, .gguf, or None for the packaged default
    draft: str | None = None  # draft dir, 'none', or None for the target's shipped draft
    tasks: tuple[str, ...] = ("math", "code", "chat")
    methods: tuple[str, ...] = DEFAULT_METHODS
    n: int | None = 20  # prompts per task (None: all)
    max_new_tokens: int = 256
    temperatures: tuple[float, ...] = (0.0,)
    block_size: int | None = None  # None: the draft's trained size (16 for pld)
    denoise_steps: int = 1
    dtype: str = "bf16"
    # the first: every engine method; the others: engines.weights_methods() again, as `m@mode`
    weights: tuple[str, ...] = ("auto",)
    # further DFlash drafts (name, directory): the DFlash methods again with each, as `m@name`, in the same run
    compare_drafts: tuple[tuple[str, str], ...] = ()
    seed: int = 0
    prompts: str | None = None  # a user JSONL prompt file instead of the built-in tasks
    quick: bool = False  # 2 prompts per task, 64 new tokens, temperature 0
    multi_turn: bool = False  # also ask a prompt's second turn after ar's first answer
    out: str = "bench-results"
    pld_max_ngram: int = 3
    pld_num_pred: int | None = None
    hf_pld_tokens: int = 10
    compile: bool = False  # torch.compile the lean target path (compile time is paid in the warm-up)
    llamacpp_gguf: str | None = None  # GGUF for llamacpp methods (default: the file the target came from, if any)
    llamacpp_bf16_gguf: str | None = None  # bf16 GGUF for llamacpp-bf16 / llamacpp-dflash-bf16 (default: exported)
    llamacpp_draft_gguf: str | None = None  # draft GGUF for llamacpp-dflash* (default: the draft, exported)
    llamacpp_draft_n: int | None = None  # llamacpp-dflash*: tokens drafted per step (default: the draft's block - 1)
    # llamacpp-spec*: the draft model's GGUF (default: the packaged smaller model of the target's family, if any)
    llamacpp_spec_gguf: str | None = None
    llamacpp_spec_n: int = 8  # llamacpp-spec-n: --spec-draft-n-max
    eagle_draft: str | None = None  # EAGLE draft directory for method `eagle` (None: eagle is skipped)
    gamma: int = 7  # eagle: tokens drafted per verify step (chain length)
    tree_budget: int | None = None  # dflash-tree, dflash+lookup: nodes per step (None: chosen from a calibration)
    threads: int | None = None
    warmup: bool = True
    progress: bool = True
    plots: bool = True
    command: str | None = None  # the command line, recorded in results.json

    def resolved(self) -> "BenchConfig":
        """Apply --quick and check the values."""
        cfg = dataclasses.replace(self, **QUICK) if self.quick else self
        badw = [w for w in cfg.weights if w not in WEIGHT_MODES]
        if badw or not cfg.weights or len(set(cfg.weights)) != len(cfg.weights):
            raise ValueError(f"--weights must list distinct modes of {WEIGHT_MODES}, got {cfg.weights}")
        names = [n for n, _ in cfg.compare_drafts]
        if len(set(names)) != len(names) or any(not n or not re.fullmatch(r"[\w.-]+", n) or n in WEIGHT_MODES
                                                for n in names):
            raise ValueError(f"--compare-draft needs distinct NAME=DIR with names of letters, digits, '.', '_' or "
                             f"'-' other than {WEIGHT_MODES}, got {names}")
        bad = [m for m in cfg.methods if m not in METHODS]
        if bad or not cfg.methods:
            raise ValueError(f"unknown method(s) {bad}; choose from {list(METHODS)}")
        if cfg.llamacpp_spec_n < 1:
            raise ValueError(f"--llamacpp-spec-n must be >= 1, got {cfg.llamacpp_spec_n}")
        if cfg.prompts is None:
            badt = [t for t in cfg.tasks if t not in TASKS]
            if badt or not cfg.tasks:
                raise ValueError(f"unknown task(s) {badt}; choose from {sorted(TASKS)}")
        if not cfg.temperatures or any(not (t >= 0 and math.isfinite(t)) for t in cfg.temperatures):
            raise ValueError(f"temperatures must be finite numbers >= 0, got {cfg.temperatures}")
        if cfg.n is not None and cfg.n < 1:
            raise ValueError(f"--n must be >= 1, got {cfg.n}")
        if cfg.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
        return cfg


def _clean(x):
    """JSON-safe copy: NaN/inf -> None (json.dump would write bare NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _first_mismatch(a: list[int], b: list[int]) -> int:
    """Index of the first token where two different outputs part (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _rotate(xs: list, k: int) -> list:
    k %= len(xs)
    return xs[k:] + xs[:k]


@dataclass
class _Item:
    index: int  # seeds sampling (seed + index) and the method rotation
    prompt: object  # tasks.base.Prompt
    turn: int
    ids: list[int]
    messages: list[dict] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------------ runners
class _Runner:
    """Holds the shared target, the engines and the HF model; runs one method on one prompt."""

    def __init__(self, cfg: BenchConfig, target, tokenizer, engines: dict, block_sizes: dict,
                 external: dict | None = None) -> None:
        self.cfg, self.target, self.tok, self.engines, self.block_sizes = cfg, target, tokenizer, engines, block_sizes
        self.external = external or {}  # method -> runner with .run(ids, max_new, temperature, seed, eos, tok)

    def run(self, method: str, ids: list[int], temperature: float, seed: int, max_new_tokens: int) -> dict:
        ref = REFERENCES.get(method)
        if ref is not None and ref.runner == "hf":
            pld = self.cfg.hf_pld_tokens if ref.draft == "lookup" else None
            return hf_generate(self.target, self.tok, ids, max_new_tokens, temperature, seed, pld)
        if method in self.external:
            return self.external[method].run(ids, max_new_tokens, temperature, seed, self.target.eos_token_ids,
                                             self.tok)
        sampling = SamplingParams() if temperature == 0 else SamplingParams(temperature=temperature, seed=seed)
        gcfg = GenerationConfig(max_new_tokens=max_new_tokens)  # the block and denoising are the engine's spec
        engine = self.engines[method]
        t0 = time.perf_counter()
        res = engine.generate(ids, gcfg, sampling)
        e2e = time.perf_counter() - t0
        s = res.stats
        return {"token_ids": res.token_ids, "text": res.text, "finish_reason": res.finish_reason,
                "prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens, "tau": s.tau,
                "accept_lengths": list(s.accept_lengths), "position_accepted": list(s.position_accepted),
                "position_trials": list(s.position_trials), "target_forwards": s.target_forwards,
                "decode_tokens_per_s": s.decode_tokens_per_s, "e2e_seconds": e2e,
                "prefill_seconds": s.prefill_seconds, "decode_seconds": s.decode_seconds,
                "draft_seconds": s.draft_seconds, "verify_seconds": s.verify_seconds,
                "tree_nodes": list(s.tree_nodes) if s.tree is not None else None, "tree": s.tree,
                "weights": engine.target.weights.mode}


def _load_prompts(cfg: BenchConfig, prompts, notes: list[str]) -> list:
    if prompts is not None:
        return list(prompts)
    if cfg.prompts:
        ps = load_prompts_file(cfg.prompts)
        if cfg.n is not None and len(ps) > cfg.n:
            notes.append(f"{cfg.prompts}: first {cfg.n} of {len(ps)} prompts")
            ps = ps[: cfg.n]
        return ps
    out = []
    for t in cfg.tasks:
        out.extend(load_task(t, n=cfg.n, seed=cfg.seed))
    return out


# --------------------------------------------------------------------------------------------------- run_bench
def run_bench(cfg: BenchConfig, *, target=None, tokenizer=None, draft=None, prompts=None) -> dict:
    """Run the benchmark and write results.json, report.md and plots into cfg.out; return the results dict.

    target: an already-built TargetModel (default: load cfg.target in cfg.dtype); tokenizer: the one that encodes
    prompts (apply_chat_template / encode) and decodes answers (default: the target's); draft: a DFlashDraftModel or
    a draft directory (default: resolve cfg.draft); prompts: Prompt objects (default: cfg.prompts or cfg.tasks)."""
    cfg = cfg.resolved()
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _run_bench(cfg, target, tokenizer, draft, prompts)
    finally:
        torch.set_num_threads(threads)


def _run_bench(cfg: BenchConfig, target, tokenizer, draft, prompts) -> dict:
    t_start = time.perf_counter()
    machine = machine_info()
    notes: list[str] = []
    built = build_all(cfg, METHODS, target, tokenizer, draft, notes)
    target, target_name, tok, engines, methods = (built.target, built.target_name, built.tokenizer, built.engines,
                                                 built.methods)
    block_sizes, draft_desc, external = built.block_sizes, built.draft_desc, built.external
    # taken before anything is measured: the commit and working tree that ran, whatever changes while it runs
    command = cfg.command or shlex.join(sys.argv)
    draft_dir = draft_desc if draft_desc and Path(draft_desc).exists() else None
    manifest = run_manifest(command=command, draft=draft_dir, target_file=getattr(target, "source", None),
                            weights=target.weights.describe() if hasattr(target, "weights") else None)
    runner = _Runner(cfg, target, tok, engines, block_sizes, external)

    items: list[_Item] = []
    for p in _load_prompts(cfg, prompts, notes):
        ids = encode_prompt(tok, p.messages)
        if len(ids) >= target.max_context - 1:
            notes.append(f"{p.id} skipped: {len(ids)} prompt tokens do not fit the context ({target.max_context})")
            continue
        items.append(_Item(len(items), p, 1, ids, list(p.messages)))
    if not items:
        raise ValueError("no prompts to benchmark")
    n_second = sum(1 for it in items if cfg.multi_turn and it.prompt.extra_turns)
    for m in GREEDY_ONLY:
        if any(t > 0 for t in cfg.temperatures) and m in methods:
            notes.append(f"{m} runs at temperature 0 only (greedy reference)")

    per_temp = {t: [m for m in methods if not (m in GREEDY_ONLY and t > 0)] for t in cfg.temperatures}
    total = sum(len(ms) * (len(items) + n_second) for ms in per_temp.values())
    bar = tqdm(total=total, desc="bench", unit="run", disable=not cfg.progress, dynamic_ncols=True)
    records: list[dict] = []

    def drop(m: str, e: ServerExited, where: str) -> None:
        """An external server that died loses its own method only: the note says why, the rest of the run goes on."""
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        # llama.cpp's own abort message, not the debugger's backtrace that follows it
        why = next((ln for w in ("assert", "abort", "error", "failed") for ln in reversed(lines[1:])
                    if w in ln.lower() and not ln.startswith("#")), lines[-1])
        notes.append(f"{m} dropped from the run: {lines[0].rstrip(':')} ({where}); its log: {why[:300]!r}")
        log.warning("%s dropped: %s", m, e)
        for ms in per_temp.values():
            if m in ms:
                ms.remove(m)
        methods.remove(m)

    def run_item(item: _Item, temp: float, ms: list[str]) -> dict:
        out = {}
        for k, m in enumerate(_rotate(list(ms), item.index + item.turn - 1)):
            bar.set_postfix_str(f"T={fmt_temperature(temp)} {item.prompt.id} turn {item.turn} {m}", refresh=False)
            try:
                r = runner.run(m, item.ids, temp, cfg.seed + item.index, cfg.max_new_tokens)
            except ServerExited as e:
                drop(m, e, f"prompt {item.prompt.id}")
                bar.update(1)
                continue
            r.update(temperature=temp, task=item.prompt.task, prompt_id=item.prompt.id, prompt_index=item.index,
                     turn=item.turn, method=m, run_order=k)
            out[m] = r
            bar.update(1)
        ref = out["ar"]["token_ids"]
        for m, r in out.items():
            r["match_ar"] = None if m == "ar" else r["token_ids"] == ref
            r["first_mismatch"] = None if m == "ar" or r["match_ar"] else _first_mismatch(r["token_ids"], ref)
        for m, plain in PLAIN_REFERENCE.items():  # llama.cpp + draft vs llama.cpp alone, same GGUF
            if m in out:
                out[m]["match_plain"] = out[plain]["token_ids"] == out[m]["token_ids"] if plain in out else None
        records.extend(out[m] for m in ms)
        return out

    try:
        with torch.no_grad():
            for temp in cfg.temperatures:
                ms = per_temp[temp]
                if cfg.warmup:  # compile-free, but first calls allocate caches and touch every weight
                    for m in list(ms):
                        try:
                            runner.run(m, items[0].ids, temp, cfg.seed, min(WARMUP_TOKENS, cfg.max_new_tokens))
                        except ServerExited as e:
                            drop(m, e, "warm-up")
                for item in items:
                    first = run_item(item, temp, ms)
                    if cfg.multi_turn and item.prompt.extra_turns:
                        msgs = item.messages + [{"role": "assistant", "content": first["ar"]["text"]},
                                                {"role": "user", "content": item.prompt.extra_turns[0]}]
                        ids2 = encode_prompt(tok, msgs)
                        if len(ids2) >= target.max_context - 1:
                            notes.append(f"{item.prompt.id} turn 2 skipped: does not fit the context")
                            bar.update(len(ms))
                            continue
                        run_item(_Item(item.index, item.prompt, 2, ids2, msgs), temp, ms)
    finally:
        bar.close()
        for r in external.values():  # llama-server processes
            getattr(r, "close", lambda: None)()

    summary = summarize_records(records, methods, block_sizes, cfg.temperatures)
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "manifest": manifest,
        "config": dataclasses.asdict(cfg), "command": command,
        "machine": {**machine, "kernel_isa": kernel_isa()}, "target": target_name, "draft": draft_desc, "methods": methods,
        "block_sizes": block_sizes, "notes": notes, "summary": summary, "records": records,
        "wall_seconds": None, "files": [],
    }
    files = ["results.json", "report.md"]
    if cfg.plots:
        files += make_plots(summary, methods, out_dir)
    results["files"] = files
    results["wall_seconds"] = time.perf_counter() - t_start
    results = _clean(results)
    (out_dir / "report.md").write_text(render_report(results), encoding="utf-8")
    with open(out_dir / "results.json", "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    return results
