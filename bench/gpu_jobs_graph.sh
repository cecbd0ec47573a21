#!/usr/bin/env bash
# train.cuda_graph, the training step captured as one CUDA graph and replayed (eyas/stepgraph.py, thirty-ninth
# session): a step launched about 660 kernels holding 22.6 ms of GPU work in about 33 ms of host time (thirty-third
# session), so the host, not the GPU, set the pace. First the GPU test (graph against eager steps, losses to float32
# rounding), then bench_train alternating eager and graph steps on one machine (PAIRS pairs at each of LAYERS, the
# first of each pair alternating), then, if the graph was captured, the pipeline's one-sample recipe with it (run G:
# regen, 3 epochs, eval; its eager twins D, S1, S2 gave val_tau 2.441 / 2.426 / 2.444 and eval τ 2.953 ± 0.028,
# twenty-seventh to twenty-ninth sessions). Started like the others:
#   calls 1..n-1: bash .stage/NN/unpack.sh ~/eyas-stage
#   call n:       bash .stage/NN/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_graph.sh" bash bench/gpu_queue.sh 560
#   polls:        the same JOBS with gpu_queue.sh 580, sent the moment the last one returns
# Budget (estimates): the test about 150 s, each bench run about 75 s (6 with the defaults), run G about 800 s.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
job test_graph timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_train.py -k graph
i=0
for layers in ${LAYERS:-1 2}; do
  n=${PAIRS:-2}; [ "$layers" = 1 ] || n=${PAIRS2:-1}
  for p in $(seq $n); do
    order="eager graph"; [ $((p % 2)) = 0 ] && order="graph eager"
    for g in $order; do
      i=$((i+1)); name=train_graph_${i}_L${layers}_$g
      job $name timeout 240 python3 bench/bench_train.py --conversations 1000 --steps 200 --batch-tokens 8192 \
        --draft-intermediate-size 6144 --draft-layers $layers $([ $g = graph ] && echo --cuda-graph) \
        --out $S/$name.json
    done
  done
done
captured=$(python3 -c "import json, glob; print(sum(json.load(open(f)).get('step_graph') == 'graph'
  for f in glob.glob('$S/train_graph_*_graph.json')))" 2>/dev/null)
echo "$(date +%T) graph captured in ${captured:-0} bench runs"
if [ "${captured:-0}" -gt 0 ] && [ -z "${NO_RUN:-}" ]; then
  job run_g python3 -m eyas run --out /tmp/rG --set regen.samples=1 --set train.epochs=3 --set train.cuda_graph=true
  NO_REGEN_TGZ=1 keep /tmp/rG runG
fi
touch $S/finished_$tag
