"""How long a running stream waits while a long prompt is admitted beside it: one greedy stream decodes on the
default target (shipped draft), a ~4,000-token prompt is added, and the wall time of every step is recorded until the
new row has its first token. Printed: the stream's steps before, during and after the admission (median / max, ms),
and the whole prefill's time, with chunked admission (the engine's default) and, for comparison, with the whole
prompt prefilled in one step (prefill_chunk = the prompt's length).

    .venv/bin/python experiments/admission_gap.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from blockdraft.config import GenerationConfig
from blockdraft.decode.spec import DecodeSpec, build_engine
from blockdraft.models.loading import load_draft, load_target, resolve_draft


def run(target, draft, prompt_a, prompt_b, chunk: int) -> dict:
    eng = build_engine(target, load_draft(draft, target) if draft is not None else None, DecodeSpec())
    eng.prefill_chunk = chunk
    cfg = GenerationConfig(max_new_tokens=400, ignore_eos=True)
    a = eng.add(prompt_a, cfg)
    times, phase = {"before": [], "during": [], "after": []}, "before"
    t_add = None
    for i in range(200):
        if i == 10:
            b = eng.add(prompt_b, GenerationConfig(max_new_tokens=8, ignore_eos=True))
            phase, t_add = "during", time.perf_counter()
        t0 = time.perf_counter()
        events = eng.step()
        dt = (time.perf_counter() - t0) * 1000
        if any(ev.request_id == a and ev.num_tokens for ev in events):
            times[phase].append(dt)
        if phase == "during" and any(ev.request_id == b for ev in events):
            prefill_ms = (time.perf_counter() - t_add) * 1000
            phase = "after"
        if phase == "after" and len(times["after"]) >= 10:
            break
    eng.reset()
    return {"chunk": chunk, "prefill_ms": round(prefill_ms),
            **{f"{k}_median_ms": round(statistics.median(v), 1) for k, v in times.items() if v},
            **{f"{k}_max_ms": round(max(v), 1) for k, v in times.items() if v}, "steps_during": len(times["during"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target(None, "bf16")
    draft = resolve_draft(None, "smollm2-135m-instruct")
    g = torch.Generator().manual_seed(0)
    prompt_a = torch.randint(100, 40000, (40,), generator=g)
    prompt_b = torch.randint(100, 40000, (args.prompt_tokens,), generator=g)
    for chunk in (512, args.prompt_tokens):
        print(json.dumps(run(target, draft, prompt_a, prompt_b, chunk)), flush=True)


if __name__ == "__main__":
    main()
