#!/usr/bin/env bash
# The jobs of a one-GPU session (seventh session), one after another so each is timed alone, started by
#   JOBS="bench/gpu_jobs_one.sh" bash bench/gpu_queue.sh SECONDS   (once SmolLM2 and the data are staged)
# the GPU tests; extraction with the shard writers changed one thing at a time (where its time goes) and under
# the profiler; a speculative round's time with the drafter fused and not; the default pipeline (`eyas run`, no
# arguments) at this commit; decoding with its drafter on 80 ShareGPT prompts (drafter fused and not, against
# transformers generate) and on HumanEval.
S=$1; tag=$2
source bench/gpu_lib.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.device_count())"
  git log --oneline -1 2>/dev/null; nproc
} > $S/gpu.txt 2>&1
job gputests python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fastlm.py tests/test_ttt.py tests/test_regen.py
job smol_extract python3 bench/bench_extract.py --target smollm2 --sequences 2000 --profile \
  --writer-variants bf16:hash=0,bf16:write=0,bf16:hash=0:write=0,bf16:threads=1,bf16:threads=8,bf16 \
  --out $S/smol_extract.json
job round python3 bench/profile_round.py --out $S/round.json
run=/tmp/gpurun
job pipeline python3 -m eyas run --out $run
NO_REGEN_TGZ=1 keep $run smol
if [ -d $run/draft ]; then
  job decode_sharegpt python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 --k 3,7 \
    --max-new-tokens 256 --budget 40 --hf-budget 15 --draft-fuse 0,1 --out $S/decode_sharegpt.json
  job decode_humaneval python3 bench/bench_decode.py --draft $run/draft --prompts humaneval --limit 40 --k 3,7 \
    --max-new-tokens 256 --budget 30 --skip-hf --out $S/decode_humaneval.json
  job round_trained python3 bench/profile_round.py --draft $run/draft --out $S/round_trained.json
fi
touch $S/finished_$tag
