"""Verify-cost calibration: how long the target takes to verify N tokens at once, N = 1..64 (issue #13).

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

    def __post_init__(self) -> None:
        if not self.seconds or any(not (s > 0) for s in self.seconds):
            raise ValueError("a verify-cost calibration needs a positive time for every width 1..N")

    @property
    def max_width(self) -> int:
        return len(self.seconds)

    def __call__(self, width: int) -> float:
        """Seconds to verify `width` tokens (linear extrapolation past the measured range)."""
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        if width <= self.max_width:
            return self.seconds[width - 1]
        last = self.seconds[-1]
        slope = max(0.0, (last - self.seconds[0]) / max(1, self.max_width - 1))
        return last + slope * (width - self.max_width)

    def summary(self) -> dict:
        """Milliseconds at a few widths and relative to one token: what the stats and the bench report show."""
        pick = [w for w in (1, 2, 4, 8, 16, 24, 32, 48, 64) if w <= self.max_width]
        return {"context": self.context, "ms": {w: round(1e3 * self(w), 3) for w in pick},
                "relative": {w: round(self(w) / self(1), 3) for w in pick}, **self.meta}


def measure_verify_cost(target, max_width: int = MAX_WIDTH, context: int = CONTEXT, reps: int = 3,
                        seed: int = 0, tree: bool = True) -> VerifyCost:
    """Time target forwards of 1..max_width tokens after a `context`-token prefill (random tokens: the cost does
    not depend on them). Widths are visited in a rotating order per repetition so that slow phases of the machine
    spread over all of them; each width keeps its fastest time. The times are then made non-decreasing in width
    (`monotone`: verifying more tokens never costs less, so a dip is noise, e.g. another process pausing; left in,
    it would pull every budget choice to that width), and widths between the timed ones are interpolated."""
    if max_width < 1 or context < 1 or reps < 1:
        raise ValueError("max_width, context and reps must be >= 1")
    context = min(context, target.max_context - max_width - 1)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (1, context + max_width), generator=g).to(target.device)
    cache = target.new_decode_cache(context + max_width + 1)
    tap = bool(target.layer_ids)
    with torch.no_grad():
        target.forward(ids[:, :context], cache, last_only=True, tap=False)
        timed = sorted(set(range(1, min(max_width, DENSE_UP_TO) + 1)) | set(range(DENSE_UP_TO, max_width + 1,
                                                                                     STRIDE)) | {max_width})
        best = {w: float("inf") for w in timed}
        # a tree verify passes an explicit ancestor mask, which takes a slower attention path than a causal chain
        # (measured on code in fp32: ~16 tree nodes took 100 ms where a causal 16-token chain took 82-86 ms), so
        # the budget is chosen from masked forwards; a chain-shaped tree stands in for any shape of that width
        positions = torch.arange(context, context + max_width, device=ids.device).unsqueeze(0)
        masks = {w: ancestor_mask(torch.arange(-1, w - 1)).to(ids.device) for w in timed} if tree else {}
        for r in range(reps + 1):  # repetition 0 warms up every width (first-call allocations) and is not kept
            k = (r * 7) % len(timed)
            for w in timed[k:] + timed[:k]:
                t0 = time.perf_counter()
                target.forward(ids[:, context:context + w], cache, tap=tap,
                               positions=positions[:, :w] if tree else None, tree_mask=masks.get(w))
                dt = time.perf_counter() - t0
                cache.crop(context)
                if r > 0:
                    best[w] = min(best[w], dt)
    best = dict(zip(timed, monotone([best[w] for w in timed])))
    seconds = []
    for w in range(1, max_width + 1):
        lo = max(t for t in timed if t <= w)
        hi = min(t for t in timed if t >= w)
        f = 0.0 if hi == lo else (w - lo) / (hi - lo)
        seconds.append((1 - f) * best[lo] + f * best[hi])
    return VerifyCost(seconds, context, {"threads": torch.get_num_threads(), "dtype": str(target.dtype).replace(
        "torch.", ""), "path": "lean" if target.lean is not None else "hf", "reps": reps, "timed_widths": timed,
        "tree_mask": tree})


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
             platform.processor() or platform.machine(), _cpu_model(), "tree-mask"]
    return hashlib.sha1("|".join(map(str, parts)).encode()).hexdigest()[:16]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.lower().startswith("model name")), "")
    except OSError:
        return ""


def calibration_path(target) -> Path:
    from .loading import cache_dir

    return cache_dir() / "calibration" / f"verify-cost-{_key(target)}.json"


def load_or_measure(target, refresh: bool = False, path: Path | None = None, **measure_kw) -> VerifyCost:
    """The cached calibration for this target and machine setup, else a fresh measurement (saved). refresh=True
    always measures (the benchmark does, so that its budget reflects the machine as it is during the run)."""
    path = path or calibration_path(target)
    if not refresh and path.is_file():
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            cost = VerifyCost(d["seconds"], d["context"], d.get("meta", {}))
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
