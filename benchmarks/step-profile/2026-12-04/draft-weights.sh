#!/bin/bash
# Held-out tau of the shipped default draft with 8-bit and with 4-bit fused weights (the draft's bytes per step
# halve; does acceptance hold?), decode block 4, greedy, the user-* sets. tau does not depend on timing.
cd "$(dirname "$0")/../../.." || exit 1
OUT=benchmarks/step-profile/2026-12-04/draft-weights.jsonl
for w in int8 int4; do
  for set in user-math user-code user-chat; do
    .venv/bin/blockdraft heldout-tau --threads 2 --max-new-tokens 96 --prompts 12 --block-size 4 --set $set \
      --draft shipped=models/smollm2-135m-dflash --draft-weights $w --out $OUT > /dev/null
  done
done
echo done
