#!/usr/bin/env bash
# The jobs of a one-GPU session (after the twelfth), one after another so each is timed alone, started by
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
# This session's plan (the thirteenth), in order of what it decides:
# - the twelfth session's regenerated answers, carried in `.carry/smolD_regen.tgz` (8.8 MB), so the pipeline's regen
#   stage finds its shards done and skips 268 s (checked on a CPU: `eyas regen` on them reports 65 of 65 shards done);
# - 7 TTT steps, with the twelfth session's run otherwise unchanged (data.original_rest, 3 epochs): its tau against
#   2.853 at K=3 and 3.662 at K=7 on the norm-1 text, where acceptance at draft positions 5-7 fell to 0.72 / 0.71 /
#   0.54 with 3 steps; with the feature cache at 85% of the free memory (new) all 21.3M tokens should stay on the GPU;
# - decoding at K=3, 5 and 7 with the norms in the reverse order (--norm 1,2): in the twelfth session K=3 ran at
#   3.16 ms a round with the one-kernel norm (run first) and 2.90 with HF's rounding (run second), though
#   profile_round timed the one-kernel round 0.37 ms shorter. The same order effect, or not;
# - last, the GPU tests, if time is left.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
run=/tmp/gpurun
if [ -f .carry/smolD_regen.tgz ] && [ ! -d $run/data/regen ]; then
  mkdir -p $run/data && tar xzf .carry/smolD_regen.tgz -C $run/data
fi
job pipeline_ttt7 python3 -m eyas run --out $run --set data.original_rest=true --set train.ttt_steps=7 \
  --set train.epochs=3
NO_REGEN_TGZ=1 keep $run ttt7
if [ -d $run/draft ]; then
  job decode_sharegpt timeout 400 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3,5,7 --max-new-tokens 256 --budget 40 --skip-hf --norm 1,2 --out $S/decode_sharegpt.json
  job decode_humaneval timeout 300 python3 bench/bench_decode.py --draft $run/draft --prompts humaneval --limit 40 \
    --k 3,5,7 --max-new-tokens 256 --budget 20 --skip-hf --norm 1 --out $S/decode_humaneval.json
fi
[ -z "${SKIP_GPUTESTS:-}" ] && job gputests timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_fastlm.py tests/test_ttt.py tests/test_features.py
touch $S/finished_$tag
