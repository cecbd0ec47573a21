#!/usr/bin/env bash
# The jobs of a one-GPU session (after the ninth), one after another so each is timed alone, started by
#   JOBS="bench/gpu_jobs_one.sh" bash bench/gpu_queue.sh SECONDS   (once SmolLM2 and the data are staged)
# with `.whl-spec` (bench/speculators_train.py's wheels) in the carry of the call that starts it. Send
# Qwen2.5-Coder-0.5B's pieces (.stageq) while the GPU tests run: its extraction waits for the GGUF.
# Poll with no gap over 30 s: read each result in a bash call placed in the same batch as the next poll, never
# between them (the ninth session lost its machine, and its pipeline, to an 80 s gap).
# Durations seen in the ninth session: gputests 40 s, smol_extract 119 s, train_eyas 114-158 s; speculators'
# trainer compiled for over 4 minutes without finishing a step. In order of what they decide:
# - the extraction's first run, the shard buffers pinned in the background, SmolLM2 and Qwen: issue 4's 80% goal,
#   the last figure that issue lacks;
# - the verify pass with the target's KV heads stored per query head (Decoder.expand_kv, no copies at T > 1)
#   against the grouped layout, and the aten ops each verify adds over a one-token step: issue 6's round cost;
# - the default pipeline with greedy regeneration (never run at GPU scale; the eval decodes greedily) and decoding
#   with its drafter, both cache layouts: issues 5 and 6's tau and speedup goals. Beside the pipeline (its
#   figures are tau, not speed), speculators' trainer runs a few steps to fill inductor's cache;
# - eyas' trainer, then speculators' with that cache warm: issue 5's 1.5x goal; last, HumanEval decoding.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
[ -z "${SKIP_GPUTESTS:-}" ] && job gputests timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fastlm.py
job smol_extract timeout 300 python3 bench/bench_extract.py --target smollm2 --sequences 2000 \
  --writer-variants bf16:fresh=1:bg=0,bf16:fresh=1,bf16:cudnn=1 --out $S/smol_extract.json
for i in $(seq 90); do [ -f ~/eyas-stage/qwen2.5-coder-0.5b-instruct.gguf ] && break; sleep 2; done
job qwen_extract timeout 300 python3 bench/bench_extract.py --target qwen-coder-0.5b --sequences 2000 \
  --writer-variants bf16:fresh=1:bg=0,bf16:fresh=1 --out $S/qwen_extract.json
run=/tmp/gpurun
# beside the pipeline (tau, not speed): the copies and kernels of each attention layout and of each verify
( job sdpa_layouts timeout 120 python3 bench/sdpa_layouts.py --out $S/sdpa_layouts.json
  job profile_round timeout 300 python3 bench/profile_round.py --parts 1 --replays 100 --expand-kv 0,1 \
    --out $S/profile_round.json ) &
job pipeline python3 -m eyas run --out $run --set regen.temperature=0
keep $run smolT0
wait
if [ -d $run/draft ]; then
  job decode_sharegpt timeout 400 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3,7 --max-new-tokens 256 --budget 25 --skip-hf --expand-kv 0,1 --out $S/decode_sharegpt.json
fi
touch $S/finished_$tag
