#!/usr/bin/env bash
# For the session after the seventeenth GPU session: more samples at the same training compute. Started like the
# other job scripts,
#   JOBS="bench/gpu_jobs_samples3.sh" bash bench/gpu_queue.sh SECONDS
# with `.carry` (smolD_regen.tgz: the first sample; samples2_regen.tgz: the second) in the carry of the call that
# starts it. Poll with no gap over 30 s.
# The run is the GPU default (two samples, original later turns, 5 epochs: 142.1M tokens trained, eval tau 3.056,
# seventeenth session) with a third sample of every first answer and 4 epochs instead of 5, so about as many tokens
# are trained on (about 37M tokens a pass, about 148M in all): if tau rises, the samples' other contexts are what
# helps, not a longer schedule, and three samples with 4 epochs costs only the third regeneration more. The decoding
# repeats the seventeenth session's commands, so its text (the compiled kernels' and the padded prefill's) is the same
# and the drafters compare on it (check: the plain outputs equal).
# Then the training step's host side (bench_train, 60 steps each: as before, statistics read late, compiled drafter
# step). HumanEval is left out this time (the seventeenth session measured this recipe's drafter there).
# Budget (1,800 s of device time): start and staging about 100 s; the third sample's regen about 270 (266 s for the
# second); tokenize about 40 (about 170 in one process; now a worker per core: data.tokenize_workers); the feature
# warm-up about 95 and 4 epochs about 900 (883 s for 142.1M tokens with the host tier); eval 55; chat decoding with
# and without the compiled drafter about 130; the training runs about 40 + 40 + 110 (compiling) + 30. Each job is
# cut off by its own timeout. About 1,750 s in all: the last poll is sized to what is left.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
run=/tmp/s3run
carried smolD_regen.tgz $run
carried samples2_regen.tgz $run regen/plan-s2.json
job pipeline_samples3 python3 -m eyas run --out $run --set regen.samples=3 --set train.epochs=4
# the third sample's shards back (about 9 MB), for later sessions: untar into a run's data/regen beside the others
if [ -f $run/data/regen/plan-s3.json ]; then
  (cd $run/data && tar czf $S/samples3_regen.tgz regen/plan-s3.json regen/shard-s3-*)
fi
NO_REGEN_TGZ=1 keep $run samples3
if [ -d $run/draft ]; then
  # and the drafter's steps compiled (Decoder.compile_drafter, new, off until this measures it) against eager: the
  # _dc1 methods (their plain baseline is the same code as the default's)
  job decode_sharegpt timeout 240 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3,5,7 --max-new-tokens 256 --budget 10 --skip-hf --draft-compile 0,1 --out $S/decode_sharegpt.json
fi
# the training step's host side, the pipeline's batch and drafter shape, one after the other (the seventeenth
# session's default run: forward 24.3 ms and backward 11.7 ms a step, 61% and 29% of the step time): the step as
# before (statistics read at its end, so the host waits for the device every step); the statistics read a step
# later (eyas.train.LAG_STATS, new, the default); and the drafter's step compiled in two parts around the attention
# on top (eyas.ttt.DRAFTER_COMPILE, new, off until this measures it). Then where the host still waits (sync debug).
bt="--conversations 1000 --steps 60 --batch-tokens 8192 --draft-intermediate-size 6144"
job train_sync timeout 150 python3 bench/bench_train.py $bt --drafter-compile 0 --lag-stats 0 --workdir /tmp/bt0 \
  --out $S/train_sync.json
job train_lag timeout 150 python3 bench/bench_train.py $bt --drafter-compile 0 --workdir /tmp/bt1 --out $S/train_lag.json
job train_compiled timeout 240 python3 bench/bench_train.py $bt --drafter-compile 1 --workdir /tmp/bt2 \
  --out $S/train_compiled.json
job train_waits timeout 150 python3 bench/bench_train.py --conversations 1000 --steps 20 --batch-tokens 8192 \
  --draft-intermediate-size 6144 --sync-debug --workdir /tmp/bt3 --out $S/train_waits.json
wait
touch $S/finished_$tag
