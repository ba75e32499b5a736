#!/bin/bash
# Held-out tau of the third GPU round's drafts (the epochs lever) beside the shipped one: one heldout-tau run per
# (set, block), every draft in the same run (greedy, fixed width, the CPU engine on the GGUF's own weights, 2 threads).
#   shipped  models/smollm2-135m-dflash
#   r11      the shipped draft continued on all 30,504 answers at train block 16 for 1.13 epochs (second round)
#   e3       r11 continued for 1.8 epochs more (1,143 steps, lr 3e-4 cosine): ~2.9 epochs in all
#   e4       r11 continued for 2.48 epochs more (1,575 steps, lr 3e-4 cosine): ~3.6 epochs in all
cd "$(dirname "$0")/../../.." || exit 1
OUT=${OUT:-benchmarks/smollm2-135m-gpu-round3/2026-12-04/heldout-tau.jsonl}
DRAFTS="--draft shipped=models/smollm2-135m-dflash --draft r11=runs/gpu2/r11 --draft e3=runs/gpu3/e3
        --draft e4=runs/gpu3/e4"
run() { .venv/bin/blockdraft heldout-tau --threads 2 --max-new-tokens 96 $DRAFTS --out $OUT "$@" > /dev/null; }
for b in 4 16 8; do
  for set in user-math user-code user-chat; do run --set $set --prompts 12 --block-size $b; done
done
run --set regen --prompts 24 --block-size 4
echo done
