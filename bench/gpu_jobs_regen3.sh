#!/usr/bin/env bash
# A lease too short to train (forty-sixth session: seven refused starts had left 1,169 s): regenerate the three
# samples of every first answer that the three-sample recipes train on (about 723 s, fortieth session) and send them
# back, so that a later lease carries them and spends its time on training (L3S3 at 5-6 epochs, about 1,000 s of job
# with the samples carried, an estimate) instead of regenerating. Stopped once the run's regen stage is done
# (regen_only), so the samples are those `eyas run --set regen.samples=3` would make. Back as regenS123.partN.tgz
# (`cat regenS123.part*.tgz > .carry/regenS123.tgz`, which gpu_jobs_l2s3.sh prefers). PROFILES=1 then runs
# bench/gpu_profiles.sh (a training step's and the regen engine's GPU time) into $S/prof, as time allows.
#   call 1:  bash .stage/00/unpack.sh ~/eyas-stage
#   call 2:  bash .stage/01/unpack.sh ~/eyas-stage && PROFILES=1 JOBS=bench/gpu_jobs_regen3.sh bash bench/gpu_queue.sh 560
# FLEX_AB=1 adds flex_ab (gpu_lib.sh) before the profiles; the forty-seventh session measured no gain from it.
#   polls:   the same JOBS with gpu_queue.sh 575, sent the moment the last returns
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
run=/tmp/rS3
regen_only regen_s3 $run --set regen.samples=3 --set train.draft_layers=3
cp $run/data/regen/report.json $S/regen_s3_report.json 2>/dev/null
pieces regenS123 $run/data regen
[ -n "${FLEX_AB:-}" ] && flex_ab  # gpu_lib.sh: regen's decode steps through flex attention against SDPA
[ -n "${PROFILES:-}" ] && OUT=$S/prof bash bench/gpu_profiles.sh > $S/profiles.log 2>&1
touch $S/finished_$tag
