#!/usr/bin/env bash
# For the session after the fifteenth GPU session: does a second sampled answer per prompt lift tau? Started like the
# other job scripts,
#   JOBS="bench/gpu_jobs_samples.sh" bash bench/gpu_queue.sh SECONDS
# with `.carry` (smolD_regen.tgz: the twelfth session's first answers, the first sample) in the carry of the call
# that starts it. Poll with no gap over 30 s, as gpu_jobs_one.sh says.
# The run is the GPU default since the fifteenth session (first answers regenerated, each conversation's original
# later turns after them, 5 epochs, the SmolLM2 drafter MLP 6,144) with one change, regen.samples=2: every first
# answer sampled a second time with its own seed (about 16,200 more answers, 5M more answer tokens; the original later
# turns follow the first sample only). Its baseline is the fourteenth session's drafter, the same recipe with one
# sample: tau 2.867 / 3.471 / 3.703 at K=3 / 5 / 7 on 80 chat prompts with the eager kernels (12,332 tokens), so the
# chat decoding here runs with --ew 0 on that same text.
# Budget (1,800 s of device time): start and staging about 130 s; the second sample's regen about 270 (the first
# sample's took 268 s in the twelfth session); tokenize 110; 5 epochs over about 27M tokens about 750 (the fifteenth
# session trained 100.5M tokens in 585 s with every feature cached; here about 125 GB of features against a cache of
# about 108, so some are recomputed); eval 45 (its warm-up now also captures a prefill graph per 128 tokens of its
# 4,096-slot cache); then decoding (about 80 + 70 + 45 s), each cut off by its own timeout.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
run=/tmp/srun
carried smolD_regen.tgz $run
# the GPU tests beside the regeneration (correctness only)
job gputests timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode.py tests/test_regen.py &
job pipeline_samples2 python3 -m eyas run --out $run --set regen.samples=2
# the second sample's shards back (about 9 MB), for later sessions: untar into a run's data/regen beside the first
if [ -f $run/data/regen/plan-s2.json ]; then
  (cd $run/data && tar czf $S/samples2_regen.tgz regen/plan-s2.json regen/shard-s2-*)
fi
NO_REGEN_TGZ=1 keep $run samples2
if [ -d $run/draft ]; then
  # tau on the fourteenth session's text: its kernels (eager elementwise) and its prefill (unpadded: a padded
  # prefill's products have other shapes, so bf16 can round the prompt's states differently)
  job decode_sharegpt timeout 200 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3,5,7 --max-new-tokens 256 --budget 15 --skip-hf --ew 0 --prefill 0 --out $S/decode_sharegpt.json
  # the prefill as one CUDA graph per padded length (Decoder.graph_prefill, new) against the eager prefill, with
  # the other defaults: each prompt's prefill took 18-23 ms in the fifteenth session, 12-19% of a K=3-5 method's time
  job decode_prefill timeout 150 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3,5 --max-new-tokens 256 --budget 12 --skip-hf --prefill 0,1 --out $S/decode_prefill.json
  job decode_humaneval timeout 120 python3 bench/bench_decode.py --draft $run/draft --prompts humaneval --limit 40 \
    --k 3,7 --max-new-tokens 256 --budget 10 --skip-hf --out $S/decode_humaneval.json
fi
wait
touch $S/finished_$tag
