#!/usr/bin/env python
"""llama.cpp's classic speculative decoding on a packaged target, swept over its draft length: which
`--spec-draft-n-max` a user should pick, and what it buys over llama.cpp's plain decoding of the same file.

For each setting (plain, llama.cpp's default draft settings, then each `--spec-draft-n-max` in `--n-max`) one
`llama-server` (eval/llamacpp_server.py: loopback, one slot, `--threads` threads) answers the same chat-templated
prompts as users write them, greedy, `--max-new-tokens` tokens; decode tokens/s is llama.cpp's own timing, the
acceptance llama.cpp's own counters. Settings are run prompt by prompt in a rotating order, every server started
once and kept, so that machine drift hits all of them alike; ratios are paired per prompt against plain.

    .venv/bin/python experiments/llamacpp_spec_sweep.py --target qwen2.5-coder-1.5b --n-max 2,4,8,12,16 \\
        --out benchmarks/qwen2.5-coder-1.5b/2026-12-05-llamacpp-spec-sweep
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from blockdraft.eval.llamacpp_server import LlamaServer, ServerRunner
from blockdraft.eval.machine import machine_info
from blockdraft.models.loading import FAMILY_DRAFT_MODELS, encode_prompt, resolve_target
from blockdraft.prompts import load_task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--n-max", default="2,4,8,12,16", help="comma list of --spec-draft-n-max values")
    ap.add_argument("--tasks", default="user-code,user-chat,user-math")
    ap.add_argument("--n", type=int, default=2, help="prompts per task")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from transformers import AutoTokenizer

    src = resolve_target(a.target)
    gguf = Path(src.path) / src.gguf_file
    small = resolve_target(FAMILY_DRAFT_MODELS[a.target])
    draft = Path(small.path) / small.gguf_file
    tok = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file)
    prompts = [p for t in a.tasks.split(",") for p in load_task(t, a.n)]
    ids = [encode_prompt(tok, p.messages) for p in prompts]
    settings = {"plain": None, "default": "default"} | {f"n{n}": int(n) for n in a.n_max.split(",")}
    runners = {}
    try:
        for name, n in settings.items():
            srv = (LlamaServer(gguf, a.threads, 4096) if n is None else
                   LlamaServer(gguf, a.threads, 4096, draft, None if n == "default" else n, spec_type="draft-simple"))
            runners[name] = ServerRunner(srv)
        names = list(settings)
        eos = tuple(i for i in (tok.eos_token_id,) if i is not None)
        recs: dict[str, list[dict]] = {k: [] for k in names}
        for i, x in enumerate(ids):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                r = runners[name].run(x, a.max_new_tokens, 0.0, 0, eos, tok)
                recs[name].append({"prompt": prompts[i].id, "tps": r["decode_tokens_per_s"], "tau": r["tau"],
                                   "tokens": r["token_ids"], "llamacpp": r["llamacpp"]})
    finally:
        for r in runners.values():
            r.server.close()
    plain = recs["plain"]
    rows = []
    for name in names:
        ratios = [r["tps"] / p["tps"] for r, p in zip(recs[name], plain)]
        c = {k: sum((r["llamacpp"] or {}).get(k, 0) for r in recs[name]) for k in ("drafted", "accepted", "verify_steps")}
        rows.append({"setting": name, "decode_tps_median": statistics.median(r["tps"] for r in recs[name]),
                     "vs_plain_median": statistics.median(ratios), "vs_plain_min": min(ratios),
                     "vs_plain_max": max(ratios), "accept_rate": c["accepted"] / c["drafted"] if c["drafted"] else None,
                     "tau": 1 + c["accepted"] / c["verify_steps"] if c["verify_steps"] else None,
                     "plain_match": sum(r["tokens"] == p["tokens"] for r, p in zip(recs[name], plain)) / len(plain)})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(a), "machine": machine_info(), "rows": rows,
                                                  "records": recs}, indent=1))
    lines = ["| setting | decode tok/s | vs plain, median [min-max] | accept rate | tau | plain match |",
             "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        ar, tau = r["accept_rate"], r["tau"]
        lines.append(f"| {r['setting']} | {r['decode_tps_median']:.1f} | {r['vs_plain_median']:.2f}x "
                     f"[{r['vs_plain_min']:.2f}-{r['vs_plain_max']:.2f}] | {'—' if ar is None else f'{ar:.2f}'} | "
                     f"{'—' if tau is None else f'{tau:.2f}'} | {r['plain_match']:.0%} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
