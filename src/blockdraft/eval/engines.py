"""The benchmark's engines and external runners: one `DecodeSpec` per engine method, built by `build_engine` on one
shared target, plus the Hugging Face and llama.cpp references.

Engine methods are names of the decode registry (`decode.spec.METHODS`), and two variants of them: `ar-hf` and
`dflash-hf`, the same specs on the target's Hugging Face modules and dynamic cache (the "before" of the lean path),
and `METHOD@MODE` for every weights mode after the first of `--weights` (the same specs on the target with those
weights). The methods whose policy reads the target's verify cost (`dflash-adaptive`, tree methods with a chosen
budget) share one calibration measured when the benchmark starts, so that their choices reflect the machine as the
benchmark finds it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..decode.calibrate import load_or_measure
from ..decode.spec import METHODS, REFERENCES, DecodeSpec, build_engine, proposer_taps, registry_entry
from ..models.draft import DFlashDraftModel
from ..models.eagle import EagleDraftModel
from ..models.loading import FAMILY_DRAFT_MODELS, load_draft, load_target, resolve_draft, resolve_target
from ..models.quant import plan_weights
from ..models.target import TargetModel
from .external import LlamaCpp, llamacpp_available
from .manifest import dir_sha256
from .llamacpp_server import bf16_gguf, build_server_runners

# the benchmark's method names, in its canonical order: the registry's, then the references'
BENCH_METHODS = tuple(METHODS) + tuple(REFERENCES)


def engine_methods() -> tuple[str, ...]:
    """Methods the benchmark builds an engine for: the registry's and their Hugging Face variants."""
    return tuple(m for m in BENCH_METHODS if registry_entry(m) is not None)


def weights_methods() -> tuple[str, ...]:
    """Methods that run again, suffixed `@MODE`, for every weights mode after the first of --weights."""
    return tuple(m for m, e in METHODS.items() if e.weights_rerun)


def _uses_dflash_draft(m: str) -> bool:
    entry, ref = registry_entry(m), REFERENCES.get(m)
    return (entry is not None and entry.draft == "dflash") or (ref is not None and ref.draft == "dflash")


@dataclass
class Built:
    """What the benchmark runs: the target, its name, the tokenizer, the engines and external runners by method,
    the methods that remain (in order), their block sizes, the DFlash draft's description and the GGUF file."""

    target: TargetModel
    target_name: str
    tokenizer: object
    methods: list[str]
    engines: dict = field(default_factory=dict)
    external: dict = field(default_factory=dict)
    block_sizes: dict = field(default_factory=dict)
    draft_desc: str | None = None
    gguf: str | None = None
    calibration: tuple | None = None  # (taps, VerifyCost) measured for this target at start


def build_all(cfg, order: tuple[str, ...], target, tokenizer, draft, notes: list[str]) -> Built:
    """Load what cfg (a `BenchConfig`) names that the caller did not give: the target, the DFlash draft (a
    directory, a loaded `DFlashDraftModel`, or None: cfg.draft resolved); then build every method's engine or runner,
    methods in the order of `order`. A method that cannot run here is dropped with a note."""
    gguf = cfg.llamacpp_gguf
    if target is None:
        target, src = load_target(cfg.target, cfg.dtype, compile=cfg.compile, weights=cfg.weights[0])
        target_name = src.name
        if gguf is None and src.gguf_file:
            gguf = str(Path(src.path) / src.gguf_file)
    else:
        target_name = cfg.target or type(getattr(target, "hf", target)).__name__
    tok = tokenizer if tokenizer is not None else target.tokenizer
    methods = [m for m in order if m in cfg.methods]  # canonical order
    if "ar" not in methods:
        methods.insert(0, "ar")
        notes.append("`ar` added: it is the baseline of every ratio")
    built = Built(target, target_name, tok, methods, gguf=gguf)
    draft_model, built.draft_desc, draft_dir = _dflash_draft(cfg, target, target_name, draft, methods)
    add_engines(cfg, built, draft_model, notes)
    _add_llamacpp(cfg, built, notes)
    if any(REFERENCES[m].runner == "llamacpp-server" for m in methods if m in REFERENCES):
        built.external.update(build_server_runners(
            methods, target=cfg.target, target_gguf=gguf, bf16=cfg.llamacpp_bf16_gguf, draft_dir=draft_dir,
            draft_gguf=cfg.llamacpp_draft_gguf, draft_n=cfg.llamacpp_draft_n,
            threads=cfg.threads or torch.get_num_threads(), n_ctx=min(target.max_context, 4096), notes=notes,
            spec_gguf=_spec_gguf(cfg, notes), spec_n=cfg.llamacpp_spec_n))
    for mode in cfg.weights[1:]:
        _add_weights_engines(cfg, built, draft_model, mode, notes)
    for name, path in cfg.compare_drafts:
        _add_draft_engines(cfg, built, name, path, notes)
    return built


