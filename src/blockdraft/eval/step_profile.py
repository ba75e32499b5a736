"""Time one target step of the fast path at a fixed context, per weights mode and decoder path, methods interleaved.

A step is `TargetModel.forward` over W new tokens after `--context` cached positions (LM head included, features of
the draft's tapped layers included), the cache cropped back after each. Configurations:
- `bf16-python`: float weights through lean.py's Python layers (the path before quantized weights);
- `auto-python`: the GGUF's own 4/8-bit blocks through the same Python layers;
- `auto-native`: the same weights through the native stack (csrc/decoder.cpp), what decoding uses (on the best
  kernels this CPU has: AVX512-VNNI where it has them);
- `auto-native-avx2`: the same with the AVX2 kernels (the same bits, fewer multiply-adds per instruction).
Each configuration runs `--reps` timed steps per round, rounds rotate the order, the median is reported; one
`torch.profiler` table per configuration (W = 1) shows where the time goes.

Beside the steps (`--parts`):
- `ceiling`: the machine's int8 multiply-add ceiling on the same threads (the kernels' `int8_peak`: register-only
  chains of vpdpbusd, or AVX2's vpmaddubsw + vpaddw), the figure the linears are read against;
- `linears`: every linear of the target's layers on M rows of float32 activations (M = the widths), one call
  each: milliseconds and multiply-adds per second as a share of the ceiling;
- `head`: the LM head alone on M rows (the quantized head decoding uses; on a 150k vocabulary it streams a fifth of
  a 1.5B model's bytes every step);
- `read`: the machine's read bandwidth on the same threads (a float32 sum over 1 GiB), sampled in the rotation, and
  what the layers' and the head's weight bytes take at that bandwidth: the step's read floor;
- `draft`: one draft step of `--draft` (the target's shipped draft by default) behind its real proposer, at its
  decode block, each after an untimed verify of the target as in decoding: the catch-up of the context features
  of `--accepted` newly committed positions, the draft's forward, its head, the copy gate's scoring and the
  block's argmax, against the one-token target step of the same run.

    blockdraft step-profile --dtype bf16 --widths 1,2,4,8,16,64 --out benchmarks/step-profile/run.json
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import SamplingParams
from ..decode.spec import DecodeSpec, build_engine
from ..decode.tree import Tree
from ..models.draft import DFlashDraftModel
from ..models.loading import DEFAULT_TARGET, load_draft, load_target, resolve_draft
from ..models.quant import QuantLinear, quant_kernels
from ..models.target import TargetModel
from .machine import machine_info
from .manifest import config_command

@dataclass(frozen=True)
class StepProfileConfig:
    """`blockdraft step-profile` (see above): steps of each of widths new tokens after context cached positions,
    reps timed steps per configuration per round, rounds rotating the order, on threads torch threads; layers: the
    target layers tapped (the default draft's); paths: the configurations timed; parts: what is measured beside
    them (both named above); draft, draft_weights, accepted: the draft step's draft (None: the target's shipped
    one), its fused weights and the positions committed by the verify before it; out: also write the figures as
    JSON."""

    target: str | None = None
    dtype: str = "bf16"
    context: int = 200
    widths: tuple[int, ...] = (1, 4, 8, 16)
    reps: int = 10
    rounds: int = 3
    threads: int = 2
    layers: tuple[int, ...] = (1, 27)
    paths: tuple[str, ...] = ("bf16-python", "auto-python", "auto-native")
    parts: tuple[str, ...] = ("ceiling", "linears", "draft")
    draft: str | None = None
    draft_weights: str = "int8"
    accepted: int = 2
    out: str | None = None


def run(cfg: StepProfileConfig) -> int:
    """`blockdraft step-profile`: time the configurations of cfg.paths (see above)."""
    torch.set_num_threads(cfg.threads)
    torch.set_grad_enabled(False)
    widths = list(cfg.widths)
    taps = cfg.layers

    auto, _ = load_target(cfg.target, cfg.dtype, weights="auto")
    auto.set_layer_ids(taps)
    python = TargetModel(auto.hf, auto.tokenizer, layer_ids=taps, weights=auto.weights)
    python.lean.native = None  # the same quantized weights through the Python layers
    bf16 = TargetModel(auto.hf, auto.tokenizer, layer_ids=taps)
    configs = {"bf16-python": bf16, "auto-python": python, "auto-native": auto, "auto-native-avx2": auto}
    kernels = quant_kernels()
    best_isa = kernels.kernel_isa() if kernels is not None else None
    isa = {"auto-native-avx2": "avx2"}
    configs = {name: configs[name] for name in cfg.paths}
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, auto.vocab_size, (1, cfg.context), generator=gen)
    caches = {}
    for name, t in configs.items():
        caches[name] = t.new_decode_cache(cfg.context + max(widths) + 8)
        t.forward(prompt, caches[name], last_only=True)
    if best_isa is not None:
        print(f"kernels: {best_isa} (auto-native), avx2 (auto-native-avx2)")

    def step(name: str, w: int) -> float:
        t, c = configs[name], caches[name]
        if kernels is not None:
            kernels.set_kernel_isa(isa.get(name, best_isa))
        ids = torch.randint(0, auto.vocab_size, (1, w), generator=gen)
        t0 = time.perf_counter()
        t.forward(ids, c)
        dt = time.perf_counter() - t0
        c.crop(cfg.context)
        return dt

    parts = set(cfg.parts)
    extra = {}  # name -> (callable(width) -> seconds, widths)
    if "draft" in parts:
        draft_step = DraftStep(auto, cfg, gen)
        extra["draft"] = (lambda w: draft_step(), [draft_step.block])
    if "linears" in parts or "read" in parts:
        lin = Linears(auto, widths, gen)
    if "linears" in parts:
        extra["linears"] = (lin, widths)
    if "head" in parts or "read" in parts:
        head = Head(auto, widths, gen)
    if "head" in parts:
        extra["head"] = (head, widths)
    if "read" in parts:
        read = ReadBandwidth()
        extra["read"] = (lambda w: read(), [1])
    # the ceiling is sampled in the same rotation (the machine's speed drifts by tens of percent over minutes)
    ceiling_isas = ([] if "ceiling" not in parts or kernels is None else
                    ["avx512-vnni", "avx2"] if kernels.cpu_has_vnni() else ["avx2"])
    ceiling: dict[str, list[float]] = {name: [] for name in ceiling_isas}
    for name in configs:  # warm-up: first calls allocate and touch every weight
        for w in widths:
            step(name, w)
    if kernels is not None:
        kernels.set_kernel_isa(best_isa)
    for f, ws in extra.values():
        for w in ws:
            f(w)
    times: dict[str, dict[int, list[float]]] = {n: {w: [] for w in widths} for n in configs}
    times.update({n: {w: [] for w in ws} for n, (_, ws) in extra.items()})
    names = list(configs) + list(extra) + (["ceiling"] if ceiling_isas else [])
    for r in range(cfg.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name == "ceiling":
                for which in ceiling_isas:
                    ceiling[which] += [kernels.int8_peak(which, 5_000_000) for _ in range(cfg.reps)]
                continue
            if name in extra:
                f, ws = extra[name]
                if kernels is not None:  # the draft and the linears run on the kernels decoding uses
                    kernels.set_kernel_isa(best_isa)
                for w in ws:
                    times[name][w] += [f(w) for _ in range(cfg.reps)]
                continue
            for w in widths:
                times[name][w] += [step(name, w) for _ in range(cfg.reps)]
    table = {n: {w: 1e3 * statistics.median(v) for w, v in ws.items()} for n, ws in times.items()}
    names = list(configs)
    profiles = {}
    from torch.profiler import ProfilerActivity, profile

    for name in names:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(cfg.reps):
                step(name, 1)
        profiles[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    if kernels is not None:  # the paths switch ISAs: what follows (and the machine record) runs on the best
        kernels.set_kernel_isa(best_isa)
    print(f"target step at context {cfg.context}, ms (median of {cfg.rounds * cfg.reps}), dtype {cfg.dtype}")
    print("| path | " + " | ".join(f"{w} tok" for w in widths) + " |")
    print("|---|" + "---:|" * len(widths))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{table[n][w]:.1f}" for w in widths) + " |")
    # ratios and the draft's share against the path decoding uses (the first native one timed)
    base = next((n for n in names if n == "auto-native"), names[-1])
    one = table[base][widths[0]] if widths[0] == 1 else None
    summary = {}
    if one is not None:
        summary["ratio_to_one_token"] = {w: table[base][w] / one for w in widths}
        print(f"ratio to one token ({base}): " + ", ".join(f"{w}: {table[base][w] / one:.2f}x" for w in widths))
    if "draft" in parts:
        ms = table["draft"][draft_step.block]
        summary["draft"] = {"ms": ms, "block": draft_step.block, "accepted": cfg.accepted, "path": draft_step.path,
                            "weights": draft_step.weights, "share_of_one_token": ms / one if one else None}
        print(f"draft step ({draft_step.path}, block {draft_step.block}, {draft_step.weights} weights, "
              f"{cfg.accepted} positions caught up): {ms:.2f} ms" + (f" = {ms / one:.0%} of a one-token step"
                                                                      if one else ""))
    if ceiling_isas:
        summary["ceiling_gmacs"] = {k: statistics.median(v) / 1e9 for k, v in ceiling.items()}
        print("int8 ceiling, G multiply-adds/s on", cfg.threads, "threads (median, sampled with the steps):",
              ", ".join(f"{k} {v:.0f}" for k, v in summary["ceiling_gmacs"].items()))
    if "linears" in parts:
        peak = summary.get("ceiling_gmacs", {}).get(best_isa)
        rows = {w: {"ms": table["linears"][w], "gmacs": lin.macs * w / table["linears"][w] / 1e6} for w in widths}
        for w, r in rows.items():
            r["share_of_ceiling"] = r["gmacs"] / peak if peak else None
        summary["linears"] = {"count": len(lin.lins), "macs_per_row": lin.macs, "rows": rows}
        print(f"{len(lin.lins)} linears ({lin.macs / 1e6:.1f} M multiply-adds per row), {best_isa} kernels:")
        for w, r in rows.items():
            share = f", {r['share_of_ceiling']:.0%} of the ceiling" if peak else ""
            print(f"  M={w:3d}: {r['ms']:6.2f} ms, {r['gmacs']:6.1f} G/s{share}")
    if "head" in parts:
        summary["head"] = {"rows": {w: {"ms": table["head"][w]} for w in widths}}
        print("LM head: " + ", ".join(f"M={w}: {table['head'][w]:.2f} ms" for w in widths))
    if "read" in parts:
        gbs = read.bytes / (table["read"][1] / 1e3) / 1e9
        layers_mb, head_mb = lin.weight_bytes / 1e6, head.weight_bytes / 1e6
        floor = (layers_mb + head_mb) / 1e3 / gbs * 1e3
        summary["read"] = {"gb_per_s": gbs, "layers_mb": layers_mb, "head_mb": head_mb, "floor_ms": floor,
                           "one_token_over_floor": table[base][1] / floor if one else None}
        print(f"read bandwidth {gbs:.1f} GB/s; weights streamed per step: layers {layers_mb:.0f} MB + head "
              f"{head_mb:.0f} MB -> read floor {floor:.1f} ms" +
              (f"; the one-token step is {table[base][1] / floor:.2f}x it" if one else ""))
    if cfg.out:
        out = Path(cfg.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "command": config_command("step-profile", cfg), "machine": machine_info(),
            "weights": auto.weights.describe(), "kernel_isa": best_isa, "ms": table, **summary,
            "profiles": profiles}, indent=1))
        print(f"wrote {out}")
    return 0


class Linears:
    """Every linear of the target's layers on M rows of float32 activations (what the native stack feeds them), one
    call each: f(M) -> seconds. Each call also pays Python's dispatch (a few microseconds)."""

    def __init__(self, target: TargetModel, widths: list[int], gen: torch.Generator) -> None:
        self.lins = [getattr(layer, n) for layer in target.lean.layers
                     for n in ("qkv_proj", "o_proj", "gate_up", "down")]
        self.macs = sum(lin.out_features * lin.in_features for lin in self.lins)
        self.weight_bytes = sum(_weight_bytes(lin) for lin in self.lins)
        self.xs = {w: [torch.randn(w, lin.in_features, generator=gen) for lin in self.lins] for w in widths}

    def __call__(self, w: int) -> float:
        t0 = time.perf_counter()
        for lin, x in zip(self.lins, self.xs[w]):
            lin(x)
        return time.perf_counter() - t0


