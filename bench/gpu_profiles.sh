#!/usr/bin/env bash
# Where the lease's two long stages spend the GPU's time, for a lease too short for a training run (forty-sixth
# session: four refused starts had left 1,439 s): a three-layer training step as the τ runs train it (8,192-token
# batches, MLP 6,144, CUDA graph; kernels by time over 5 profiled steps) and the regeneration engine at the pipeline's
# 512 rows and 512 new tokens (one decode step by attended span, and a whole run's modelled against measured time).
# After the last staging piece, in one call:
#   bash .stage/01/unpack.sh ~/eyas-stage && bash bench/gpu_profiles.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site ~/eyas-stage/wheels/*.whl 2>&1 | tail -1
source bench/gpu_lib.sh  # the jobs' environment (EYAS_STAGE_DIR, PYTHONPATH with the wheels)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
t=$(date +%s)
timeout ${TRAIN_S:-280} python3 bench/bench_train.py --out "$OUT/train_prof.json" --conversations 1500 --steps 120 \
  --batch-tokens 8192 --draft-layers 3 --draft-intermediate-size 6144 --profile-steps 5 > "$OUT/train_prof.log" 2>&1
echo "train profile rc=$? $(( $(date +%s) - t ))s"
t=$(date +%s)
timeout ${REGEN_S:-200} python3 bench/profile_regen.py --prompts 2048 --batch-size 512 --max-new-tokens 512 \
  --max-prompt-tokens 2048 --out "$OUT/regen_prof.json" > "$OUT/regen_prof.log" 2>&1
echo "regen profile rc=$? $(( $(date +%s) - t ))s"
for f in train_prof regen_prof; do echo "== $f"; tr '\r' '\n' < "$OUT/$f.log" | grep -v '^\s*$' | tail -8; done
