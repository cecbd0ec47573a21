#!/usr/bin/env bash
# For the session after the one that regenerates every ShareGPT turn (bench/gpu_jobs_one.sh, `regen_all`): train and
# decode a drafter on those answers. Started like the other job scripts,
#   JOBS="bench/gpu_jobs_allturns.sh" bash bench/gpu_queue.sh SECONDS
# with the regenerated shards carried in as one file: here, before the first call,
#   cat /work/.device/N/allturns_regen_part*.tgz > .carry/allturns_regen.tgz
# (the pieces of the last poll that returned them; `.carry` is excluded from git) and `.carry` in the carry of the
# call that starts the chain, as for smolD_regen.tgz. With the pieces of an unfinished regen the pipeline's regen stage
# resumes them: the shards that are missing are regenerated first (about 1,000 s for all of them on one H200), so
# check `regen_all.log` of that session for how many were done before counting on the time.
# The plan: `eyas run` with every turn regenerated (regen.turns=0, the same regen settings as `regen_all`, so its plan
# matches and the shards are reused), 3 epochs; then decoding on chat and on HumanEval at K=3,5,7. Compare with the
# sixth session's two-turn drafter (tau 2.97 / 3.85 at K=3 / 7 on 80 chat prompts) and the twelfth's original later
# turns (2.85 / 3.66 on the norm-1 text).
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
run=/tmp/allrun
if [ -f .carry/allturns_regen.tgz ] && [ ! -d $run/data/regen ]; then
  mkdir -p $run/data && tar xzf .carry/allturns_regen.tgz -C $run/data
fi
job pipeline_allturns python3 -m eyas run --out $run --set regen.turns=0 --set train.epochs=3
NO_REGEN_TGZ=1 keep $run allturns
if [ -d $run/draft ]; then
  job decode_sharegpt timeout 400 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3,5,7 --max-new-tokens 256 --budget 30 --skip-hf --norm 2,1 --out $S/decode_sharegpt.json
  job decode_humaneval timeout 300 python3 bench/bench_decode.py --draft $run/draft --prompts humaneval --limit 40 \
    --k 3,5,7 --max-new-tokens 256 --budget 20 --skip-hf --out $S/decode_humaneval.json
fi
touch $S/finished_$tag
