#!/usr/bin/env bash
# One training setting against the GPU default on the same regenerated data, in one machine's life. Nothing is
# carried: sessions may start without .carry, so the chain regenerates one sample of every first answer (about 250 s
# at 512 rows) and trains 3 epochs, the twentieth GPU session's run A (eval tau 2.95 there, 62.3M tokens, 791 s of
# stages). Started like the other job scripts, after the stage's two pieces (call 1 `bash .stage/00/unpack.sh
# ~/eyas-stage`, call 2 `bash .stage/01/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_ab.sh" bash
# bench/gpu_queue.sh 540`), polled with no gap over 30 s:
#   JOBS="bench/gpu_jobs_ab.sh" bash bench/gpu_queue.sh 540
# A machine goes back 30 minutes after it started, at the end of the call in flight, whatever runs on it, and 30 s
# after a call when no other follows (the twentieth session lost its run B between two polls, most likely so: see
# BENCHMARKS.md): the chain below takes about 21 minutes, so it must start in the call after the first piece, each
# poll must follow the last at once, and the poll that ends past the 30 minutes brings back what is done.
# 1. Run A: `eyas run` with one sample and 3 epochs, everything else the GPU default for SmolLM2.
# 2. Run B: the same with $B_SET (default: train.lr 2e-3 against the default 1e-3, whose choice came from a CPU
#    ablation at 2,048-token batches; the GPU trains on 8,192). A's regen, tokens and vocabulary are copied, so only
#    the stages that read B's settings run (pipeline stage keys).
#    Ran in the twenty-first session: eval tau 2.946 against 2.945, no gain (BENCHMARKS.md).
# 3. Both drafters on the chat prompts' first turns, K=3 and 7, plain decoding beside them (cut if the time is out).
# Budget: start and staging about 100 s; 1. about 790 s; 2. about 470; 3. about 2 x 100.
S=$1; tag=$2
B_SET=${B_SET:---set train.lr=2e-3}
source bench/gpu_lib.sh
machine_info
ab_runs "--set regen.samples=1 --set train.epochs=3" "$B_SET"
decode_runs A=/tmp/rA B=/tmp/rB
wait
touch $S/finished_$tag
