#!/bin/bash
# The curve at decode block 8 (measure.sh's drafts), one heldout-tau run per set.
cd "$(dirname "$0")/../../.." || exit 1
OUT=benchmarks/smollm2-135m-gpu-round2/2026-12-04/heldout-tau.jsonl
DRAFTS="--draft shipped=models/smollm2-135m-dflash --draft c2000=runs/gpu2/c2000 --draft c8000=runs/gpu2/c8000
        --draft r11=runs/gpu2/r11 --draft r11b=runs/gpu2/r11b"
for set in user-math user-code user-chat; do
  .venv/bin/blockdraft heldout-tau --threads 2 --max-new-tokens 96 $DRAFTS --out $OUT --set $set --prompts 12 \
      --block-size 8 > /dev/null
done
echo done
