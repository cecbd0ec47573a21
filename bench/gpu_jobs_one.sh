#!/usr/bin/env bash
# The jobs of a one-GPU session (the ninth), one after another so each is timed alone, started by
#   JOBS="bench/gpu_jobs_one.sh" bash bench/gpu_queue.sh SECONDS   (once SmolLM2 and the data are staged)
# with `.whl-spec` (bench/speculators_train.py's wheels) in the carry of the call that starts it. Qwen2.5-Coder-0.5B
# may still be arriving (its pieces sent while the first jobs run): its extraction waits for the GGUF.
# In order: the GPU tests and eyas' trainer (neither sensitive to the staging calls beside them); the extraction
# with captures that avoid cuDNN, a fresh process's first run and the benchmark against the forward, for SmolLM2
# and Qwen (issue 4's 80% goal); speculators' trainer as its users run it (issue 5's 1.5x goal); the default
# pipeline with greedy regeneration (the first GPU-scale test of answers that match greedy decoding) and
# decoding with its drafter; speculators with eyas' settings last.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
job gputests timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fastlm.py
job train_eyas timeout 300 python3 bench/bench_train.py --conversations 1500 --steps 60 --batch-tokens 16384 \
  --draft-intermediate-size 6144 --workdir /tmp/trainrun --out $S/train_eyas.json
job extract_first timeout 240 python3 bench/profile_extract_first.py --sequences 2000 --runs 2
job smol_extract timeout 300 python3 bench/bench_extract.py --target smollm2 --sequences 2000 \
  --writer-variants bf16:cudnn=1,bf16 --out $S/smol_extract.json
for i in $(seq 90); do [ -f ~/eyas-stage/qwen2.5-coder-0.5b-instruct.gguf ] && break; sleep 2; done
job qwen_extract timeout 300 python3 bench/bench_extract.py --target qwen-coder-0.5b --sequences 2000 \
  --out $S/qwen_extract.json
spec() {  # spec NAME ARGS...: speculators 0.9.0's trainer on the same data as train_eyas
  local name=$1; shift
  PYTHONPATH=$PYTHONPATH:/tmp/specsite job $name timeout 300 python3 bench/speculators_train.py --conversations 1500 \
    --steps 60 --batch-tokens 16384 --workdir /tmp/specrun --out $S/train_$name.json "$@"
}
if [ -d .whl-spec ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/specsite .whl-spec/*.whl
  python3 -c 'import pydantic, annotated_types, typing_inspection' 2>/dev/null || \
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/specsite .whl-spec/if-missing/*.whl
  spec spec_default
fi
run=/tmp/gpurun
job pipeline python3 -m eyas run --out $run --set regen.temperature=0
keep $run smolT0
if [ -d $run/draft ]; then
  job decode_sharegpt python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 --k 3,7 \
    --max-new-tokens 256 --budget 40 --skip-hf --out $S/decode_sharegpt.json
  job decode_humaneval python3 bench/bench_decode.py --draft $run/draft --prompts humaneval --limit 40 --k 3,7 \
    --max-new-tokens 256 --budget 30 --skip-hf --out $S/decode_humaneval.json
fi
[ -d .whl-spec ] && spec spec_eyas_settings --train-lm-head -- --optimizer adamw
touch $S/finished_$tag
