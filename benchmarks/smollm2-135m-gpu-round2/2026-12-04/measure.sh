#!/bin/bash
# Held-out tau of the second GPU round's drafts beside the shipped one: one heldout-tau run per (set, block), every
# draft in the same run (greedy, fixed width, the CPU engine on the GGUF's own weights, 2 threads).
#   shipped  models/smollm2-135m-dflash at the commit before this round (10th round)
#   c2000    the shipped draft continued on 2,000 records for 1.13 epochs (47 steps)    } the data-scaling curve:
#   c8000    ... on 8,000 records for 1.13 epochs (188 steps)                            } same recipe, equal epochs
#   r11      ... on all 30,504 records for 1.13 epochs (715 steps)                       }
#   r11b     r11 continued for 0.55 epochs more at half the learning rate (350 steps)
cd "$(dirname "$0")/../../.." || exit 1
OUT=${OUT:-benchmarks/smollm2-135m-gpu-round2/2026-12-04/heldout-tau.jsonl}
DRAFTS="--draft shipped=${SHIPPED:-models/smollm2-135m-dflash} --draft c2000=runs/gpu2/c2000 --draft c8000=runs/gpu2/c8000
        --draft r11=runs/gpu2/r11 --draft r11b=runs/gpu2/r11b"
run() { .venv/bin/blockdraft heldout-tau --threads 2 --max-new-tokens 96 $DRAFTS --out $OUT "$@" > /dev/null; }
for b in 4 16 8; do
  for set in user-math user-code user-chat; do run --set $set --prompts 12 --block-size $b; done
done
for b in 4 16; do
  run --set regen --prompts 24 --block-size $b
  run --set regen --heldout data/smollm2-regen/heldout-wide.npz --prompts 24 --block-size $b \
      --out ${OUT%.jsonl}-wide-split.jsonl
done
run --set gsm-unseen --prompts 24 --block-size 4
echo done
