#!/usr/bin/env bash
# Prefill and step cost before / after the causal attention change, processes alternated (old, new, old, new):
# the old engine is a worktree at the commit before it (its own kernel build), the new one this checkout.
# Every prefill run pairs each round with llama-server's own prompt timing on the same GGUF, so the ratio to
# llama.cpp cancels the machine's drift between processes.
#   OLD=/path/to/worktree bash benchmarks/prefill/2026-12-04/ab.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/prefill/2026-12-04
PY=.venv/bin/python
OLD=${OLD:?worktree of the commit before the change}
for i in 1 2; do
  for side in old new; do
    if [ $side = old ]; then pp=$OLD/src; else pp=src; fi
    PYTHONPATH=$pp $PY -m blockdraft.cli prefill-bench --tokens 128,512,1024 --rounds 3 --methods ar,llamacpp-server \
      --threads 2 --out $OUT/ab-smollm2-$side-$i.json | tail -6
    PYTHONPATH=$pp $PY -m blockdraft.cli prefill-bench --target qwen2.5-coder-0.5b --tokens 512 --rounds 3 \
      --methods ar,llamacpp-server --threads 2 --out $OUT/ab-qwen-$side-$i.json | tail -4
    PYTHONPATH=$pp $PY -m blockdraft.cli step-profile --widths 1,4,16 --paths auto-native --parts '' --rounds 3 \
      --reps 8 --threads 2 --out $OUT/ab-step-$side-$i.json | grep -A4 "^target step"
  done
done
