#!/usr/bin/env bash
# The two-layer drafter on one lease: run L2 (bench/gpu_jobs_variant.sh L2 train.draft_layers=2: the one-sample
# recipe, seed 0, from nothing or on the carried .carry/regenD.tgz, its eval, chat decode at K=3 and 7 and the greedy
# validation prompts), then the training step profiled at two layers and at one (the thirty-second session
# measured 1.35× one layer's time on one machine, as the layer's arithmetic predicts; these runs repeat it with the
# host's time per op, since kernels kept the GPU busy only about a third of a step).
# Started like the others:
#   call 1: bash .stage/00/unpack.sh ~/eyas-stage
#   call 2: bash .stage/01/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_layers.sh" bash bench/gpu_queue.sh 560
#   polls:  JOBS="bench/gpu_jobs_layers.sh" bash bench/gpu_queue.sh 580 (sent the moment the last one returns)
# Budget (estimates from the thirty-first session): the run about 870 s from nothing (regen 260, train about 560),
# its decodes about 200 s, each profile about 90 s; with the start and staging about 1,500 s.
S=$1; tag=$2
bash bench/gpu_jobs_variant.sh L2 train.draft_layers=2 "$S" "${tag}_variant"
source bench/gpu_lib.sh
for n in 2 1; do
  job train_profile_l$n timeout 300 python3 bench/bench_train.py --conversations 1000 --steps 60 --batch-tokens 8192 \
    --draft-intermediate-size 6144 --draft-layers $n --profile-steps 5 --out $S/train_profile_l$n.json
done
touch $S/finished_$tag
