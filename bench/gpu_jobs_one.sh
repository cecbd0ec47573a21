#!/usr/bin/env bash
# The jobs of a one-GPU session (after the tenth), one after another so each is timed alone, started by
#   JOBS="bench/gpu_jobs_one.sh" bash bench/gpu_queue.sh SECONDS   (once SmolLM2 and the data are staged)
# with `.whl-spec` (bench/speculators_train.py's wheels) in the carry of the call that starts it.
# Poll with no gap over 30 s: a polling call's wait is the only time the machine is safe. Read each result in a
# bash call placed in the same batch as the next poll, never between them; write no code between polls (the ninth
# and tenth sessions lost their machines to gaps of 80 s and 2 minutes). To restart on a new machine, kill an old
# chain with an anchored pattern, `pkill -f "^bash bench/gpu_"`, then `rm -rf /tmp/gq`: a pattern the call's own
# command line contains kills the harness running it (`pkill -f gpu_jobs_one`, `pkill python3` and
# `pkill -f "^timeout "` all did, in the tenth session).
# Durations seen: staging 52 s (SmolLM2 and the data; 105 s with Qwen's 8 pieces, not needed by these jobs),
# gputests 40-52 s, the pipeline about 850 s, profile_round 48 s, train_eyas 114-158 s; speculators' trainer
# compiled for over 4 minutes without finishing a step. In order of what they decide:
# - the default pipeline with greedy regeneration (never evaluated at GPU scale; the eval decodes greedily), with
#   speculators' trainer beside it for a few steps to fill inductor's cache (the pipeline's figure is tau, not speed);
# - decoding with its drafter, the verify folded and through enable_gqa, chat and HumanEval: issues 5 and 6's tau
#   and speedup goals;
# - the verify's remaining copies traced to their ops (profile_round's copies_from);
# - eyas' trainer, then speculators' with that cache warm: issue 5's 1.5x goal;
# - a first extraction at 2.5 times the size: issue 4's bf16 figure where pinning's fixed cost weighs less.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
spec_ok=0
if [ -d .whl-spec ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/specsite .whl-spec/*.whl
  python3 -c 'import pydantic, annotated_types, typing_inspection' 2>/dev/null || \
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/specsite .whl-spec/if-missing/*.whl
  spec_ok=1
fi
SPEC=(env PYTHONPATH=$PYTHONPATH:/tmp/specsite python3 bench/speculators_train.py --conversations 1500
      --batch-tokens 16384 --workdir /tmp/specrun)
# beside the pipeline (its figure is tau, not speed): the GPU tests (kernel counts, not timings) and a few of
# speculators' steps to fill inductor's cache
[ -z "${SKIP_GPUTESTS:-}" ] && ( job gputests timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fastlm.py ) &
[ $spec_ok = 1 ] && ( job spec_warm timeout 900 "${SPEC[@]}" --steps 6 --out $S/train_spec_warm.json ) &
run=/tmp/gpurun
job pipeline python3 -m eyas run --out $run --set regen.temperature=0 --set train.epochs=6
keep $run smolT0
wait
if [ -d $run/draft ]; then
  job decode_sharegpt timeout 400 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3,7 --max-new-tokens 256 --budget 40 --hf-budget 15 --gqa 1,0 --out $S/decode_sharegpt.json
  job decode_humaneval timeout 300 python3 bench/bench_decode.py --draft $run/draft --prompts humaneval --limit 40 \
    --k 3,7 --max-new-tokens 256 --budget 30 --skip-hf --out $S/decode_humaneval.json
fi
job train_eyas timeout 300 python3 bench/bench_train.py --conversations 1500 --steps 60 --batch-tokens 16384 \
  --draft-intermediate-size 6144 --workdir /tmp/trainrun --out $S/train_eyas.json
[ $spec_ok = 1 ] && job spec_default timeout 420 "${SPEC[@]}" --steps 60 --out $S/train_spec_default.json
job profile_round timeout 200 python3 bench/profile_round.py --parts 1 --gqa 1,0 --out $S/profile_round.json
# last, if time is left: a process's first extraction at 2.5 times the size, where fresh pinned memory (about
# 0.9 s for SmolLM2's buffers) weighs less than in the 2,000-sequence runs (71.4% of the forward in bf16)
job smol_extract_big timeout 400 python3 bench/bench_extract.py --target smollm2 --sequences 5000 \
  --out $S/smol_extract_big.json
touch $S/finished_$tag
