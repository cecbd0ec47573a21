#!/usr/bin/env bash
# The two-layer drafter on one lease. First the training step timed and profiled on the one machine: two layers
# sharing each TTT step's flex block mask (the default since the thirty-second session), two layers building their
# own (as before), one layer. That session read 126.1k tok/s at two layers building their own masks and 169.9k at
# one layer on one machine, then 221.5k at two layers sharing them on another, where the host-timed forward
# halved; only runs on one machine can say how much of that the masks gave. Kernels kept the GPU busy about a
# third of a step, so the profile's host time per op says where the rest goes. Then run L2
# (bench/gpu_jobs_variant.sh L2 train.draft_layers=2: the one-sample recipe, seed 0, from nothing or on the carried
# .carry/regenD.tgz, its eval, chat decode at K=3 and 7 and the greedy validation prompts).
# Started like the others:
#   call 1: bash .stage/00/unpack.sh ~/eyas-stage
#   call 2: bash .stage/01/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_layers.sh" bash bench/gpu_queue.sh 560
#   polls:  JOBS="bench/gpu_jobs_layers.sh" bash bench/gpu_queue.sh 580 (sent the moment the last one returns)
# Budget (estimates from the thirty-first and thirty-second sessions): the first profile about 150 s (it converts
# the GGUF and compiles), the others about 90-120 s each (four in all); the run about 1,000 s from nothing (regen 248 s, training
# 515 s with masks per layer, less if sharing them is faster), its decodes about 200 s; with the start and staging
# about 1,600 s.
S=$1; tag=$2
source bench/gpu_lib.sh
for v in "2 1" "2 0" "1 1"; do
  set -- $v
  job train_profile_l$1_share$2 timeout 300 python3 bench/bench_train.py --conversations 1000 --steps 60 \
    --batch-tokens 8192 --draft-intermediate-size 6144 --draft-layers $1 --share-masks $2 --profile-steps 5 \
    --out $S/train_profile_l$1_share$2.json
done
# which lines make the host wait (the profile counted 3 stream syncs and 1 event sync a two-layer step)
job train_syncs_l1 timeout 300 python3 bench/bench_train.py --conversations 1000 --steps 60 --batch-tokens 8192 \
  --draft-intermediate-size 6144 --sync-debug --out $S/train_syncs_l1.json
bash bench/gpu_jobs_variant.sh L2 train.draft_layers=2 "$S" "${tag}_variant"
touch $S/finished_$tag
