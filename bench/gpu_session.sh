#!/usr/bin/env bash
# One GPU session: the SmolLM2 pipeline at small scale, then the decoding benchmark with its drafter.
# Stage first: python3 ../shared/tools/stage.py --model smollm2 --data humaneval --wheels gguf, and
# python3 bench/sharegpt_subset.py (carry .carry with the last piece). Then, on the device machine, from the
# repo root after the stage pieces are unpacked into ~/eyas-stage:
#   bash bench/gpu_session.sh [PROMPTS] [BUDGET_S]
# Everything worth keeping is copied to $OUT as it appears, so a time-out still returns results.
set -uo pipefail
prompts=${1:-600}; budget=${2:-240}
export EYAS_STAGE_DIR=~/eyas-stage EYAS_SHAREGPT=$PWD/.carry/sharegpt.json.gz EYAS_PROGRESS= PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site ~/eyas-stage/wheels/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; run=/tmp/gpurun
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
timeout $((budget - 45)) python3 -m eyas run --out $run --set regen.limit=$prompts --set regen.turns=1 \
  --set regen.max_new_tokens=256 --set data.max_seq_len=1024 --set train.epochs=3 --set train.batch_tokens=16384 \
  --set eval.limit=${EVAL_LIMIT:-5} --set eval.max_new_tokens=128 --set eval.k=3 ${EYAS_EXTRA:-} 2>&1 \
  | tr '\r' '\n' | grep -v '^\s*$' > "$OUT/run.log"
echo "pipeline exit ${PIPESTATUS[0]} after $(( $(date +%s) - start ))s" >> "$OUT/run.log"
cp $run/manifest.json $run/eval/report.json $run/report.md "$OUT/" 2>/dev/null
cp $run/train/summary.json "$OUT/train_summary.json" 2>/dev/null
left=$(( budget - ($(date +%s) - start) - 5 ))
if [ -d $run/draft ] && [ $left -gt 30 ]; then
  timeout $left python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit ${DECODE_LIMIT:-10} --k 3,7 \
    --max-new-tokens 128 --budget $(( (left - 20) / 7 )) --out "$OUT/decode.json" 2>&1 \
    | tr '\r' '\n' | grep -v '^\s*$' | tail -40 > "$OUT/decode.log"
fi
tail -3 "$OUT/run.log"; cat "$OUT/decode.log" 2>/dev/null | tail -15
