#!/usr/bin/env bash
# The jobs of a one-GPU session (after the thirteenth; the plan below says which run side by side), started by
#   JOBS="bench/gpu_jobs_one.sh" bash bench/gpu_queue.sh SECONDS   (once SmolLM2 and the data are staged)
# with `.carry` (regenerated answers of an earlier session, smolD_regen.tgz) in the carry of the call that starts it.
# Poll with no gap over 30 s: a polling call's wait is the only time the machine is safe. Read each result in a
# bash call placed in the same batch as the next poll, never between them; write no code between polls (the ninth
# and tenth sessions lost their machines to gaps of 80 s and 2 minutes; the eleventh, polling so, lost nothing).
# To restart on a new machine, kill an old chain with an anchored pattern, `pkill -f "^bash bench/gpu_"`, then
# `rm -rf /tmp/gq`: a pattern the call's own command line contains kills the harness running it (`pkill -f
# gpu_jobs_one`, `pkill python3` and `pkill -f "^timeout "` all did, in the tenth session).
# Durations seen (twelfth session): staging 52 s; the pipeline with data.original_rest and 3 epochs 988 s (regen 268,
# tokenize 100, train 529, eval 46; GPU tests and speculators' warm-up beside it); train_eyas 129 s (85 s of it
# compiling the loss, cold); train_eyas_eager 36 s; spec_default 91 s once warm; train_eyas_profile 44 s;
# decode_sharegpt with --norm 2,1 and transformers 272 s; decode_humaneval 40 s; profile_round 34 s.
# Thirteenth session: staging 3 pieces and the carried answers, then pipeline_ttt7 916 s (regen 4 s from the carried
# shards, tokenize 78, train 746, eval 50), decode_sharegpt with K=3,5,7 and two norms 168 s, HumanEval 53 s, GPU tests
# 54 s.
# The next session's plan, two chains side by side on the one GPU (so their speeds are not figures to report):
# - every turn of ShareGPT regenerated (regen.turns=0) into /tmp/allturns, cut off after 1,000 s if not done (its
#   shards are written whole as they finish, so the session after resumes from them): the data that should lift tau
#   most (two regenerated turns gave 3.02 against 2.88 in the sixth session's eval). Its shards come back as
#   allturns_regen_partN.tgz, pieces of one tgz under the 16 MiB a file: `cat allturns_regen_part*.tgz > x.tgz`;
# - beside it, the twelfth session's run for 5 epochs instead of 3 (6 would not leave time to decode) (3 TTT steps, data.original_rest, the carried
#   first answers), with the feature cache set to 90 GB so both fit: does a second pass of 3 epochs still add
#   (validation step-0 accuracy 0.646 after 3)? Then decoding once the regen is done, with a trained drafter the
#   first time with and without the overlapped loop (Decoder.overlap: -0.59 ms a round with an untrained drafter, a
#   figure this session found confounded by run order),
#   then with the target's elementwise work compiled (Decoder.compile_elementwise, about 7 kernels fewer a layer).
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
( job regen_all timeout 1000 python3 -m eyas regen --out /tmp/allturns --set regen.limit=20000 --set regen.turns=0
  if [ -d /tmp/allturns/data/regen ]; then
    tar czf /tmp/allturns_regen.tgz -C /tmp/allturns/data regen && split -b 15M -d -a 1 /tmp/allturns_regen.tgz \
      $S/allturns_regen_part && for f in $S/allturns_regen_part?; do mv $f $f.tgz; done
    ls -l $S/allturns_regen_part* >> $S/regen_all.log
  fi ) &
regen_pid=$!
run=/tmp/gpurun
if [ -f .carry/smolD_regen.tgz ] && [ ! -d $run/data/regen ]; then
  mkdir -p $run/data && tar xzf .carry/smolD_regen.tgz -C $run/data
fi
sleep 30  # the regen's KV cache is allocated before the training's feature cache measures what is free
job pipeline_e5 python3 -m eyas run --out $run --set data.original_rest=true --set train.epochs=5 \
  --set train.feature_cache_gb=90
NO_REGEN_TGZ=1 keep $run e5
wait $regen_pid
if [ -d $run/draft ]; then
  job decode_sharegpt timeout 400 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3,5,7 --max-new-tokens 256 --budget 30 --skip-hf --overlap 1,0 --out $S/decode_sharegpt.json
  job decode_ew timeout 300 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3 --max-new-tokens 256 --budget 25 --skip-hf --ew 0,1 --out $S/decode_ew.json
fi
job profile_round timeout 150 python3 bench/profile_round.py --parts 0 --overlap 1,0 --out $S/round.json
touch $S/finished_$tag
