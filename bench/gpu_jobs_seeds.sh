#!/usr/bin/env bash
# The spread between training seeds on the H200: the yardstick the single-run comparisons have lacked. Started like
# the other job scripts, after the stage's two pieces (call 1 `bash .stage/00/unpack.sh ~/eyas-stage`, call 2
# `bash .stage/01/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_seeds.sh" bash bench/gpu_queue.sh 540`), polled at
# once after each return (the machine goes back 30 s after a call when no other follows, and 30 minutes after it
# started):
#   JOBS="bench/gpu_jobs_seeds.sh" bash bench/gpu_queue.sh 540
# 1. Run D from nothing: one sample, 3 epochs, the defaults otherwise (decay 0.8, seed 0). The twenty-seventh session
#    repeated the twenty-second's run B with it to the last digit (eval tau 2.979, val_tau 2.441, chat 2.878 / 3.682
#    at K=3 / 7), so seed 0's figures are known; D is run for the data the others copy.
# 2. Runs S1 and S2 on D's copied data with train.seed 1 and 2: other initial weights and batch orders, the same
#    data, validation split and eval text. Their spread says whether the 0.015-0.05 differences measured between
#    settings (lr 2e-3, batch 4,096, decay 0.6 and 0.8, loss on every position) are the settings or the seed.
#    Each run also reports greedy_tau (train.greedy_val, new in the twenty-seventh session: the chain simulated on the
#    target's greedy answers to 256 validation prompts), to set beside the eval's tau on the first answers.
# 3. The three drafters on the chat prompts' first turns, K=3 and 7, plain decoding beside them.
# Budget: start and staging 190-350 s; 1. about 640 s; 2. about 340 s each; 3. about 60 s each.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
data_runs "--set regen.samples=1 --set train.epochs=3" D="" S1="--set train.seed=1" S2="--set train.seed=2"
decode_runs D=/tmp/rD S1=/tmp/rS1 S2=/tmp/rS2
wait
touch $S/finished_$tag
