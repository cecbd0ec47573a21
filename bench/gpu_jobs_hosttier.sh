#!/usr/bin/env bash
# For the session after the sixteenth GPU session: the new GPU default (two samples per prompt) end to end with the
# features that overflow the GPU cache kept in host memory (train.feature_cache_host_gb, new), and the decoding runs
# the sixteenth session's time cut. Started like the other job scripts,
#   JOBS="bench/gpu_jobs_hosttier.sh" bash bench/gpu_queue.sh SECONDS
# with `.carry` (smolD_regen.tgz: the twelfth session's first answers; samples2_regen.tgz: the sixteenth session's
# second sample) in the carry of the call that starts it, so nothing is regenerated. Poll with no gap over 30 s.
# Its baseline is the sixteenth session's run of the same data, seed and settings: train 1,094 s (147.6k tok/s
# steady, 14,070 of 31,661 sequences recomputed every epoch, features 32% of the step time), eval tau 3.05.
# Budget (1,800 s of device time): start and staging about 130 s; tokenize 130; the feature warm-up about 60 (29M
# tokens at the 556k tok/s of the last one) and 5 epochs over 142M tokens at about 200k tok/s, about 700; eval 60;
# then decoding (about 200 + 80 s), each cut off by its own timeout. About 1,400 s in all.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
run=/tmp/hrun
carried smolD_regen.tgz $run
carried samples2_regen.tgz $run regen/plan-s2.json
# the GPU tests beside the tokenizing (the host tier pinned on CUDA among them)
job gputests timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_features.py tests/test_decode.py &
job pipeline_hosttier python3 -m eyas run --out $run
NO_REGEN_TGZ=1 keep $run hosttier
if [ -d $run/draft ]; then
  # the prefill as one CUDA graph per padded length (the default since the fifteenth session) against the eager
  # prefill (each eager prefill took 28 ms in the sixteenth session, 19% of a K=3 method's time), every other
  # setting at its default (compiled elementwise kernels: the fifteenth session's 1,445.6 tok/s text)
  job decode_sharegpt timeout 300 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3,5,7 --max-new-tokens 256 --budget 12 --skip-hf --prefill 1,0 --out $S/decode_sharegpt.json
  job decode_humaneval timeout 120 python3 bench/bench_decode.py --draft $run/draft --prompts humaneval --limit 40 \
    --k 3,7 --max-new-tokens 256 --budget 10 --skip-hf --out $S/decode_humaneval.json
fi
wait
touch $S/finished_$tag
