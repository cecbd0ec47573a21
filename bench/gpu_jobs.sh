#!/usr/bin/env bash
# The jobs of one GPU session, in order (started by bench/gpu_queue.sh). Every job writes its log and
# results into the state folder $1; `queue.log` says when each started and how it ended.
# ABLATE=1 adds the drafter ablations (4 at a time, about 17 GB of GPU memory each) before the pipeline;
# BENCH=1 adds the regeneration and extraction benchmarks after the decoding ones.
# TRAIN32K=1 adds a second training of the pipeline's drafter on the same data with 32,768-token batches
# (1.58x the tok/s of 8,192 in bench_train) and its eval, to compare accuracy per token.
S=$1
source bench/gpu_lib.sh
run=/tmp/gpurun
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $S/gpu.txt 2>&1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> $S/gpu.txt
git log -1 --format=%h >> $S/gpu.txt 2>/dev/null
job gputests python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fastlm.py tests/test_ttt.py
ablate() {
  for v in "$@"; do
    python3 bench/ablate_drafter.py --variant $v --out $S/ablate.jsonl > $S/ablate_$v.log 2>&1 &
  done
  wait
}
if [ -n "${ABLATE:-}" ]; then
  job ablate_a ablate base fcscale lr1e-3 fcscale_lr1e-3
  job ablate_b ablate auxnorm_lr1e-3 fcscale_dim long_lr1e-3 zero_aux
fi
job pipeline python3 -m eyas run --out $run ${EYAS_EXTRA:-}
cp $run/manifest.json $run/eval/report.json $run/report.md $S/ 2>/dev/null
cp $run/train/summary.json $S/train_summary.json 2>/dev/null
grep -v '"step": [0-9]*[1-9], "epoch"' $run/train/metrics.jsonl > $S/train_metrics_sparse.jsonl 2>/dev/null
du -sb $run/* > $S/run_bytes.txt 2>/dev/null
if [ -d $run/draft ]; then
  job decode_sharegpt python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 --k 3,7 --round both \
    --max-new-tokens 256 --budget 100 --hf-budget 20 --out $S/decode_sharegpt.json
  job decode_humaneval python3 bench/bench_decode.py --draft $run/draft --prompts humaneval --limit 40 --k 3,7 \
    --max-new-tokens 256 --budget 60 --hf-budget 20 --out $S/decode_humaneval.json
fi
if [ -n "${TRAIN32K:-}" ] && [ -d $run/data ]; then
  b=/tmp/gpurun32k; mkdir -p $b; cp -r $run/data $run/vocab $b/
  job train32k python3 -m eyas train $run/eyas.toml --out $b --set train.batch_tokens=32768
  job eval32k python3 -m eyas eval $run/eyas.toml --out $b
  cp $b/train/summary.json $S/train32k_summary.json 2>/dev/null; cp $b/eval/report.json $S/eval32k_report.json 2>/dev/null
fi
if [ -n "${BENCH:-}" ]; then
  job regen_bench python3 bench/bench_regen.py --prompts 1024 --batch-size 256 --max-new-tokens 256 \
    --engine static,generate --baseline-batches 2 --out $S/regen_bench.json
  job extract_bench python3 bench/bench_extract.py --target smollm2 --sequences 2000 --out $S/extract_bench.json
fi
touch $S/finished_$2
