"""`blockdraft bench`: paired speed benchmark of decoding methods on one shared target.

Methods:
- `ar`: the engine with no proposer (plain autoregressive decoding), the baseline of every ratio;
- `dflash`: the engine with the DFlash draft (skipped, with a note, when there is no draft);
- `dflash-adaptive`: `dflash` choosing per step how many tokens to draft (0 .. block size - 1) from a verify-cost
  calibration measured at start, the draft's measured time and its running acceptance (what `generate` does unless
  `--fixed-width`);
- `dflash-tree`, `dflash+lookup`: the same draft's candidate tree (its best branches) verified in one target forward,
  and that tree with prompt-lookup continuations as extra branches (`--tree-budget N` fixes the nodes per
  step, default: chosen per step from a verify-cost calibration measured when the benchmark starts);
- `pld`: the engine with prompt-lookup drafting (`PromptLookupProposer`);
- `eagle`: the engine with an EAGLE-3 drafter (`EagleProposer`, chains of --gamma tokens; skipped, with a note,
  without --eagle-draft), the autoregressive-drafter baseline of the paper;
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

Fairness: one target instance serves every method; one short warm-up generation per method is not measured;
methods run prompt by prompt in a rotating order so that machine drift hits all of them alike. Every ratio is
paired: the same prompt (and turn, and temperature) decoded by the method and by `ar`.

Outputs in --out: results.json (config, machine, every per-prompt record, the summary), report.md and PNG plots
(written by `report.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .llamacpp_server import PLAIN_REFERENCE, SERVER_METHODS, ServerExited
from .report import fmt_temperature, fmt_num, fmt_speedup, make_plots, render_report, summarize_records

log = logging.getLogger(__name__)
# torch, transformers and the model / decode code are imported inside the functions that run a bench: the CLI
# imports this module only to register `bench`

METHODS = ("ar", "dflash", "dflash-adaptive", "dflash-tree", "dflash+lookup",
           "pld", "hf-pld", "eagle", "ar-hf", "dflash-hf", "hf", "llamacpp", "llamacpp-pld",
           "llamacpp-bf16", "llamacpp-server", "llamacpp-server-bf16", "llamacpp-dflash", "llamacpp-dflash-bf16")
DEFAULT_METHODS = ("ar", "dflash", "pld", "hf-pld", "eagle")
ENGINE_METHODS = ("ar", "dflash", "dflash-adaptive", "dflash-tree", "dflash+lookup", "pld", "eagle", "ar-hf", "dflash-hf")
# external references run at temperature 0 only
GREEDY_ONLY = ("hf-pld", "llamacpp-pld", "llamacpp-server", "llamacpp-server-bf16", "llamacpp-dflash",
               "llamacpp-dflash-bf16")
# methods that run again, suffixed `@MODE`, for every weights mode after the first of --weights
WEIGHTS_METHODS = ("ar", "dflash", "dflash-adaptive", "dflash-tree", "dflash+lookup", "pld")
# methods with accept-length / per-position statistics
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
    weights: tuple[str, ...] = ("auto",)  # the first: every engine method; others: WEIGHTS_METHODS as `m@mode`
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
        from ..models.quant import WEIGHT_MODES

        badw = [w for w in cfg.weights if w not in WEIGHT_MODES]
        if badw or not cfg.weights or len(set(cfg.weights)) != len(cfg.weights):
            raise ValueError(f"--weights must list distinct modes of {WEIGHT_MODES}, got {cfg.weights}")
        bad = [m for m in cfg.methods if m not in METHODS]
        if bad or not cfg.methods:
            raise ValueError(f"unknown method(s) {bad}; choose from {list(METHODS)}")
        if cfg.prompts is None:
            from .tasks import TASKS

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


# ------------------------------------------------------------------------------------------------------ helpers
SIMD_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """The SIMD features that decide which kernels run (one model name, e.g. "AMD EPYC", covers CPUs with and
    without AVX-512)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []
    return [x for x in SIMD_FLAGS if x in flags]


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:  # pragma: no cover
        tf = None
    from ..models.quant import kernel_isa

    return {"cpu": cpu, "cpu_flags": cpu_flags(), "kernel_isa": kernel_isa(), "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": tf,
            "threads": torch.get_num_threads(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


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
        from .external import hf_generate

        if method in ("hf", "hf-pld"):
            pld = self.cfg.hf_pld_tokens if method == "hf-pld" else None
            return hf_generate(self.target, self.tok, ids, max_new_tokens, temperature, seed, pld)
        if method in self.external:
            return self.external[method].run(ids, max_new_tokens, temperature, seed, self.target.eos_token_ids,
                                             self.tok)
        from ..config import GenerationConfig, SamplingParams

        sampling = SamplingParams() if temperature == 0 else SamplingParams(temperature=temperature, seed=seed)
        gcfg = GenerationConfig(max_new_tokens=max_new_tokens, block_size=self.cfg.block_size,
                                denoise_steps=self.cfg.denoise_steps)
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


def _add_tree_engines(cfg: BenchConfig, target, target_name: str, tok, draft, engines: dict, block_sizes: dict,
                      methods: list[str], notes: list[str]) -> str | None:
    """Engines of the tree methods on the DFlash draft, sharing one verify-cost calibration that is
    measured now, so that the per-step budget reflects the machine as the benchmark finds it. Returns the draft's
    description (None when there is no draft: the tree methods are then skipped with a note)."""
    from ..models.draft import DFlashDraftModel
    from ..loading import build_tree_engine, resolve_draft

    wanted = [m for m in ("dflash-tree", "dflash+lookup") if m in methods]
    if isinstance(draft, (str, Path)) or draft is None:
        path = Path(draft) if draft is not None else resolve_draft(cfg.draft, target_name)
        desc = str(path) if path is not None else None
        draft = DFlashDraftModel.from_pretrained(path, dtype=target.dtype, device=target.device) if path else None
    else:  # an already-built DFlashDraftModel
        desc = f"<{type(draft).__name__}>"
    if draft is None:
        for m in wanted:
            methods.remove(m)
        notes.append(f"{', '.join(wanted)} skipped: no draft for target {target_name!r}")
        return None
    cost = None
    for m in wanted:
        eng = build_tree_engine(target, None, lookup=m == "dflash+lookup", budget=cfg.tree_budget,
                                block_size=cfg.block_size, verify_cost=cost, draft=draft, recalibrate=cost is None)
        cost = eng.proposer.verify_cost
        eng.tokenizer = tok
        engines[m] = eng
        block_sizes[m] = cfg.block_size or eng.proposer.block_size
    if cfg.tree_budget is None:
        notes.append(f"tree budget chosen per step from a verify-cost calibration measured at start: verifying 16 / 64 "
                     f"tokens costs {cost(16) / cost(1):.2f}x / {cost(64) / cost(1):.2f}x one token "
                     f"({1e3 * cost(1):.1f} ms)")
    return desc


def _build(cfg: BenchConfig, target, tokenizer, draft, notes: list[str]):
    """-> (target, target_name, tokenizer, engines, methods, block_sizes, draft_desc, external runners)."""
    from ..decode.engine import Engine
    from ..loading import build_engine, load_target, resolve_draft
    from ..decode.proposers.lookup import PromptLookupProposer

    gguf = cfg.llamacpp_gguf
    if target is None:
        target, src = load_target(cfg.target, cfg.dtype, compile=cfg.compile, weights=cfg.weights[0])
        target_name = src.name
        if gguf is None and src.gguf_file:
            gguf = str(Path(src.path) / src.gguf_file)
    else:
        target_name = cfg.target or type(getattr(target, "hf", target)).__name__
    tok = tokenizer if tokenizer is not None else target.tokenizer
    methods = [m for m in METHODS if m in cfg.methods]  # canonical order
    if "ar" not in methods:
        methods.insert(0, "ar")
        notes.append("`ar` added: it is the baseline of every ratio")
    engines = {"ar": Engine(target, None, tok)}
    block_sizes = {"ar": 1}
    draft_desc = None
    if "dflash" in methods:
        eng = None
        if draft is None:
            path = resolve_draft(cfg.draft, target_name)
            if path is not None:
                eng = build_engine(target, path, cfg.block_size, cfg.denoise_steps)
                draft_desc = str(path)
        elif isinstance(draft, (str, Path)):
            eng = build_engine(target, Path(draft), cfg.block_size, cfg.denoise_steps)
            draft_desc = str(draft)
        else:  # an already-built DFlashDraftModel
            from ..decode.proposers.dflash import DFlashProposer

            eng = Engine(target, DFlashProposer(draft, target, cfg.block_size, cfg.denoise_steps), tok)
            draft_desc = f"<{type(draft).__name__}>"
        if eng is None:
            methods.remove("dflash")
            notes.append(f"dflash skipped: no draft for target {target_name!r} (--draft {cfg.draft or 'default'})")
        else:
            eng.tokenizer = tok
            engines["dflash"] = eng
            block_sizes["dflash"] = cfg.block_size or eng.proposer.block_size
    if "dflash-adaptive" in methods:
        path = (resolve_draft(cfg.draft, target_name) if draft is None
                else Path(draft) if isinstance(draft, (str, Path)) else None)
        if path is None:
            methods.remove("dflash-adaptive")
            notes.append("dflash-adaptive skipped: it needs a draft directory")
        else:
            eng = build_engine(target, path, cfg.block_size, cfg.denoise_steps, adaptive=True, recalibrate=True)
            eng.tokenizer = tok
            engines["dflash-adaptive"] = eng
            block_sizes["dflash-adaptive"] = cfg.block_size or eng.proposer.block_size
            draft_desc = draft_desc or str(path)
    if any(m in methods for m in ("dflash-tree", "dflash+lookup")):
        desc = _add_tree_engines(cfg, target, target_name, tok, draft, engines, block_sizes, methods, notes)
        draft_desc = draft_desc or desc
    if "pld" in methods:
        prop = PromptLookupProposer(max_ngram=cfg.pld_max_ngram, num_pred=cfg.pld_num_pred,
                                    block_size=cfg.block_size or 16)
        engines["pld"] = Engine(target, prop, tok)
        block_sizes["pld"] = prop.block_size
    if "eagle" in methods:
        if cfg.eagle_draft is None:
            methods.remove("eagle")
            notes.append("eagle skipped: no EAGLE draft (--eagle-draft DIR)")
        else:
            from ..models.eagle import EagleDraftModel
            from ..decode.proposers.eagle import EagleProposer

            ed = EagleDraftModel.from_pretrained(cfg.eagle_draft, dtype=target.dtype, device=target.device)
            engines["eagle"] = Engine(target, EagleProposer(ed, target, cfg.gamma), tok)
            block_sizes["eagle"] = cfg.gamma + 1
    if any(m in methods for m in ("ar-hf", "dflash-hf")):
        from ..models.target import TargetModel

        if target.lean is None:
            notes.append(f"ar-hf/dflash-hf equal ar/dflash here: the lean path does not run this target "
                         f"({target.lean_reason})")
        # the same HF model and weights, decoded through the HF modules and their dynamic cache
        slow = TargetModel(target.hf, target.tokenizer, lean=False)
        if "ar-hf" in methods:
            engines["ar-hf"] = Engine(slow, None, tok)
            block_sizes["ar-hf"] = 1
        if "dflash-hf" in methods and "dflash" not in engines:
            methods.remove("dflash-hf")
            notes.append("dflash-hf skipped: it reuses the dflash draft, which is not available")
        elif "dflash-hf" in methods:
            prop = engines["dflash"].proposer
            from ..decode.proposers.dflash import DFlashProposer

            engines["dflash-hf"] = Engine(
                slow, DFlashProposer(prop.draft, slow, prop.block_size, prop.denoise_steps), tok)
            block_sizes["dflash-hf"] = block_sizes["dflash"]
    for m in ("hf", "hf-pld"):
        if m in methods and not hasattr(getattr(target, "hf", None), "generate"):
            methods.remove(m)
            notes.append(f"{m} skipped: the target has no Hugging Face `generate`")
    external = {}
    for m in ("llamacpp", "llamacpp-pld", "llamacpp-bf16"):
        if m not in methods:
            continue
        from .external import LlamaCpp, llamacpp_available

        why, file = llamacpp_available(), gguf
        if why is None and m == "llamacpp-bf16":
            from .llamacpp_server import bf16_gguf

            try:
                file = str(bf16_gguf(cfg.target, cfg.llamacpp_bf16_gguf))
            except (OSError, ValueError) as e:
                why = str(e)
        if why is None and not file:
            why = "no GGUF file (--llamacpp-gguf PATH)"
        if why is not None:
            methods.remove(m)
            notes.append(f"{m} skipped: {why}")
            continue
        import torch

        pld = (cfg.pld_max_ngram, cfg.hf_pld_tokens) if m == "llamacpp-pld" else None
        external[m] = LlamaCpp(file, cfg.threads or torch.get_num_threads(), min(target.max_context, 4096), pld)
        notes.append(f"{m}: llama.cpp on {Path(file).name} (its own kernels), "
                     f"{cfg.threads or torch.get_num_threads()} threads")
    if any(m in methods for m in SERVER_METHODS):
        import torch

        from .llamacpp_server import build_server_runners

        draft_dir = (resolve_draft(cfg.draft, target_name) if draft is None
                     else Path(draft) if isinstance(draft, (str, Path)) else None)
        external.update(build_server_runners(
            methods, target=cfg.target, target_gguf=gguf, bf16=cfg.llamacpp_bf16_gguf, draft_dir=draft_dir,
            draft_gguf=cfg.llamacpp_draft_gguf, draft_n=cfg.llamacpp_draft_n,
            threads=cfg.threads or torch.get_num_threads(), n_ctx=min(target.max_context, 4096), notes=notes))
    _add_weights_engines(cfg, target, target_name, tok, draft, draft_desc, gguf, engines, methods, block_sizes,
                         notes)
    return target, target_name, tok, engines, methods, block_sizes, draft_desc, external


def _add_weights_engines(cfg: BenchConfig, target, target_name: str, tok, draft, draft_desc, gguf, engines: dict,
                         methods: list[str], block_sizes: dict, notes: list[str]) -> None:
    """For each weights mode after the first: the same HF model with that weight plan, and the requested
    WEIGHTS_METHODS on it as `method@mode` (their own verify-cost calibration included)."""
    from ..models.quant import plan_weights
    from ..models.target import TargetModel

    wanted = [m for m in methods if m in WEIGHTS_METHODS]
    for mode in cfg.weights[1:]:
        other = TargetModel(target.hf, target.tokenizer, layer_ids=target.layer_ids,
                            weights=plan_weights(mode, target.hf, gguf))
        sub_cfg = dataclasses.replace(cfg, methods=tuple(wanted), weights=(mode,))
        sub_draft = draft if draft is not None else (draft_desc if draft_desc and Path(draft_desc).is_dir() else None)
        _, _, _, sub_engines, sub_methods, sub_blocks, _, _ = _build(sub_cfg, other, tok, sub_draft, notes)
        for m in sub_methods:
            name = f"{m}@{mode}"
            engines[name], block_sizes[name] = sub_engines[m], sub_blocks[m]
            methods.insert(methods.index(m) + 1 if m in methods else len(methods), name)
        notes.append(f"weights {mode}: {other.weights.describe()}")


def _load_prompts(cfg: BenchConfig, prompts, notes: list[str]) -> list:
    from .tasks import load_prompts_file, load_task

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
    import torch

    cfg = cfg.resolved()
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _run_bench(cfg, target, tokenizer, draft, prompts)
    finally:
        torch.set_num_threads(threads)


def _run_bench(cfg: BenchConfig, target, tokenizer, draft, prompts) -> dict:
    import torch

    from ..loading import encode_prompt

    t_start = time.perf_counter()
    machine = machine_info()
    notes: list[str] = []
    target, target_name, tok, engines, methods, block_sizes, draft_desc, external = _build(
        cfg, target, tokenizer, draft, notes)
    from .manifest import run_manifest

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

    from tqdm import tqdm

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

    from ..models.quant import kernel_isa  # (again: the kernels are built by now, so this names the ISA they run)

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


# ----------------------------------------------------------------------------------------------------- summary
# ---------------------------------------------------------------------------------------------------------- CLI
def _csv(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def _floats(s: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in _csv(s))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to the CLI's subparsers."""
    p = subparsers.add_parser("bench", help="paired speed benchmark: ar vs dflash vs prompt lookup",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="HF id, local dir or .gguf file (default: packaged SmolLM2-135M)")
    p.add_argument("--draft", default=None, help="draft directory, 'none' (skip dflash), default: the shipped one")
    p.add_argument("--tasks", type=_csv, default=BenchConfig.tasks,
                   help="comma list of math,code,chat (the benchmark sets) and user-math,user-code,user-chat (prompts "
                        "as users write them, never trained on)")
    p.add_argument("--methods", type=_csv, default=BenchConfig.methods,
                   help="comma list of " + ",".join(METHODS) + " (default: " + ",".join(DEFAULT_METHODS) + ")")
    p.add_argument("--n", type=int, default=BenchConfig.n, help="prompts per task (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=BenchConfig.max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--temperatures", type=_floats, default=None, help="comma list, e.g. 0,1 (overrides --temperature)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--denoise-steps", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--weights", type=_csv, default=BenchConfig.weights,
                   help="comma list of weights modes (auto, bf16, int8, int4): the first for every method, each "
                        "further one reruns " + ",".join(WEIGHTS_METHODS) + " as METHOD@MODE in the same run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", default=None, help="JSONL prompt file ({'prompt': ...} or {'messages': [...]})")
    p.add_argument("--quick", action="store_true", help="2 prompts per task, 64 new tokens, temperature 0")
    p.add_argument("--multi-turn", action="store_true", help="also ask MT-Bench's second turn after ar's answer")
    p.add_argument("--pld-max-ngram", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile the lean target path (warm-up pays it)")
    p.add_argument("--llamacpp-gguf", default=None,
                   help="GGUF for the llamacpp methods (default: the target's own GGUF when it was loaded from one)")
    p.add_argument("--llamacpp-bf16-gguf", default=None,
                   help="bf16 GGUF for llamacpp-bf16 / llamacpp-dflash-bf16 (default: exported from the target's GGUF "
                        "into the cache dir once)")
    p.add_argument("--llamacpp-draft-gguf", default=None,
                   help="draft GGUF for llamacpp-dflash* (default: the --draft directory exported once)")
    p.add_argument("--llamacpp-draft-n", type=int, default=None,
                   help="llamacpp-dflash*: tokens drafted per step (default: the draft's decode block size - 1)")
    p.add_argument("--eagle-draft", default=None, help="EAGLE draft directory (method eagle; skipped without)")
    p.add_argument("--gamma", type=int, default=BenchConfig.gamma, help="eagle: tokens drafted per verify step")
    p.add_argument("--tree-budget", type=int, default=None,
                   help="dflash-tree, dflash+lookup: candidate nodes per step (default: chosen per step from a "
                        "verify-cost calibration measured at start)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=BenchConfig.out, help="output directory")
    p.set_defaults(func=cmd_bench)
    return p


def config_from_args(args) -> BenchConfig:
    temps = args.temperatures if args.temperatures is not None else (args.temperature,)
    return BenchConfig(target=args.target, draft=args.draft, tasks=tuple(args.tasks), methods=tuple(args.methods),
                       n=args.n or None, max_new_tokens=args.max_new_tokens, temperatures=tuple(temps),
                       block_size=args.block_size, denoise_steps=args.denoise_steps, dtype=args.dtype,
                       weights=tuple(args.weights), seed=args.seed,
                       prompts=args.prompts, quick=args.quick, multi_turn=args.multi_turn, out=args.out,
                       pld_max_ngram=args.pld_max_ngram, eagle_draft=args.eagle_draft, gamma=args.gamma,
                       tree_budget=args.tree_budget,
                       llamacpp_gguf=args.llamacpp_gguf, compile=args.compile,
                       llamacpp_bf16_gguf=args.llamacpp_bf16_gguf, llamacpp_draft_gguf=args.llamacpp_draft_gguf,
                       llamacpp_draft_n=args.llamacpp_draft_n,
                       threads=args.threads, plots=not args.no_plots,
                       progress=not args.no_progress, command=shlex.join(["blockdraft"] + sys.argv[1:]))


def cmd_bench(args) -> int:
    results = run_bench(config_from_args(args))
    for note in results["notes"]:
        print(f"note: {note}", file=sys.stderr)
    for tkey, block in results["summary"].items():
        overall = "all" if len(block["tasks"]) > 1 else block["tasks"][0]
        for r in block["rows"]:
            if r["task"] == overall:
                print(f"T={tkey} {r['task']:>5} {r['method']:>12}: tau {fmt_num(r['tau'])}, decode speedup "
                      f"{fmt_speedup(r['decode_speedup'])}, e2e speedup {fmt_speedup(r['e2e_speedup'])}")
    out = Path(results["config"]["out"])
    print(f"wrote {out / 'report.md'}, {out / 'results.json'} and {len(results['files']) - 2} plots")
    return 0
