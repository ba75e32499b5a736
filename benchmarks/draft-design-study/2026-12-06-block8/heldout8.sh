#!/bin/bash
# held-out tau of every arm and the shipped draft at decode block 8 (the arms trained on blocks of 4), one
# heldout-tau run per user set (all drafts in it)
cd "$(dirname "$0")/../../.."  # the repository root
OUT=benchmarks/draft-design-study/2026-12-06-block8/heldout-tau-block8.jsonl
D="--draft shipped=models/smollm2-135m-dflash"
for a in taps2 taps5 taps9 taps9-mix taps9-d1 taps9-mix-d5 graft-same graft-taps9-mix; do
  [ -f runs/study/$a/draft/model.safetensors ] && D="$D --draft $a=runs/study/$a/draft"
done
for set in user-code user-chat user-math; do
  s=$(date +%s)
  .venv/bin/blockdraft heldout-tau --set $set --prompts 12 --max-new-tokens 96 --block-size 8 --threads 2 $D --out $OUT > /dev/null 2>>runs/study/eval.err
  echo "$set $(( $(date +%s)-s )) s"
done
