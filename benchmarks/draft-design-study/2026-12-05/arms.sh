#!/bin/bash
# from-scratch arms, then grafts onto the shipped draft; each arm its own out dir; resumable by skipping finished arms
cd "$(dirname "$0")/../../.."  # the repository root
R=recipes/smollm2-135m-design-study.yaml
T2=1,27; T5=1,8,15,22,27; T9=1,4,8,11,15,18,22,25,27
arm() { name=$1; shift
  if [ -f runs/study/$name/draft/model.safetensors ]; then echo "skip $name"; return; fi
  s=$(date +%s)
  .venv/bin/blockdraft train --config $R --out-dir runs/study/$name "$@" > runs/study/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s)-s )) s"
}
mkdir -p runs/study
arm taps2 --layer-ids $T2 --steps 480
arm taps5 --layer-ids $T5 --steps 480
arm taps9 --layer-ids $T9 --steps 480
arm taps9-mix --layer-ids $T9 --layer-mix true --steps 480
arm taps9-d1 --layer-ids $T9 --num-layers 1 --steps 700
arm taps9-mix-d5 --layer-ids $T9 --num-layers 5 --layer-mix true --steps 360
G="--init models/smollm2-135m-dflash --lr 1.5e-4 --warmup 50 --steps 680 --minutes 10"
arm graft-same --layer-ids $T2 $G
arm graft-taps9-mix --layer-ids $T9 --layer-mix true $G
echo arms done