def _spec_gguf(cfg, notes: list[str]) -> str | None:
    """The draft model for llamacpp-spec*: --llamacpp-spec-gguf, else the packaged family draft of a packaged
    target (None, noted, where it is not installed)."""
    if cfg.llamacpp_spec_gguf or not any(REFERENCES[m].draft == "family" for m in cfg.methods if m in REFERENCES):
        return cfg.llamacpp_spec_gguf
    family = FAMILY_DRAFT_MODELS.get(cfg.target or "")
    if family is None:
        return None
    try:
        src = resolve_target(family)
    except FileNotFoundError as e:
        notes.append(f"llamacpp-spec: the draft model {family} is not installed ({e})")
        return None
    return str(Path(src.path) / src.gguf_file)


def _dflash_draft(cfg, target, target_name: str, draft, methods: list[str]):
    """-> (the DFlash draft model or None, its description, its directory or None)."""
    wanted = any(_uses_dflash_draft(m) for m in methods)
    if isinstance(draft, DFlashDraftModel):
        return draft, f"<{type(draft).__name__}>", None
    if not wanted:
        return None, None, None
    path = Path(draft) if draft is not None else resolve_draft(cfg.draft, target_name)
    if path is None:
        return None, None, None
    return load_draft(path, target), str(path), path


def add_engines(cfg, built: Built, draft: DFlashDraftModel | None, notes: list[str]) -> None:
    """The engine methods of built.methods on built.target: one spec each, built by `build_engine`."""
    target, methods = built.target, built.methods
    base = DecodeSpec(block_size=cfg.block_size, denoise_steps=cfg.denoise_steps, tree_budget=cfg.tree_budget,
                      pld_max_ngram=cfg.pld_max_ngram, pld_num_pred=cfg.pld_num_pred)
    if draft is None:
        for m in [m for m in methods if registry_entry(m) is not None and registry_entry(m).draft == "dflash"]:
            methods.remove(m)
            notes.append(f"{m} skipped: no draft for target {built.target_name!r} (--draft {cfg.draft or 'default'})")
    eagle = None
    if "eagle" in methods:
        if cfg.eagle_draft is None:
            methods.remove("eagle")
            notes.append("eagle skipped: no EAGLE draft (--eagle-draft DIR)")
        else:
            eagle = EagleDraftModel.from_pretrained(cfg.eagle_draft, dtype=target.dtype, device=target.device)
    # the methods whose policy reads the verify cost, asked of the registry with the spec each will run
    calibrated = [m for m in methods if registry_entry(m) is not None and registry_entry(m).calibrated(
        dataclasses.replace(base, method=registry_entry(m).name))]
    cost = None
    if calibrated:
        taps = max((proposer_taps(draft, registry_entry(m).name) for m in calibrated), key=len)
        # one calibration per target and taps: drafts compared in one run price the verify alike
        if built.calibration is not None and built.calibration[0] == taps:
            cost = built.calibration[1]
        else:
            cost = load_or_measure(target, refresh=True, taps=taps)
            built.calibration = (taps, cost)
            if any(registry_entry(m).tree for m in calibrated):
                notes.append(f"tree budget chosen per step from a verify-cost calibration measured at start: "
                             f"verifying 16 / 64 tokens costs {cost(16) / cost(1):.2f}x / "
                             f"{cost(64) / cost(1):.2f}x one token ({1e3 * cost(1):.1f} ms)")
    slow = None
    if any(m in REFERENCES and REFERENCES[m].runner == "engine-hf" for m in methods):
        if target.lean is None:
            notes.append(f"ar-hf/dflash-hf equal ar/dflash here: the lean path does not run this target "
                         f"({target.lean_reason})")
        # the same HF model and weights, decoded through the HF modules and their dynamic cache
        slow = TargetModel(target.hf, target.tokenizer, lean=False)
    for m in [m for m in methods if m in engine_methods()]:
        entry = registry_entry(m)
        on = slow if m in REFERENCES else target  # a reference here is a Hugging Face variant
        spec = dataclasses.replace(base, method=entry.name,
                                   block_size=cfg.gamma + 1 if entry.draft == "eagle" else cfg.block_size)
        engine = build_engine(on, {"eagle": eagle, "dflash": draft}.get(entry.draft), spec, verify_cost=cost,
                              tokenizer=built.tokenizer)
        built.engines[m] = engine
        # the deepest a step can verify, which bounds its accept lengths: the proposer's block (a tree with
        # prompt-lookup branches reaches deeper than the draft's block that the spec names)
        built.block_sizes[m] = engine.proposer.block_size


