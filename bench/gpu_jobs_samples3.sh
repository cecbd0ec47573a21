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
# Budget (1,800 s of device time): start and staging about 100 s; the third sample's regen about 270 (266 s for the
# second); tokenize about 170; the feature warm-up about 95 and 4 epochs about 900 (883 s for 142.1M tokens with the
# host tier); eval 55; then decoding (about 75 + 50 s), each cut off by its own timeout. About 1,650 s in all.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
run=/tmp/s3run
carried smolD_regen.tgz $run
[ -f $run/data/regen/plan-s2.json ] || tar xzf .carry/samples2_regen.tgz -C $run/data
job pipeline_samples3 python3 -m eyas run --out $run --set regen.samples=3 --set train.epochs=4
# the third sample's shards back (about 9 MB), for later sessions: untar into a run's data/regen beside the others
if [ -f $run/data/regen/plan-s3.json ]; then
  (cd $run/data && tar czf $S/samples3_regen.tgz regen/plan-s3.json regen/shard-s3-*)
fi
NO_REGEN_TGZ=1 keep $run samples3
if [ -d $run/draft ]; then
  job decode_sharegpt timeout 200 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3,5,7 --max-new-tokens 256 --budget 12 --skip-hf --out $S/decode_sharegpt.json
  job decode_humaneval timeout 120 python3 bench/bench_decode.py --draft $run/draft --prompts humaneval --limit 40 \
    --k 3,7 --max-new-tokens 256 --budget 10 --skip-hf --out $S/decode_humaneval.json
fi
wait
touch $S/finished_$tag
