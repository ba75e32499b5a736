"""Quality of each weights mode against the file's own model, teacher-forced on held-out records.

The reference is the GGUF dequantized to float32 and run through the Hugging Face modules (what transformers loads
from the file). Each mode's fast path reads the same records and is scored per response position on:
- top-1 agreement: its argmax equals the reference's;
- relative logit error: ||logits - ref|| / ||ref|| per position, the median and the 95th percentile.
Modes: `auto` (the file's own 4/8-bit blocks), `bf16` (float weights in the chosen dtype), `int8` / `int4`
(quantized from the float weights, groups of 32).

    .venv/bin/python experiments/weights_quality.py --records 24 --dtype bf16 --out benchmarks/weights/quality.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from blockdraft.eval.machine import machine_info
from blockdraft.models.loading import load_target
from blockdraft.models.quant import plan_weights
from blockdraft.models.target import TargetModel
from blockdraft.train.records import load_records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=24)
    p.add_argument("--data", default="data/smollm2-regen/heldout.npz")
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--modes", default="auto,bf16,int8,int4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    ref_target, src = load_target(None, "fp32", lean=False)
    gguf = Path(src.path) / src.gguf_file
    fast, _ = load_target(None, args.dtype, weights="bf16")
    targets = {m: TargetModel(fast.hf, fast.tokenizer, weights=plan_weights(m, fast.hf, gguf))
               for m in args.modes.split(",")}
    records = load_records(args.data)[: args.records]
    agree = {m: [] for m in targets}
    err = {m: [] for m in targets}
    for rec in records:
        ids = torch.tensor(rec["input_ids"][: args.max_len]).unsqueeze(0)
        mask = torch.tensor(rec["loss_mask"][: args.max_len], dtype=torch.bool)
        ref = ref_target.forward(ids, None, tap=False).logits[0].float()[mask]
        for m, t in targets.items():
            got = t.forward(ids, t.new_decode_cache(ids.shape[1] + 8), tap=False).logits[0].float()[mask]
            agree[m] += (got.argmax(-1) == ref.argmax(-1)).tolist()
            err[m] += ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).tolist()
    out = {}
    for m in targets:
        e = sorted(err[m])
        out[m] = {"positions": len(e), "top1_agreement": sum(agree[m]) / len(agree[m]),
                  "rel_logit_error_median": statistics.median(e), "rel_logit_error_p95": e[int(0.95 * (len(e) - 1))],
                  "weights": targets[m].weights.describe()}
    print(f"teacher-forced on {len(records)} held-out records, reference: the GGUF dequantized to fp32 (HF modules)")
    print("| weights | top-1 agreement | rel. logit error, median | p95 |")
    print("|---|---:|---:|---:|")
    for m, r in out.items():
        print(f"| {m} ({args.dtype}) | {100 * r['top1_agreement']:.2f}% | {r['rel_logit_error_median']:.4f} | "
              f"{r['rel_logit_error_p95']:.4f} |")
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"command": "experiments/weights_quality.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
            "machine": machine_info(), "results": out}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
