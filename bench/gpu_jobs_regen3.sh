#!/usr/bin/env bash
# A lease too short to train (forty-sixth session: seven refused starts had left 1,169 s): regenerate the three
# samples of every first answer that the three-sample recipes train on (about 723 s, fortieth session) and send them
# back, so that a later lease carries them and spends its time on training (L3S3 at 5-6 epochs, about 1,000 s of job
# with the samples carried, an estimate) instead of regenerating. Stopped once the run's regen stage is done
# (regen_only), so the samples are those `eyas run --set regen.samples=3` would make. Back as regenS123.partN.tgz
# (`cat regenS123.part*.tgz > .carry/regenS123.tgz`, which gpu_jobs_l2s3.sh prefers). PROFILES=1 then runs
# bench/gpu_profiles.sh (a training step's and the regen engine's GPU time) into $S/prof, as time allows.
#   call 1:  bash .stage/00/unpack.sh ~/eyas-stage
#   call 2:  bash .stage/01/unpack.sh ~/eyas-stage && FLEX_AB=1 PROFILES=1 JOBS=bench/gpu_jobs_regen3.sh bash bench/gpu_queue.sh 560
#   polls:   the same JOBS with gpu_queue.sh 575, sent the moment the last returns
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
run=/tmp/rS3
regen_only regen_s3 $run --set regen.samples=3 --set train.draft_layers=3
cp $run/data/regen/report.json $S/regen_s3_report.json 2>/dev/null
pieces regenS123 $run/data regen
# FLEX_AB=1: the regen engine's decode steps through flex attention bounded by each row's own position (FastLM's
# flex_decode, forty-seventh session) against SDPA over the longest row's span, each twice in turn (the untimed
# warm-up compiles flex), after the GPU test that the flex step's graph picks SDPA's tokens (about 200 s in all)
[ -n "${FLEX_AB:-}" ] && job test_flex_decode timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_fastlm.py -k flex_decode
[ -n "${FLEX_AB:-}" ] && job regen_flex timeout 420 python3 bench/bench_regen.py --prompts 1024 --batch-size 512 \
  --max-new-tokens 512 --max-prompt-tokens 2048 --baseline-batches 0 --engine static:flex=1,static,static:flex=1,static \
  --out $S/regen_flex.json
[ -n "${PROFILES:-}" ] && OUT=$S/prof bash bench/gpu_profiles.sh > $S/profiles.log 2>&1
touch $S/finished_$tag
