#!/usr/bin/env bash
# Toward τ 3.2 at K=3 over two leases. A second decoder layer raised the eval's τ by 2.4% (3.025 against one layer's
# 2.953 ± 0.028, thirty-third session) and a third sample with 4 epochs gave 3.09 (eighteenth session), so the
# nearest candidate is both: two layers trained 4 epochs on three samples of every first answer. Its regeneration
# and training do not fit one lease (about 500 s for samples 2 and 3, then about 1,300 s of training by the
# eighteenth session's 982 s at 1.3× the time), so this lease regenerates samples 2 and 3 beside D's carried first
# sample and sends them back, and a later lease trains on all three carried (`bench/gpu_jobs_variant.sh` style).
# Then, on D's carried sample, one layer for 4 epochs (E4): about the training time of L2's 3 epochs, so it says
# whether L2's τ came from the layer or from the time.
# Started with .carry/regenD.tgz carried in the call that starts the chain (stage with `--chunk-mib 40` so the last
# piece leaves room for it):
#   call 1..n-1: bash .stage/NN/unpack.sh ~/eyas-stage
#   call n:      bash .stage/NN/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_samples23.sh" bash bench/gpu_queue.sh 560
#   polls:       JOBS="bench/gpu_jobs_samples23.sh" bash bench/gpu_queue.sh 580 (sent the moment the last one returns)
# Samples 2 and 3 come back as regenS23.part*.tgz (about 18 MB; `cat regenS23.part*.tgz > .carry/regenS23.tgz`,
# then untar both into a run's data/ to train on the three). Budget: regen about 500 s (248 s a sample), E4 about
# 750 s (tokenize, about 480 s of training, eval, decodes), with the start and staging about 1,450 s.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
# first, 20 s: what one flex mask a batch would save the host at the training batch's length (CPU: under 1 ms a step)
job mask_cost timeout 120 python3 bench/mask_build_cost.py --tokens 8192 --device cuda
run=/tmp/rS3
carried regenD.tgz $run
carried regenD.tgz /tmp/rE4  # now: .carry is on the machine only in the call that carried it, E4 starts later
if [ -d $run/data/regen ]; then
  # the pipeline of the later lease, stopped once its regeneration is done (the regen settings must be the same then)
  regen_only regen_s23 $run --set regen.samples=3 --set train.epochs=4 --set train.draft_layers=2
  NO_REGEN_TGZ=1 keep $run rS3
  pieces regenS23 $run/data 'regen/plan-s2.json' 'regen/plan-s3.json' 'regen/shard-s2-*' 'regen/shard-s3-*'
else
  echo "$(date +%T) no D sample carried: samples 2 and 3 skipped (they need the first sample beside them)"
fi
bash bench/gpu_jobs_variant.sh E4 train.epochs=4 "$S" "${tag}_variant"
touch $S/finished_$tag
