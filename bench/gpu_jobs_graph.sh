#!/usr/bin/env bash
# train.cuda_graph, the training step captured as one CUDA graph and replayed (eyas/stepgraph.py, thirty-ninth
# session): a step launched about 660 kernels holding 22.6 ms of GPU work in about 33 ms of host time (thirty-third
# session), so the host, not the GPU, set the pace. First the GPU test (graph against eager steps), then bench_train
# alternating eager and graph steps on one machine (PAIRS pairs at one layer, PAIRS2 at two, the first of each pair
# alternating), then, if the graph was captured, the pipeline's one-sample recipe with it (run G: regen, 3 epochs,
# eval; its eager twins D, S1, S2 gave val_tau 2.441 / 2.426 / 2.444 and eval τ 2.953 ± 0.028, twenty-seventh to
# twenty-ninth sessions), its eager twin on G's data (run E) and both drafters' chat decodes. Started like the others:
#   calls 1..n-1: bash .stage/NN/unpack.sh ~/eyas-stage
#   call n:       bash .stage/NN/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_graph.sh" bash bench/gpu_queue.sh 560
#   polls:        the same JOBS with gpu_queue.sh 580, sent the moment the last one returns
# Measured (thirty-ninth session, BENCHMARKS.md; there the runs E, the decodes and the second two-layer pair ran as
# calls of their own after G, in that order): the test 101 s, each bench run 38-69 s, G 538 s, E 330 s, the decodes
# 132 s: about 1,400 s of jobs.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
job test_graph timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_train.py -k graph
i=0
for layers in 1 2; do
  n=${PAIRS:-2}; [ $layers = 1 ] || n=${PAIRS2:-2}
  for p in $(seq $n); do
    order="eager graph"; [ $((p % 2)) = 0 ] && order="graph eager"
    for g in $order; do
      i=$((i+1)); name=train_graph_${i}_L${layers}_$g
      job $name timeout 240 python3 bench/bench_train.py --conversations 1000 --steps 200 --batch-tokens 8192 \
        --draft-intermediate-size 6144 --draft-layers $layers --cuda-graph $([ $g = graph ] && echo 1 || echo 0) \
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
  mkdir -p /tmp/rE && cp -r /tmp/rG/data /tmp/rG/vocab /tmp/rE/  # G's answers, tokens and vocabulary
  job run_e python3 -m eyas run --out /tmp/rE --set regen.samples=1 --set train.epochs=3 --set train.cuda_graph=false
  NO_REGEN_TGZ=1 keep /tmp/rE runE
  decode_runs G=/tmp/rG E=/tmp/rE
fi
touch $S/finished_$tag
