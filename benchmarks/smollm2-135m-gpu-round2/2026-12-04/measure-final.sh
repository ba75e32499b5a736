#!/bin/bash
# The ship decision: the shipped draft, the GPU round's r11b and r11c (r11b continued on the CPU at train block 4
# from the teacher cache, copy gate trained, recipes/smollm2-135m-dflash-r11c.yaml), one heldout-tau run per
# (set, block), every draft in the same run.
cd "$(dirname "$0")/../../.." || exit 1
OUT=${OUT:-benchmarks/smollm2-135m-gpu-round2/2026-12-04/heldout-tau-final.jsonl}
DRAFTS="--draft shipped=${SHIPPED:-models/smollm2-135m-dflash} --draft r11b=runs/gpu2/r11b --draft r11c=runs/r11c/draft-step700"
run() { .venv/bin/blockdraft heldout-tau --threads 2 --max-new-tokens 96 $DRAFTS --out $OUT "$@" > /dev/null; }
for set in user-math user-code user-chat; do run --set $set --prompts 12 --block-size 4; done
run --set regen --prompts 24 --block-size 4
run --set regen --heldout data/smollm2-regen/heldout-wide.npz --prompts 24 --block-size 4 --out ${OUT%.jsonl}-wide-split.jsonl
run --set gsm-unseen --prompts 24 --block-size 4
for b in 16; do
  for set in user-math user-code user-chat; do run --set $set --prompts 12 --block-size $b; done
done
echo done
