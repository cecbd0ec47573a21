#!/usr/bin/env bash
# For the session after the eighteenth GPU session: the timings that session's device time cut, then the later turns
# answered by the target (regen.later_turns, new) for the session after it to train on. Started like the other job
# scripts,
#   JOBS="bench/gpu_jobs_later.sh" bash bench/gpu_queue.sh SECONDS
# after the stage's pieces: call 1 carries .stage/00, call 2 .stage/01 (each `bash .stage/NN/unpack.sh ~/eyas-stage`),
# call 3 [".stage/02", ".carry"] (smolD_regen.tgz: the first sample, which the later turns' run finds done), call 4
# [".carryd"] with the command above (.carryd/draft17: the seventeenth session's drafter, /tmp/hrun/draft, sha256
# 6dc7b9ee..., its float tensors saved in bf16 to fit one call: the decoder runs it in bf16, so its weights there
# are the same). As run in the nineteenth session, .carry (carried by call 3 only) was gone from the machine in call
# 4, so the later turns' job regenerated the first sample before them: a chain must start in the call that carries
# what it needs. Poll with no gap over 30 s; the chain ends by itself
# CHAIN_SECONDS (default 1,500) after it starts.
# 1. Decoding with the drafter's steps compiled (Decoder.compile_drafter, off until this measures it) against eager,
#    on the text of the seventeenth and eighteenth sessions' chat decoding (their plain outputs were equal): the
#    _dc1 methods. A K=3 round costs 1.35 plain steps, three drafter calls of 30 kernels each among them.
# 2. The training step's host side (bench_train, 60 steps each, the pipeline's batch and drafter shape): statistics
#    read a step late (eyas.train.LAG_STATS, the default since the seventeenth session, untimed), read at once as
#    before, and the drafter's step compiled in two parts around the attention (eyas.ttt.DRAFTER_COMPILE, off).
# 3. The later turns: every later user turn of the default's conversations (regen.limit=20000) answered by SmolLM2,
#    each asked with the conversation's original answers before it (12,290 of the 16,539 conversations have one),
#    until the chain's time is up; the finished shards come back in pieces of at most 14 MiB (later_regen.partN.tgz:
#    `cat` them in order into one .tgz), to be resumed and trained on beside the samples in the next session.
# Budget (1,800 s of device time): start and staging about 110 s; decoding about 250; the eval about 70; training
# runs about 40 + 40 + 110; the rest, about 950 s, the later turns, then packing.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
end=$(( $(date +%s) + ${CHAIN_SECONDS:-1500} ))
job decode_compile timeout 300 python3 bench/bench_decode.py --draft .carryd/draft17 --prompts sharegpt --limit 80 \
  --k 3,5,7 --max-new-tokens 256 --budget 8 --skip-hf --draft-compile 0,1 --out $S/decode_compile.json
# the pipeline's eval of the same drafter (the seventeenth session's default run: tau 3.056 on 11,914 tokens), again,
# for its tau by the answer's place in the conversation (report.json's by_turn, new): the baseline the later turns'
# drafter will be judged against where they should act, the answers after the first
job eval17 timeout 150 python3 -m eyas eval --preset smollm2 --out /tmp/eval17 --set eval.draft=.carryd/draft17
cp /tmp/eval17/eval/report.json $S/eval17_report.json 2>/dev/null
bt="--conversations 1000 --steps 60 --batch-tokens 8192 --draft-intermediate-size 6144"
job train_lag timeout 150 python3 bench/bench_train.py $bt --drafter-compile 0 --workdir /tmp/bt1 --out $S/train_lag.json
job train_sync timeout 150 python3 bench/bench_train.py $bt --drafter-compile 0 --lag-stats 0 --workdir /tmp/bt0 \
  --out $S/train_sync.json
job train_compiled timeout 240 python3 bench/bench_train.py $bt --drafter-compile 1 --workdir /tmp/bt2 \
  --out $S/train_compiled.json
later=/tmp/later
carried smolD_regen.tgz $later
left=$(( end - $(date +%s) - 40 ))
if [ $left -gt 60 ]; then
  job regen_later timeout $left python3 -m eyas regen --out $later --set regen.limit=20000 --set regen.turns=1 \
    --set regen.later_turns=true
fi
pieces later_regen $later/data regen/plan-later.json 'regen/shard-later-*'
wait
touch $S/finished_$tag
