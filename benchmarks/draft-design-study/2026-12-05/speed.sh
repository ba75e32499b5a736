#!/bin/bash
# speed of each arm: bench (ar vs dflash, user prompts) and the draft step's cost
cd "$(dirname "$0")/../../.."  # the repository root
mkdir -p runs/study/bench runs/study/profile
for a in shipped graft-same graft-taps9-mix taps2 taps9 taps9-mix taps9-d1 taps9-mix-d5; do
  d=runs/study/$a/draft; [ $a = shipped ] && d=models/smollm2-135m-dflash
  s=$(date +%s)
  .venv/bin/blockdraft bench --draft $d --methods ar,dflash --tasks user-code,user-chat,user-math --n 4 \
    --max-new-tokens 128 --threads 2 --out runs/study/bench/$a > runs/study/bench/$a.log 2>&1
  echo "bench $a rc=$? $(( $(date +%s)-s )) s"
done
for a in shipped taps9 taps9-mix taps9-d1 taps9-mix-d5; do
  d=runs/study/$a/draft; [ $a = shipped ] && d=models/smollm2-135m-dflash
  .venv/bin/blockdraft step-profile --draft $d --parts draft --widths 1,4 --context 200 --threads 2 \
    --out runs/study/profile/$a.json > runs/study/profile/$a.log 2>&1
  echo "profile $a rc=$?"
done
