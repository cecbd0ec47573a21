#!/usr/bin/env bash
# The jobs of a one-GPU session (after the eleventh), one after another so each is timed alone, started by
#   JOBS="bench/gpu_jobs_one.sh" bash bench/gpu_queue.sh SECONDS   (once SmolLM2 and the data are staged)
# with `.whl-spec` (bench/speculators_train.py's wheels) in the carry of the call that starts it.
# Poll with no gap over 30 s: a polling call's wait is the only time the machine is safe. Read each result in a
# bash call placed in the same batch as the next poll, never between them; write no code between polls (the ninth
# and tenth sessions lost their machines to gaps of 80 s and 2 minutes; the eleventh, polling so, lost nothing).
# To restart on a new machine, kill an old chain with an anchored pattern, `pkill -f "^bash bench/gpu_"`, then
# `rm -rf /tmp/gq`: a pattern the call's own command line contains kills the harness running it (`pkill -f
# gpu_jobs_one`, `pkill python3` and `pkill -f "^timeout "` all did, in the tenth session).
# Durations seen (eleventh session): staging 52 s; the pipeline 795 s (greedy answers, 6 epochs, with the GPU tests
# and speculators' warm-up beside it); spec_warm 366 s beside it; decode_sharegpt with --gqa 1,0 and transformers
# 283 s; decode_humaneval 45 s; train_eyas 122 s; spec_default 97 s once warm; profile_round 35 s. In order of what
# they decide:
# - the default pipeline with the data's later turns kept after each regenerated first answer, with their original
#   answers (data.original_rest, about 2.5x the tokens), for 3 epochs instead of 8 so it trains on as many tokens
#   as the default: its tau against the eighth session's 2.78 (same compute, more distinct text), with the compiled
#   TTT loss; its regenerated answers come back as smolD_regen.tgz, to carry into later sessions;
# - eyas' trainer with the compiled loss, then eager, then speculators' (warmed beside the pipeline): issue 5's 1.5x;
#   then 3 of eyas' steps under the profiler (bench_train --profile-steps): where a step's device time goes;
# - decoding with the default drafter, chat and HumanEval, the cache writes without index copies, and the target's
#   RMSNorm as one kernel (FastLM.norm_one_kernel, new) against HF's rounding steps (4 kernels a norm);
# - profile_round, both norms: the verify's aten::copy_ count should now equal a step's, and a forward should
#   launch 183 fewer kernels with the one-kernel norm;
# - last, if time is left: 7 TTT steps on the same answers (4 epochs), for K=7's later positions.
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
# beside the pipeline (its figure is tau, not speed): the GPU tests (kernel counts and values, not timings) and a
# few of speculators' steps to fill inductor's cache
[ -z "${SKIP_GPUTESTS:-}" ] && ( job gputests timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_fastlm.py tests/test_ttt.py ) &
[ $spec_ok = 1 ] && ( job spec_warm timeout 900 "${SPEC[@]}" --steps 6 --out $S/train_spec_warm.json ) &
run=/tmp/gpurun
job pipeline python3 -m eyas run --out $run --set data.original_rest=true --set train.epochs=3
keep $run smolD
wait
TRAIN=(python3 bench/bench_train.py --conversations 1500 --steps 60 --batch-tokens 16384 --draft-intermediate-size 6144
       --workdir /tmp/trainrun)
# each trains from scratch on the same tokens and vocabulary: a run folder's checkpoint would otherwise be resumed
fresh() { rm -rf /tmp/trainrun/ckpt /tmp/trainrun/train /tmp/trainrun/draft; }
job train_eyas timeout 300 "${TRAIN[@]}" --out $S/train_eyas.json
fresh; job train_eyas_eager timeout 300 "${TRAIN[@]}" --loss-compile 0 --out $S/train_eyas_eager.json
[ $spec_ok = 1 ] && job spec_default timeout 420 "${SPEC[@]}" --steps 60 --out $S/train_spec_default.json
fresh; job train_eyas_profile timeout 300 "${TRAIN[@]}" --steps 30 --profile-steps 3 --out $S/train_eyas_profile.json
if [ -d $run/draft ]; then
  job decode_sharegpt timeout 300 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3,7 --max-new-tokens 256 --budget 30 --hf-budget 15 --norm 2,1 --out $S/decode_sharegpt.json
  job decode_humaneval timeout 300 python3 bench/bench_decode.py --draft $run/draft --prompts humaneval --limit 40 \
    --k 3,7 --max-new-tokens 256 --budget 30 --skip-hf --out $S/decode_humaneval.json
fi
job profile_round timeout 200 python3 bench/profile_round.py --parts 1 --norm 2,1 --out $S/profile_round.json
if [ -d $run/data/regen ]; then  # the same answers, so only the TTT steps differ (and the epochs, to fit)
  mkdir -p /tmp/ttt7 && cp -r $run/data /tmp/ttt7/
  job pipeline_ttt7 python3 -m eyas run --out /tmp/ttt7 --set train.ttt_steps=7 --set train.epochs=4
  NO_REGEN_TGZ=1 keep /tmp/ttt7 ttt7
  [ -d /tmp/ttt7/draft ] && job decode_ttt7 timeout 300 python3 bench/bench_decode.py --draft /tmp/ttt7/draft \
    --prompts sharegpt --limit 80 --k 3,7 --max-new-tokens 256 --budget 40 --skip-hf --out $S/decode_ttt7.json
fi
touch $S/finished_$tag
