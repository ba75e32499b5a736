#!/usr/bin/env bash
# The shipped draft beside its continuation on 1,000 ShareGPT answers it never saw, one heldout-tau run per set,
# both drafts on the same prompts in each run (greedy, each draft's decode block: 4).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/qwen2.5-coder-0.5b-fast-train/2026-12-04-new-sharegpt
for set in user-math user-code user-chat regen; do
  .venv/bin/blockdraft heldout-tau --target qwen2.5-coder-0.5b --set $set \
    --heldout data/qwen2.5-coder-regen/shards-heldout --prompts 12 --max-new-tokens 96 --threads 2 \
    --draft shipped=models/qwen2.5-coder-0.5b-dflash --draft new1000=runs/qwen-new1000/draft \
    --out $OUT/heldout-tau.jsonl
done
