#!/usr/bin/env bash
# For the session after the nineteenth GPU session: the later turns answered by the target (regen.later_turns), as
# far as that session regenerated them, trained on beside the GPU default's data. Started like the other job scripts,
#   JOBS="bench/gpu_jobs_later_train.sh" bash bench/gpu_queue.sh SECONDS
# after the stage's pieces: call 1 carries .stage/00, call 2 .stage/01 (each `bash .stage/NN/unpack.sh ~/eyas-stage`),
# call 3 [".stage/02", ".carry"] (smolD_regen.tgz and samples2_regen.tgz: the default's two samples of the first
# answers; later_regen.tgz: the later set's first 24 of 49 shards) with `bash .stage/02/unpack.sh ~/eyas-stage &&`
# before the command above: the chain must start in the call that carries .carry, which is gone from the machine in
# the next call that does not name it (the nineteenth session's chain, started a call later, found no first sample
# and regenerated it). Poll with no gap over 30 s.
# 1. The run: the GPU default (two samples, the original later turns after the first sample, MLP 6,144; since f807a6d
#    the drafter's steps compiled in training and decoding) with the later set's 6,125 conversations in its regen
#    folder (20,062 target answers, each asked with the conversation's original answers before it). regen.later_turns
#    stays off, so the regen stage finds the two samples done and does not ask for the later set's other half (about
#    480 s); the tokenize stage takes every shard in the folder: 38,524 conversations, 38.72M tokens (28.97M trained
#    on), against the default's 32,399 and 29.08M (`eyas tokenize` over the same shards on the CPU). 4 epochs instead
#    of 5 keep the tokens trained near the default's 142.1M (about 151M). The baseline: the seventeenth session's
#    default run, eval tau 3.056 with 2.824 on the first answers, 3.215 on the second, 3.187 on the later ones
#    (nineteenth session, the same eval); if the later answers rise and the first do not fall, the set helps where
#    it was meant to. The features: 36.84M tokens filled the GPU tier (110.6 GB) and 55.5 of the host tier's 64.6 GB
#    in the eighteenth session, so about 8 GB more may overflow the host tier by a little (recomputed each epoch).
# 2. Decoding on the chat prompts' first turns (the nineteenth session's text, compiled drafter: tau 2.982 / 3.655 /
#    3.893 at K=3 / 5 / 7 with the seventeenth session's drafter). A budget of 18 s lets plain decoding finish all 80
#    prompts (about 17 s at 745 tok/s; with 8 s it did 34), so every speedup is over plain on the same prompts.
# 3. The training step with statistics read at once and a step late (eyas.train.LAG_STATS), in alternating order
#    (the nineteenth session ran them once each, the late one first with the loss's cold compile).
# Budget (1,800 s of device time): start and staging about 110 s; regen's check about 30; tokenize about 100; the
# feature warm-up about 110 and 4 epochs about 800 (compiled drafter, about 190k tok/s); eval 70; decoding about 100;
# the training runs about 4 x 50. Each job is cut off by its own timeout; the last poll is sized to what is left.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
run=/tmp/lrun
carried smolD_regen.tgz $run
carried samples2_regen.tgz $run regen/plan-s2.json
carried later_regen.tgz $run regen/plan-later.json
job pipeline_later python3 -m eyas run --out $run --set train.epochs=4
NO_REGEN_TGZ=1 keep $run later
if [ -d $run/draft ]; then
  job decode_sharegpt timeout 200 python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt --limit 80 \
    --k 3,5,7 --max-new-tokens 256 --budget 18 --skip-hf --out $S/decode_sharegpt.json
fi
bt="--conversations 1000 --steps 60 --batch-tokens 8192 --draft-intermediate-size 6144"
for r in sync_a lag_a lag_b sync_b; do
  job train_$r timeout 150 python3 bench/bench_train.py $bt --lag-stats $([ ${r%_*} = lag ] && echo 1 || echo 0) \
    --workdir /tmp/bt_$r --out $S/train_$r.json
done
wait
touch $S/finished_$tag
