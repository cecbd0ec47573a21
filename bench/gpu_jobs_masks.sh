#!/usr/bin/env bash
# The flex block masks timed on one machine, alternating, without the profiler: a drafter trained with
# the masks built once a TTT step (`--masks once`, the thirty-second session's) and made once a batch from the
# documents' bounds with the earlier steps' cut from it (`--masks derive`, the thirty-fourth session's default), at
# one decoder layer (the default) and at two; then the CUDA mask cost and the GPU tests that a warmed-up unroll never
# waits for the device (now with the made and cut masks). The thirty-fourth session ran this for legacy against once
# at two layers (legacy first): 134.7k / 116.2k / 123.4k against 148.2k / 160.2k / 178.2k tok/s steady, once ahead
# in all three pairs. Order here, PAIRS times (default 2): once and derive at one layer, then at two. Started like
# the others, or after another chain with the time left:
#   calls 1..n-1: bash .stage/NN/unpack.sh ~/eyas-stage
#   call n:       bash .stage/NN/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_masks.sh" bash bench/gpu_queue.sh 540
# Budget: the first run about 70-110 s (it converts the GGUF and compiles), each other about 50 s, the cost and the
# tests about 110 s: about 560 s with 2 pairs (PAIRS=1: about 330 s). LAYERS (default "1 2") picks the layer counts
# and NO_TESTS=1 skips the cost and the tests, for a lease's last minutes:
#   NO_TESTS=1 LAYERS=1 JOBS="bench/gpu_jobs_masks.sh" bash bench/gpu_queue.sh 380   (about 300 s with 2 pairs)
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
i=0
for _ in $(seq ${PAIRS:-2}); do
  for layers in ${LAYERS:-1 2}; do
    for m in once derive; do
      i=$((i+1))
      job train_masks_${i}_${m}_L$layers timeout 200 python3 bench/bench_train.py --conversations 1000 --steps 100 \
        --batch-tokens 8192 --draft-intermediate-size 6144 --draft-layers $layers --masks $m \
        --out $S/train_masks_${i}_${m}_L$layers.json
    done
  done
done
if [ -z "${NO_TESTS:-}" ]; then
  job mask_cost timeout 120 python3 bench/mask_build_cost.py --tokens 8192 --device cuda
  flex_tests
fi
touch $S/finished_$tag
