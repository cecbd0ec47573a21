#!/usr/bin/env bash
# The regeneration temperature, and a stronger loss decay, against the twenty-second session's run B without training
# it again: `eyas run --set regen.samples=1 --set train.epochs=3 --set train.ttt_decay=0.8` (0.8 is now the default)
# gave eval tau 2.979, val_tau 2.015 / 2.360 / 2.441, 2.878 / 3.682 at K=3 / 7 on the chat prompts (BENCHMARKS.md),
# on data that repeats to the last token (16,200 records, 21,245,892 tokens in the twenty-first and twenty-second
# sessions). Started like the other job scripts, after the stage's two pieces (call 1 `bash .stage/00/unpack.sh
# ~/eyas-stage`, call 2 `bash .stage/01/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_de.sh" bash
# bench/gpu_queue.sh 540`), polled at once after each return (the machine goes back 30 s after a call when no other
# follows, and 30 minutes after it started):
#   JOBS="bench/gpu_jobs_de.sh" bash bench/gpu_queue.sh 540
# 1. Run D from nothing with $D_SET (default: answers sampled at temperature 0.6 instead of 0.8). The eval decodes
#    greedily, and training text sampled cooler is nearer what the drafter sees there; greedy answers (temperature 0)
#    had trained a worse drafter because 59% of them loop to the cap (eleventh session).
#    On this session's CPU, 68 first answers sampled at 0.6 (`eyas regen --preset smollm2 --limit 128 --turns 1
#    --temperature 0.6`, stopped there) looped 12 times (18%) by eyas' measure, against 6.75% of run B's 16,200 at 0.8
#    on the H200 (other prompts, so only a sign that cooler answers loop more).
# 2. Run E on D's copied data with $E_SET (default: train.ttt_decay 0.6, which beat 0.8 in the CPU ablation, simulated
#    tau 1.429 against 1.422). E against D measures the decay; D against B the temperature.
# 3. Both drafters on the chat prompts' first turns, K=3 and 7, plain decoding beside them.
# Budget: start and staging about 190 s; 1. about 700 s (regen 250, tokenize 20, train 360-410, eval 60); 2. about
# 420; 3. about 2 x 70. D's regen records and tokens differ from B's (other answers); its report's looping answer
# rate says how much more the cooler answers loop (B: 6.75%).
S=$1; tag=$2
D_SET=${D_SET:---set regen.temperature=0.6}
E_SET=${E_SET:---set train.ttt_decay=0.6}
source bench/gpu_lib.sh
machine_info
data_runs "--set regen.samples=1 --set train.epochs=3" D="$D_SET" E="$E_SET"
decode_runs D=/tmp/rD E=/tmp/rE
wait
touch $S/finished_$tag
