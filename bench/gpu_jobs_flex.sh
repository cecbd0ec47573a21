#!/usr/bin/env bash
# A lease too short for the three samples' regeneration (about 800 s of job, gpu_jobs_regen3.sh): measure what would
# make regeneration faster instead. The regen engine's decode steps through flex attention bounded by each row's own
# position against SDPA over the longest row's span (flex_ab, gpu_lib.sh, about 200 s), then, as time allows, where a
# three-layer training step's and the 512-row regen step's GPU time go (bench/gpu_profiles.sh into $S/prof, about
# 500 s).
#   call 1:  bash .stage/00/unpack.sh ~/eyas-stage
#   call 2:  bash .stage/01/unpack.sh ~/eyas-stage && JOBS=bench/gpu_jobs_flex.sh bash bench/gpu_queue.sh 560
#   polls:   the same JOBS with gpu_queue.sh 575, sent the moment the last returns
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
flex_ab
OUT=$S/prof bash bench/gpu_profiles.sh > $S/profiles.log 2>&1
touch $S/finished_$tag
