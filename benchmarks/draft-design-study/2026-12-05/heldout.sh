#!/bin/bash
# held-out tau of every arm and the shipped draft, one heldout-tau run per set (all drafts in it).
# BLOCK (default 4), OUT and WIDE=0 (skip the wide split) let other rounds rerun it at another decode block.
cd "$(dirname "$0")/../../.."  # the repository root
BLOCK=${BLOCK:-4}
OUT=${OUT:-runs/study/heldout-tau.jsonl}
D="--draft shipped=models/smollm2-135m-dflash"
for a in taps2 taps5 taps9 taps9-mix taps9-d1 taps9-mix-d5 graft-same graft-taps9-mix; do
  [ -f runs/study/$a/draft/model.safetensors ] && D="$D --draft $a=runs/study/$a/draft"
done
for set in user-code user-chat user-math; do
  s=$(date +%s)
  .venv/bin/blockdraft heldout-tau --set $set --prompts 12 --max-new-tokens 96 --block-size $BLOCK --threads 2 $D --out $OUT > /dev/null 2>>runs/study/eval.err
  echo "$set $(( $(date +%s)-s )) s"
done
[ "${WIDE:-1}" = 0 ] && exit 0
s=$(date +%s)
.venv/bin/blockdraft heldout-tau --set regen --heldout data/smollm2-regen/heldout-wide.npz --prompts 24 --max-new-tokens 96 \
  --block-size $BLOCK --threads 2 $D --out runs/study/heldout-tau-wide-split.jsonl > /dev/null 2>>runs/study/eval.err
echo "regen $(( $(date +%s)-s )) s"
