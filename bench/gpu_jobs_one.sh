#!/usr/bin/env bash
# The jobs of a one-GPU session (after the eighth), one after another so each is timed alone, started by
#   JOBS="bench/gpu_jobs_one.sh" bash bench/gpu_queue.sh SECONDS   (once SmolLM2 and the data are staged)
# with `.whl-spec` (bench/speculators_train.py's wheels) in the carry of the call that starts it. In order of
# what they decide: the GPU tests; the extraction with captures that avoid cuDNN (issue 4's 80% goal, missed in
# the eighth session on a process's first extraction only) and its first run against later ones; eyas' trainer
# and speculators' trainer side by side on the same data (issue 5's 1.5x goal), speculators as its users run it
# and with eyas' settings (trained lm_head, AdamW); then the default pipeline and decoding with its drafter.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
job gputests python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fastlm.py tests/test_ttt.py tests/test_regen.py
job smol_extract python3 bench/bench_extract.py --target smollm2 --sequences 2000 --writer-variants bf16:cudnn=1,bf16 \
  --out $S/smol_extract.json
job extract_first python3 bench/profile_extract_first.py --sequences 2000 --runs 2
job train_eyas python3 bench/bench_train.py --conversations 1500 --steps 60 --batch-tokens 16384 \
  --draft-intermediate-size 6144 --workdir /tmp/trainrun --out $S/train_eyas.json
if [ -d .whl-spec ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/specsite .whl-spec/*.whl
  python3 -c 'import pydantic, annotated_types, typing_inspection' 2>/dev/null || \
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/specsite .whl-spec/if-missing/*.whl
  PYTHONPATH=$PYTHONPATH:/tmp/specsite job spec_default python3 bench/speculators_train.py --conversations 1500 \
    --steps 60 --batch-tokens 16384 --workdir /tmp/specrun --out $S/train_spec_default.json
  PYTHONPATH=$PYTHONPATH:/tmp/specsite job spec_eyas_settings python3 bench/speculators_train.py --conversations 1500 \
    --steps 60 --batch-tokens 16384 --workdir /tmp/specrun --train-lm-head --out $S/train_spec_eyas_settings.json \
    -- --optimizer adamw
fi
run=/tmp/gpurun
job pipeline python3 -m eyas run --out $run
NO_REGEN_TGZ=1 keep $run smol
if [ -d $run/draft ]; then
  job decode_sharegpt python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 --k 3,7 \
    --max-new-tokens 256 --budget 40 --hf-budget 15 --out $S/decode_sharegpt.json
fi
touch $S/finished_$tag
