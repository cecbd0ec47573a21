#!/usr/bin/env bash
# The flex block masks timed on one machine, alternating, without the profiler: a two-layer drafter trained with
# the masks as before the thirty-second session (`--masks legacy`: one per layer, each build waiting for the device
# to copy its step number from the host) and as now (`--masks once`: one a TTT step for both layers, no wait).
# The thirty-third session's single pair (once first, on a cold machine, then legacy) read 245.4k against 201.2k
# tok/s steady, but the same setting has spread 194-275k in one call before, so one pair cannot tell; the order
# here is legacy (cold) once legacy once legacy once. Started like the others:
#   call 1: bash .stage/00/unpack.sh ~/eyas-stage
#   call 2: bash .stage/01/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_masks.sh" bash bench/gpu_queue.sh 420
# Budget: the first run about 110 s (it converts the GGUF and compiles), each other about 40 s.
S=$1; tag=$2
source bench/gpu_lib.sh
i=0
for m in legacy once legacy once legacy once; do
  i=$((i+1))
  job train_masks_${i}_$m timeout 200 python3 bench/bench_train.py --conversations 1000 --steps 100 \
    --batch-tokens 8192 --draft-intermediate-size 6144 --draft-layers 2 --masks $m --out $S/train_masks_${i}_$m.json
done
touch $S/finished_$tag
