#!/usr/bin/env bash
# The twentieth GPU session: which aux layers the drafter is fed, A against B on the same regenerated data, and the
# regeneration's batch size. Nothing is carried (this session's checkout came without .carry), so the data is
# regenerated here: one sample of every first answer, 3 epochs, to leave time for two trainings. Started like the
# other job scripts, after the stage's two pieces (call 1 `bash .stage/00/unpack.sh ~/eyas-stage`, call 2
# `bash .stage/01/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_aux.sh" bash bench/gpu_queue.sh 480`), polled with
# no gap over 30 s:
#   JOBS="bench/gpu_jobs_aux.sh" bash bench/gpu_queue.sh 540
# 1. Regeneration at 256 (the default), 512 and 1,024 rows decoded together: 2,048 ShareGPT first prompts, greedy, at
#    the pipeline's sizes (512 new tokens, prompts up to 2,048), one process, the 256-row run first and last.
#    The pipeline below regenerates with the fastest.
# 2. Run A: the GPU default for SmolLM2 (original later turns, MLP 6,144, compiled drafter) with one sample and 3
#    epochs, aux layers [2, 15, 27] (the target's default: the stream entering layers 2, N/2, N-3).
# 3. Run B: the same data (A's regen, tokens and vocabulary copied; since 3233bcc other aux layers keep those stages'
#    keys), trained and evaluated with aux layers $AUX: the stream entering layer 29 (after 29 of 30 layers) in
#    place of 27, the closest to the target's own prediction that SGLang and vLLM can capture.
# 4. Both drafters on the chat prompts' first turns, K=3 and 7, plain decoding beside them.
# Budget (1,800 s): staging about 80 s; 1. about 140; 2. about 720 (regen about 220, tokenize 100, train 330, eval 60);
# 3. about 420; 4. about 2 x 100.
S=$1; tag=$2
AUX=${AUX:-2,15,29}
source bench/gpu_lib.sh
machine_info
job regen_bs timeout 300 python3 bench/bench_regen.py --prompts 2048 --batch-size 256 --max-new-tokens 512 \
  --max-prompt-tokens 2048 --engine static:bs=256,static:bs=512,static:bs=1024,static:bs=256 --baseline-batches 0 \
  --out $S/regen_bs.json
bs=$(python3 -c "import json; r = json.load(open('$S/regen_bs.json'))['eyas_regen']
print(max(r.values(), key=lambda x: x['tokens_per_s'])['batch_size'])" 2>/dev/null || echo 256)
echo "$(date +%T) regen batch size $bs"
ab_runs "--set regen.samples=1 --set train.epochs=3 --set regen.batch_size=$bs" "--set target.aux_layers=$AUX"
(cd /tmp/rA/data && tar czf $S/regen_1sample.tgz regen 2>/dev/null)
decode_runs A=/tmp/rA B=/tmp/rB
wait
touch $S/finished_$tag
