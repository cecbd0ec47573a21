#!/usr/bin/env bash
# Two training settings against the GPU default's figures, in one machine's life, without training the default
# again: the twenty-first session's run A (`eyas run --set regen.samples=1 --set train.epochs=3`, the GPU default with
# one sample and 3 epochs) repeated the twentieth session's to the last digit (the same val_tau after every epoch,
# eval tau 2.945), so its figures in BENCHMARKS.md are the baseline, and the ~800 s of a default run go to a second
# setting. Started like the other job scripts, after the stage's two pieces (call 1 `bash .stage/00/unpack.sh
# ~/eyas-stage`, call 2 `bash .stage/01/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_bc.sh" bash
# bench/gpu_queue.sh 540`), polled at once after each return (the machine goes back 30 s after a call when no
# other follows, and 30 minutes after it started):
#   JOBS="bench/gpu_jobs_bc.sh" bash bench/gpu_queue.sh 540
# 1. Run B from nothing: run A's settings with $B_SET (default: train.ttt_decay 0.8, step j's loss weighted 0.8**j,
#    a value common in EAGLE-3 trainers; eyas weighs the steps equally, and no decay was ever tried on the GPU).
# 2. Run C on B's copied data with $C_SET instead (default: train.batch_tokens 4096 against the GPU default's 8,192;
#    on the CPU half the batch for twice the steps learned a little more from fewer tokens, and 32,768 had lost to
#    8,192 in the fifth session). C_SET="--set train.label_temperature=0.5" tries sharper labels instead (no change
#    on the CPU).
# 3. Both drafters on the chat prompts' first turns, K=3 and 7, plain decoding beside them (run A's are in
#    BENCHMARKS.md, same command).
# Budget: start and staging about 190 s; 1. about 760 s (regen 250, tokenize 20, train 410, eval 65); 2. about 500
# (smaller batches train fewer tokens a second; not measured); 3. about 2 x 70, cut if the machine's time runs out.
# B's regen records (16,200) and tokens (21,245,892) should equal run A's: if not, the data changed and run A's
# figures are no baseline.
S=$1; tag=$2
B_SET=${B_SET:---set train.ttt_decay=0.8}
C_SET=${C_SET:---set train.batch_tokens=4096}
source bench/gpu_lib.sh
machine_info
data_runs "--set regen.samples=1 --set train.epochs=3" B="$B_SET" C="$C_SET"
decode_runs B=/tmp/rB C=/tmp/rC
wait
touch $S/finished_$tag
