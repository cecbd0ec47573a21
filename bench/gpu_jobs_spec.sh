#!/usr/bin/env bash
# Issue 5's throughput goal re-measured on the current trainer: eyas at least 1.5x the speculators trainer on the
# same data and GPU, one after the other (eyas, speculators, eyas again, so a drift of the machine shows). Last
# measured in the twelfth session (1.64x: 287.9k against 175.1k tok/s, eyas with its compiled loss and an eager
# drafter step); eyas' step is now one CUDA graph with a compiled drafter step (thirty-ninth session).
# Wheels (not in git, 4.6 MiB; how to get them: bench/speculators_train.py's docstring) in .whl-spec, carried in the
# call that starts the chain. Staged in 3 pieces so the last has room for them:
#   python3 ../shared/tools/stage.py --model smollm2 --data sharegpt --wheels gguf --out .stage46 --chunk-mib 46
#   calls 1, 2:  bash .stage46/0N/unpack.sh ~/eyas-stage            (carry [".stage46/0N"])
#   call 3:      bash .stage46/02/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_spec.sh" bash bench/gpu_queue.sh 560
#                (carry [".stage46/02", ".whl-spec"])
#   polls:       JOBS="bench/gpu_jobs_spec.sh" bash bench/gpu_queue.sh 575, the moment the last one returns
# Time, an estimate from the twelfth session: eyas 130 s (85 s of it compiling, cold), speculators about 450 s cold
# (its compile took 366 s for 6 steps there), eyas again about 60 s: about 650 s of job after staging, then
# about 300 s for AccumGraph's tests and timing, and 200 s for bench/feature_keep.py.
# ARGS adds options to both trainers' command lines (e.g. ARGS="--batch-tokens 8192" for the pipeline's batch).
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
if [ ! -d /tmp/specsite ]; then
  if ls .whl-spec/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/specsite .whl-spec/*.whl 2>&1 | tail -1
    python3 -c 'import pydantic, annotated_types, typing_inspection' 2>/dev/null || python3 -m pip install -q \
      --no-index --no-deps --no-compile --target /tmp/specsite .whl-spec/if-missing/*.whl 2>&1 | tail -1
  else
    echo "$(date +%T) MISSING .whl-spec: carry it in the call that starts this chain; speculators will not run"
  fi
fi
common=(--conversations 1500 --steps 60 --batch-tokens 16384 --draft-intermediate-size 6144 ${ARGS:-})
job train_eyas timeout 500 python3 bench/bench_train.py "${common[@]}" --out $S/train_eyas.json
job train_spec timeout 900 env PYTHONPATH=$PWD:/tmp/specsite:/tmp/site python3 bench/speculators_train.py \
  "${common[@]}" --out $S/train_spec.json
job train_eyas2 timeout 300 python3 bench/bench_train.py "${common[@]}" --out $S/train_eyas2.json
python3 - $S > $S/spec_summary.txt 2>&1 <<'EOF'
import json, sys
from pathlib import Path
s = Path(sys.argv[1])
got = {n: json.loads((s / f"{n}.json").read_text()) for n in ("train_eyas", "train_spec", "train_eyas2")
       if (s / f"{n}.json").exists()}
for n, r in got.items():
    print(n, "tok_s_steady", r.get("tok_s_steady"))
if "train_spec" in got and got["train_spec"].get("tok_s_steady"):
    for n in ("train_eyas", "train_eyas2"):
        if n in got and got[n].get("tok_s_steady"):
            print(f"{n} / speculators: {got[n]['tok_s_steady'] / got['train_spec']['tok_s_steady']:.2f}x")
EOF
cat $S/spec_summary.txt
# Then the graphs for several micro-batches a step (stepgraph.AccumGraph, fiftieth session, run only on the CPU so
# far): their GPU tests (with release_memory's, which has not run on a GPU either), then one GPU at grad_accum 2
# with them and without (eager), the stand-in for two processes until a 2-GPU kind is lent (about 300 s, an
# estimate)
job gputests_accum timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_train.py \
  tests/test_features.py -k "accum_graph or two_gpu or release_memory"
acc=(--conversations 1500 --steps 120 --batch-tokens 8192 --grad-accum 2 --draft-intermediate-size 6144)
job train_accum_graph timeout 300 python3 bench/bench_train.py "${acc[@]}" --out $S/train_accum_graph.json
job train_accum_eager timeout 300 python3 bench/bench_train.py "${acc[@]}" --cuda-graph 0 --out $S/train_accum_eager.json
# Then train.feature_cache_keep (forty-ninth session): an epoch's features with half of them cached, the longest
# kept against the shortest, in both orders (about 200 s, an estimate; on this CPU the shortest took 2.4% and 7.7%
# less in two runs).
job feature_keep timeout 300 python3 bench/feature_keep.py --conversations 4000 --batch-tokens 8192 --fraction 0.5 --workdir /tmp/fk \
  --out $S/feature_keep.json
job feature_keep_rev timeout 300 python3 bench/feature_keep.py --conversations 4000 --batch-tokens 8192 \
  --fraction 0.5 --order shortest,longest --workdir /tmp/fk --out $S/feature_keep_rev.json
touch $S/finished_$tag