def _add_llamacpp(cfg, built: Built, notes: list[str]) -> None:
    """llama.cpp through llama-cpp-python on the target's GGUF (or its bf16 export)."""
    for m in [m for m in built.methods if m in REFERENCES and REFERENCES[m].runner == "llamacpp"]:
        why, file = llamacpp_available(), built.gguf
        if why is None and not REFERENCES[m].own_file:
            try:
                file = str(bf16_gguf(cfg.target, cfg.llamacpp_bf16_gguf))
            except (OSError, ValueError) as e:
                why = str(e)
        if why is None and not file:
            why = "no GGUF file (--llamacpp-gguf PATH)"
        if why is not None:
            built.methods.remove(m)
            notes.append(f"{m} skipped: {why}")
            continue
        threads = cfg.threads or torch.get_num_threads()
        pld = (cfg.pld_max_ngram, cfg.hf_pld_tokens) if REFERENCES[m].draft == "lookup" else None
        built.external[m] = LlamaCpp(file, threads, min(built.target.max_context, 4096), pld)
        notes.append(f"{m}: llama.cpp on {Path(file).name} (its own kernels), {threads} threads")


def _add_draft_engines(cfg, built: Built, name: str, path: str, notes: list[str]) -> None:
    """The requested DFlash methods again with the draft in `path`, as `method@name`, on the same target and its
    calibration: two drafts compared prompt by prompt in one run."""
    if not Path(path).is_dir():
        raise ValueError(f"--compare-draft {name}={path}: no such draft directory")
    draft = load_draft(Path(path), built.target)
    sub = Built(built.target, built.target_name, built.tokenizer,
                [m for m in built.methods if m in engine_methods() and m not in REFERENCES and _uses_dflash_draft(m)],
                calibration=built.calibration)
    add_engines(cfg, sub, draft, notes)
    for m in sub.methods:
        label = f"{m}@{name}"
        built.engines[label], built.block_sizes[label] = sub.engines[m], sub.block_sizes[m]
        built.methods.insert(built.methods.index(m) + 1, label)
    notes.append(f"draft {name}: {path} (sha256 {dir_sha256(Path(path))}; its methods as METHOD@{name})")


def _add_weights_engines(cfg, built: Built, draft, mode: str, notes: list[str]) -> None:
    """The requested `weights_methods()` again on the same HF model with weights `mode`, as `method@mode` (their
    own verify-cost calibration included)."""
    target = built.target
    other = TargetModel(target.hf, target.tokenizer, weights=plan_weights(mode, target.hf, built.gguf))
    sub_cfg = dataclasses.replace(cfg, weights=(mode,))
    sub = Built(other, built.target_name, built.tokenizer, [m for m in built.methods if m in weights_methods()])
    add_engines(sub_cfg, sub, draft, notes)
    for m in sub.methods:
        name = f"{m}@{mode}"
        built.engines[name], built.block_sizes[name] = sub.engines[m], sub.block_sizes[m]
        built.methods.insert(built.methods.index(m) + 1 if m in built.methods else len(built.methods), name)
    notes.append(f"weights {mode}: {other.weights.describe()}")
