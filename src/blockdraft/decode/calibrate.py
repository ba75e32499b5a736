"""Verify-cost calibration: how long the target takes to verify N tokens at once, N = 1..64.

A tree's node budget trades acceptance for verify time. On a CPU with bf16 matrix units a 16-token verify costs
little more than a 1-token step, but the curve is machine-, dtype- and thread-specific, so it is measured rather than
assumed: `measure_verify_cost` times target forwards on a fixed context (minimum over repetitions, which is robust
to other processes' bursts) at every width up to 16 and every 4th beyond (interpolated linearly in between: the
curve is smooth there and this halves the ~30 s a full sweep takes on one busy core), and `load_or_measure` keeps the
result in the cache directory, keyed by the target's weights layout, dtype, path, thread count, CPU and torch
version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..config import cache_dir
from ..models.quant import kernel_isa
from .tree import ancestor_mask

log = logging.getLogger(__name__)

MAX_WIDTH = 64
DENSE_UP_TO = 16  # every width is timed up to here, every STRIDE-th one beyond
STRIDE = 4
CONTEXT = 256  # committed tokens in the cache while timing: a typical prompt plus part of an answer


@dataclass
class VerifyCost:
    seconds: list[float]  # seconds[w - 1]: one target forward of w new tokens (features tapped) on `context` cached
    context: int = CONTEXT
    meta: dict = field(default_factory=dict)
    # the same for a causal chain of w tokens (no explicit mask: how the engine verifies a chain-shaped tree);
    # None: only masked forwards were timed, and a chain is costed like any tree of its width
    chain_seconds: list[float] | None = None

    def __post_init__(self) -> None:
        for name, ys in (("seconds", self.seconds), ("chain_seconds", self.chain_seconds or [1.0])):
            if not ys or any(not (s > 0) for s in ys):
                raise ValueError(f"a verify-cost calibration needs a positive time for every width 1..N ({name})")
        if self.chain_seconds is not None and len(self.chain_seconds) != len(self.seconds):
            raise ValueError("chain_seconds and seconds must cover the same widths")

    @property
    def max_width(self) -> int:
        return len(self.seconds)

    def __call__(self, width: int) -> float:
        """Seconds to verify a tree of `width` nodes (linear extrapolation past the measured range)."""
        return _at(self.seconds, width)

    def chain(self, width: int) -> float:
        """Seconds to verify a causal chain of `width` tokens."""
        return _at(self.chain_seconds or self.seconds, width)

    def summary(self) -> dict:
        """Milliseconds at a few widths and relative to one token: what the stats and the bench report show."""
        pick = [w for w in (1, 2, 4, 8, 16, 24, 32, 48, 64) if w <= self.max_width]
        out = {"context": self.context, "ms": {w: round(1e3 * self(w), 3) for w in pick},
               "relative": {w: round(self(w) / self(1), 3) for w in pick}, **self.meta}
        if self.chain_seconds is not None:
            out["chain_ms"] = {w: round(1e3 * self.chain(w), 3) for w in pick}
        return out


def _at(seconds: list[float], width: int) -> float:
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if width <= len(seconds):
        return seconds[width - 1]
    last = seconds[-1]
    slope = max(0.0, (last - seconds[0]) / max(1, len(seconds) - 1))
    return last + slope * (width - len(seconds))


def measure_verify_cost(target, max_width: int = MAX_WIDTH, context: int = CONTEXT, reps: int = 3,
                        seed: int = 0, tree: bool = True, taps: tuple[int, ...] = ()) -> VerifyCost:
    """Time target forwards of 1..max_width tokens after a `context`-token prefill (random tokens: the cost does
    not depend on them), both as a tree (explicit ancestor mask) and as a causal chain when tree=True, else as a
    chain only. Widths (and the two shapes) are visited in a rotating order per repetition so that slow phases of
    the machine spread over all of them; each keeps its fastest time. The times are then made non-decreasing in
    width (`monotone`: verifying more tokens never costs less, so a dip is noise, e.g. another process pausing; left
    in, it would pull every budget choice to that width), and widths between the timed ones are interpolated. taps:
    the target layers a verify taps (what the engine will pass)."""
    if max_width < 1 or context < 1 or reps < 1:
        raise ValueError("max_width, context and reps must be >= 1")
    context = min(context, target.max_context - max_width - 1)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (1, context + max_width), generator=g).to(target.device)
    cache = target.new_decode_cache(context + max_width + 1)
    with torch.no_grad():
        target.forward(ids[:, :context], cache, last_only=True, tap=False)
        timed = sorted(set(range(1, min(max_width, DENSE_UP_TO) + 1)) | set(range(DENSE_UP_TO, max_width + 1,
                                                                                     STRIDE)) | {max_width})
        # trees are costed from masked forwards (a chain-shaped ancestor mask stands in for any shape of that
        # width) and chains, which the engine verifies without a mask, from causal ones: the two are timed rather
        # than assumed equal (on the lean bf16 path they measured alike, within noise; an earlier belief that the
        # masked path costs more came from comparing calibrations of different runs)
        shapes = ("tree", "chain") if tree else ("chain",)
        jobs = [(shape, w) for w in timed for shape in shapes]
        best = {job: float("inf") for job in jobs}
        positions = torch.arange(context, context + max_width, device=ids.device).unsqueeze(0)
        masks = {w: ancestor_mask(torch.arange(-1, w - 1)).to(ids.device) for w in timed}
        for r in range(reps + 1):  # repetition 0 warms up every width (first-call allocations) and is not kept
            k = (r * 7) % len(jobs)
            for shape, w in jobs[k:] + jobs[:k]:
                masked = shape == "tree"
                t0 = time.perf_counter()
                target.forward(ids[:, context:context + w], cache, tap=taps,
                               positions=positions[:, :w] if masked else None, tree_mask=masks[w] if masked else None)
                dt = time.perf_counter() - t0
                cache.crop(context)
                if r > 0:
                    best[shape, w] = min(best[shape, w], dt)
    curves = {shape: _interpolate(timed, monotone([best[shape, w] for w in timed]), max_width) for shape in shapes}
    meta = {"threads": torch.get_num_threads(), "dtype": str(target.dtype).replace("torch.", ""),
            "path": "lean" if target.lean is not None else "hf", "reps": reps, "timed_widths": timed,
            "tree_mask": tree}
    return VerifyCost(curves["tree"] if tree else curves["chain"], context, meta,
                      chain_seconds=curves["chain"] if tree else None)


def _interpolate(timed: list[int], times: list[float], max_width: int) -> list[float]:
    """Times at the timed widths -> a time for every width 1..max_width (linear in between)."""
    best = dict(zip(timed, times))
    seconds = []
    for w in range(1, max_width + 1):
        lo = max(t for t in timed if t <= w)
        hi = min(t for t in timed if t >= w)
        f = 0.0 if hi == lo else (w - lo) / (hi - lo)
        seconds.append((1 - f) * best[lo] + f * best[hi])
    return seconds


def monotone(y: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of y (pool adjacent violators): each run of values that decreases is
    replaced by its mean."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in y:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return [s / c for s, c in blocks for _ in range(c)]


def _key(target) -> str:
    cfg = target.config
    parts = [getattr(cfg, "model_type", ""), cfg.hidden_size, getattr(cfg, "intermediate_size", ""),
             target.num_layers, target.vocab_size, getattr(cfg, "num_attention_heads", ""),
             getattr(cfg, "num_key_value_heads", ""), str(target.dtype), str(target.device),
             "lean" if target.lean is not None else "hf", torch.get_num_threads(), torch.__version__,
             getattr(getattr(target, "weights", None), "mode", "bf16"),
             platform.processor() or platform.machine(), _cpu_model(), kernel_isa(), "tree-mask+chain"]
    return hashlib.sha1("|".join(map(str, parts)).encode()).hexdigest()[:16]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.lower().startswith("model name")), "")
    except OSError:
        return ""


def calibration_path(target) -> Path:

    return cache_dir() / "calibration" / f"verify-cost-{_key(target)}.json"


def load_or_measure(target, refresh: bool = False, path: Path | None = None, **measure_kw) -> VerifyCost:
    """The cached calibration for this target and machine setup, else a fresh measurement (saved). refresh=True
    always measures (the benchmark does, so that its budget reflects the machine as it is during the run)."""
    path = path or calibration_path(target)
    if not refresh and path.is_file():
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            cost = VerifyCost(d["seconds"], d["context"], d.get("meta", {}), d.get("chain_seconds"))
            log.info("verify-cost calibration from %s", path)
            return cost
        except (ValueError, KeyError, TypeError) as e:
            log.warning("ignoring a corrupt calibration file %s (%s): measuring again", path, e)
    t0 = time.perf_counter()
    cost = measure_verify_cost(target, **measure_kw)
    cost.meta["measured_seconds"] = round(time.perf_counter() - t0, 2)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(cost)), encoding="utf-8")
    tmp.replace(path)
    log.info("verify cost measured in %.1f s, saved to %s", cost.meta["measured_seconds"], path)
    return cost