def _weight_bytes(lin) -> int:
    """What one product of lin streams: the kernels' packed bytes (quantized), else its float weight's."""
    if isinstance(lin, QuantLinear):
        return int(lin.native().weight_bytes)
    w = getattr(lin, "weight", None)
    return int(w.numel() * w.element_size()) if isinstance(w, torch.Tensor) else 0


class Head:
    """The target's LM head (as `TargetModel.logits` runs it) on M rows of final-normed hidden states: f(M) ->
    seconds."""

    def __init__(self, target: TargetModel, widths: list[int], gen: torch.Generator) -> None:
        self.target = target
        self.xs = {w: torch.randn(w, target.hidden_size, generator=gen).to(target.dtype) for w in widths}
        self.weight_bytes = target.head_weight_bytes()

    def __call__(self, w: int) -> float:
        t0 = time.perf_counter()
        self.target.logits(self.xs[w])
        return time.perf_counter() - t0


class ReadBandwidth:
    """One float32 sum over 1 GiB on torch's threads: f() -> seconds (bytes / seconds = the read bandwidth a
    streaming kernel can hope for on this machine)."""

    def __init__(self) -> None:
        self.x = torch.ones(1 << 28)
        self.bytes = self.x.numel() * 4

    def __call__(self) -> float:
        t0 = time.perf_counter()
        self.x.sum()
        return time.perf_counter() - t0


