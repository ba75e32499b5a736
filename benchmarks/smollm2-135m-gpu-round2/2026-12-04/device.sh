#!/bin/bash
# carried to the device: stash what this call carries (GGUF parts, the draft to continue, prompts); then
#   main:  regenerate the unanswered wide prompts and continue the draft on every answer
#   curve: the same continuation on 2k / 8k records at the main run's epochs (a data-scaling curve)
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
mkdir -p /tmp/bd-stash
for p in part-a part-b prompts-rest.npz prompts-heldout.npz init-draft; do [ -e gpu/$p ] && cp -r gpu/$p /tmp/bd-stash/; done
ls -la /tmp/bd-stash /tmp/bd-stash/init-draft 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site
G=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
S=/tmp/bd-stash
if [ "$1" = "main" ] || [ "$1" = "curve" ]; then
  [ -f $G ] || cat $S/part-a $S/part-b > $G
  echo "$(cut -d' ' -f1 gpu/gguf.sha256)  $G" | sha256sum -c || exit 1
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
if [ "$1" = "main" ]; then
  timeout ${ROUND_TIMEOUT:-560} python3 recipes/smollm2-135m-dflash-gpu.py --gguf $G --prompts $S/prompts-rest.npz \
    --heldout-prompts $S/prompts-heldout.npz --heldout-answers false --check-prompts 2 \
    --existing 'data/smollm2-regen/train-*.npz' --init $S/init-draft --out $OUT --work /tmp/round \
    --gen-seconds ${GEN_SECONDS:-200} --train-minutes ${TRAIN_MINUTES:-3.5} --lr ${LR:-3e-4} --warmup 50 \
    --batch-size ${BATCH:-4096} --max-len 672 --split-draft
  rm -f $OUT/draft/copy_gate.safetensors  # frozen: the same as the continued draft's
elif [ "$1" = "curve" ]; then
  timeout ${ROUND_TIMEOUT:-300} python3 recipes/smollm2-135m-dflash-gpu.py --gguf $G --gen-seconds 0 \
    --heldout-prompts $S/prompts-heldout.npz --check-prompts 0 \
    --existing 'data/smollm2-regen/train-*.npz,/tmp/round/regen-train-*.npz' --init $S/init-draft --out $OUT \
    --work /tmp/curve --sizes ${SIZES:-2000,8000} --epochs ${EPOCHS:-1.0} --lr ${LR:-3e-4} --warmup 50 \
    --max-len 672 --split-draft
  rm -f $OUT/draft-*/copy_gate.safetensors
else
  echo "stashed: $(ls $S)"
fi
