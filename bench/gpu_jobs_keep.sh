#!/usr/bin/env bash
# train.feature_cache_keep in the trainer itself (fiftieth session), after bench/feature_keep.py timed an epoch's
# features alone on an H100 (shortest 21% less than longest): 4,000 conversations, half of their features held
# (12 GB on the GPU, none in host memory), one epoch of steps with each policy, longest again after shortest so a
# drift of the machine shows. Then the one-micro-batch step with its graph and without, at 8,192 tokens, to read
# AccumGraph's grad_accum-2 pair (444k against 436k tok/s) against the graph's own gain on this machine.
# Staged in 3 pieces (.stage46, see gpu_jobs_spec.sh); the third call:
#   bash .stage46/02/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_keep.sh" bash bench/gpu_queue.sh 560
# About 600 s of job, an estimate.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
k=(--conversations 4000 --steps 640 --batch-tokens 8192 --draft-intermediate-size 6144 --feature-cache-gb 12
   --feature-cache-host-gb 0)
job keep_longest timeout 500 python3 bench/bench_train.py "${k[@]}" --feature-cache-keep longest --workdir /tmp/kl \
  --out $S/keep_longest.json
for w in ks kl2; do mkdir -p /tmp/$w && cp -r /tmp/kl/data /tmp/kl/vocab /tmp/$w/; done  # same tokens, no checkpoint
job keep_shortest timeout 400 python3 bench/bench_train.py "${k[@]}" --feature-cache-keep shortest --workdir /tmp/ks \
  --out $S/keep_shortest.json
job keep_longest2 timeout 400 python3 bench/bench_train.py "${k[@]}" --feature-cache-keep longest --workdir /tmp/kl2 \
  --out $S/keep_longest2.json
g=(--conversations 1500 --steps 120 --batch-tokens 8192 --draft-intermediate-size 6144)
job one_graph timeout 300 python3 bench/bench_train.py "${g[@]}" --out $S/one_graph.json
job one_eager timeout 300 python3 bench/bench_train.py "${g[@]}" --cuda-graph 0 --out $S/one_eager.json
touch $S/finished_$tag
