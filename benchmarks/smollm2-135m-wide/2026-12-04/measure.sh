#!/bin/bash
# one heldout-tau run per (set, block): both drafts in the same run
cd /work/main
OUT=benchmarks/smollm2-135m-wide/2026-12-04/heldout-tau.jsonl
rm -f $OUT
for set in user-math user-code user-chat; do
  for b in 4 8 16; do
    .venv/bin/blockdraft heldout-tau --set $set --prompts 12 --max-new-tokens 96 --block-size $b --threads 2 \
      --draft shipped=models/smollm2-135m-dflash --draft wide=runs/wide/draft --out $OUT > /dev/null 2>>/tmp/measure.err
  done
done
for b in 4 16; do
  .venv/bin/blockdraft heldout-tau --set regen --prompts 24 --max-new-tokens 96 --block-size $b --threads 2 \
    --draft shipped=models/smollm2-135m-dflash --draft wide=runs/wide/draft --out $OUT > /dev/null 2>>/tmp/measure.err
  .venv/bin/blockdraft heldout-tau --set regen --heldout data/smollm2-regen/heldout-wide.npz --prompts 24 \
    --max-new-tokens 96 --block-size $b --threads 2 \
    --draft shipped=models/smollm2-135m-dflash --draft wide=runs/wide/draft --out ${OUT%.jsonl}-wide-split.jsonl > /dev/null 2>>/tmp/measure.err
done
.venv/bin/blockdraft heldout-tau --set gsm-unseen --prompts 24 --max-new-tokens 96 --block-size 4 --threads 2 \
  --draft shipped=models/smollm2-135m-dflash --draft wide=runs/wide/draft --out $OUT > /dev/null 2>>/tmp/measure.err
echo done
