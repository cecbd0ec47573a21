#!/usr/bin/env bash
# For the session after the one that regenerated ShareGPT's turns (bench/gpu_jobs_one.sh, `regen_all`): finish that
# regen, then train and decode a drafter on every turn's answers. Started like the other job scripts,
#   JOBS="bench/gpu_jobs_allturns.sh" bash bench/gpu_queue.sh SECONDS
# with the regenerated shards carried in as one file: here, before the first call,
#   cat /work/.device/N/allturns_regen_part*.tgz > .carry/allturns_regen.tgz
# (the pieces of the last poll that returned them; `.carry` is excluded from git) and `.carry` in the carry of the
# call that starts the chain, as for smolD_regen.tgz. The pipeline's regen stage resumes them: the fourteenth session
# left 36 of 65 shards whole (10,237 of 16,539 conversations in 1,000 s beside a training run), so about 7,400
# conversations are left, about 530 s alone (checked on the CPU: `eyas regen --set regen.limit=20000 --set
# regen.turns=0` on those shards says "resuming, 36 of 65 shards already done").
# Budget (1,800 s of device time): staging about 120 s; regen about 530; tokenize 90; the feature cache's fill 50;
# 5 epochs about 650 (the fourteenth session's last epoch, alone with most features cached, ran 158.8k tok/s);
# eval 45; then decoding, most important first, each cut off by its own timeout.
# The comparison: the fourteenth session's 5-epoch drafter on first answers plus the original later turns
# (data.original_rest): eval tau 3.03; on 80 chat prompts (12,332 tokens, eager elementwise) tau 2.867 / 3.471 /
# 3.703 at K=3 / 5 / 7. The decoding here runs with the compiled elementwise kernels (the default since then), whose
# text differs (12,648 tokens; tau 2.928 at K=3 for that drafter), so compare on `--ew 0` too if time allows
# (decode_order's K=3 is on the eager text). The pipeline's eval decodes with the compiled kernels too, so its tau is
# on other text than the fourteenth session's eval (3.03).
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
run=/tmp/allrun
if [ -f .carry/allturns_regen.tgz ] && [ ! -d $run/data/regen ]; then
  mkdir -p $run/data && tar xzf .carry/allturns_regen.tgz -C $run/data
fi
# the GPU tests beside the regeneration (correctness only; the new one: Decoder.warm_up leaves no graph to capture)
job gputests timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode.py tests/test_fastlm.py &
job pipeline_allturns python3 -m eyas run --out $run --set regen.turns=0 --set regen.limit=20000 --set train.epochs=5
# every shard back, in pieces under the 16 MiB a returned file may have: `cat allturns_full_part*.tgz > x.tgz`
if [ -f $run/data/regen/plan.json ]; then
  tar czf /tmp/allturns_full.tgz -C $run/data regen && split -b 15M -d -a 1 /tmp/allturns_full.tgz $S/allturns_full_part \
    && for f in $S/allturns_full_part?; do mv $f $f.tgz; done
fi
NO_REGEN_TGZ=1 keep $run allturns
if [ -d $run/draft ]; then
  job decode_sharegpt timeout 200 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3,5,7 --max-new-tokens 256 --budget 15 --skip-hf --out $S/decode_sharegpt.json
  job decode_humaneval timeout 120 python3 bench/bench_decode.py --draft $run/draft --prompts humaneval --limit 40 \
    --k 3,7 --max-new-tokens 256 --budget 10 --skip-hf --out $S/decode_humaneval.json
  # the warm-up (Decoder.warm_up) should leave no order effect: overlap off first this time, against the
  # fourteenth session's `--overlap 1,0`, where the first speculative method ran 1.46 s slower
  job decode_order timeout 150 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3 --max-new-tokens 256 --budget 12 --skip-hf --overlap 0,1 --ew 0 --out $S/decode_order.json
fi
wait
touch $S/finished_$tag
