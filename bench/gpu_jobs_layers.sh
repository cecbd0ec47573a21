#!/usr/bin/env bash
# The two-layer drafter on one lease. First the training step timed and profiled on the one machine, with the flex
# block masks built as before the thirty-second session (`--masks legacy`: one per layer, each build waiting for
# the device to copy its step number from the host) and as now (`--masks once`: one a TTT step for every layer,
# the step number filled on the device), at two layers and at one (where only the waits differ). That session read
# 126.1k tok/s at two layers with legacy masks and 169.9k at one layer on one machine, then 221.5k at two layers
# with shared masks (still waiting) on another, where the host-timed forward halved; only runs on one machine can
# say how much the masks give. Kernels kept the GPU busy about a third of a step; the profile's host time per op
# says where the rest goes. Then the test that a warmed-up unroll never waits for the device, and run L2
# (bench/gpu_jobs_variant.sh L2 train.draft_layers=2: the one-sample recipe, seed 0, from nothing or on the carried
# .carry/regenD.tgz, its eval, chat decode at K=3 and 7 and the greedy validation prompts).
# Started like the others:
#   call 1: bash .stage/00/unpack.sh ~/eyas-stage
#   call 2: bash .stage/01/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_layers.sh" bash bench/gpu_queue.sh 560
#   polls:  JOBS="bench/gpu_jobs_layers.sh" bash bench/gpu_queue.sh 580 (sent the moment the last one returns)
# (One layer with legacy masks was dropped from the list to fit the lease; the thirty-second session has it.)
# Budget (estimates from the thirty-first and thirty-second sessions): the first profile about 150 s (it converts
# the GGUF and compiles), the other two about 35-120 s each, the test about 60 s; the run about 1,000 s from
# nothing (regen 248 s, training 515 s with legacy masks, less with the new), its decodes about 200 s; with the
# start and staging about 1,700 s.
S=$1; tag=$2
source bench/gpu_lib.sh
for v in "2 once" "2 legacy" "1 once"; do
  set -- $v
  job train_profile_l$1_$2 timeout 300 python3 bench/bench_train.py --conversations 1000 --steps 60 \
    --batch-tokens 8192 --draft-intermediate-size 6144 --draft-layers $1 --masks $2 --profile-steps 5 \
    --out $S/train_profile_l$1_$2.json
done
job test_no_waits timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ttt.py -k never_waits
bash bench/gpu_jobs_variant.sh L2 train.draft_layers=2 "$S" "${tag}_variant"
touch $S/finished_$tag