class DraftStep:
    """One draft step behind the real proposer, as the engine runs it after a verify: the context features of the
    newly committed positions caught up, then a block drafted greedily. The proposer's context is cropped back
    after each call, so every call sees the same `--context` positions. Before each timed call a verify of the
    draft's block runs on the target (untimed), as in decoding: its ~100 MB of weights stream through the caches,
    so the draft reads its own weights from memory, not from a cache it had to itself (measured alone, a draft
    step here took about half as long)."""

    def __init__(self, target: TargetModel, cfg: StepProfileConfig, gen: torch.Generator) -> None:
        path = resolve_draft(cfg.draft, cfg.target or DEFAULT_TARGET)
        if path is None:
            raise SystemExit("step-profile: no draft is shipped for this target: pass --draft DIR, or leave "
                             "'draft' out of --parts")
        draft = load_draft(path, target)
        if not isinstance(draft, DFlashDraftModel):
            raise SystemExit(f"{path} is not a DFlash draft")
        self.path, self.weights = str(path), cfg.draft_weights
        # the fixed-width chain's proposer, as `--method dflash` builds it (no calibration needed)
        self.proposer = build_engine(target, draft, DecodeSpec("dflash", draft_weights=cfg.draft_weights)).proposer
        self.block = self.proposer.block_size
        # the committed tokens: the context, the newly verified positions and the anchor (the verify's bonus token)
        self.tokens = torch.randint(0, target.vocab_size, (cfg.context + cfg.accepted + 1,), generator=gen)
        cache = target.new_decode_cache(cfg.context + cfg.accepted + self.block + 8)
        feats = target.forward(self.tokens[None, :-1], cache, last_only=True, tap=draft.context_layer_ids).features
        self.target, self.cache, self.verified = target, cache, cache.length
        self.ctx = cfg.context
        self.proposer.start(self.tokens[:cfg.context], feats[:, :cfg.context])
        self.new = feats[:, cfg.context:]
        # the step before as a verified chain: the positions whose features `new` holds
        c = cfg.context
        self.verified_tree = Tree.chain(self.tokens[c], self.tokens[c + 1:c + cfg.accepted])
        self.verified_path = list(range(cfg.accepted))

    def __call__(self) -> float:
        self.target.forward(self.tokens[None, -self.block:], self.cache)  # the verify before (untimed)
        self.cache.crop(self.verified)
        t0 = time.perf_counter()
        self.proposer.accept(self.verified_tree, self.verified_path, self.new)
        out = self.proposer.propose(self.tokens, self.block - 1, SamplingParams(), None)
        dt = time.perf_counter() - t0
        assert out.num_nodes == self.block
        self.proposer.ctx.crop(self.ctx)
        return dt
