#!/usr/bin/env bash
# The loss on every position, and a stronger loss decay, each against a baseline trained in the same session on the
# same data. Started like the other job scripts, after the stage's two pieces (call 1 `bash .stage/00/unpack.sh
# ~/eyas-stage`, call 2 `bash .stage/01/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_pos.sh" bash
# bench/gpu_queue.sh 540`), polled at once after each return (the machine goes back 30 s after a call when no other
# follows, and 30 minutes after it started):
#   JOBS="bench/gpu_jobs_pos.sh" bash bench/gpu_queue.sh 540
# 1. Run D from nothing: the twenty-second session's run B again (one sample, 3 epochs, decay 0.8, the defaults
#    otherwise; B gave eval tau 2.979 on data that repeats to the last token: 16,200 records, 21,245,892 tokens).
# 2. Run E on D's copied data with train.loss_positions=all: the loss on the user turns and the template's tokens
#    too (the labels are the target's distribution wherever the text came from). The original later turns, text
#    the target did not write, had raised the eval's tau (2.89 -> 3.03 at 5 epochs against 3), so text beyond the
#    target's answers can teach the drafter; here it costs no extra forward, only more positions in the loss.
# 3. Run F on D's copied data with train.ttt_decay=0.6 (the twenty-sixth session's lost run E): 0.6 beat 0.8 in the
#    CPU ablation, simulated tau 1.429 against 1.422.
# 4. The drafters on the chat prompts' first turns, K=3 and 7, plain decoding beside them.
# Budget: start and staging 190-350 s; 1. about 650 s; 2. and 3. about 420 s each; 4. about 70 s each. What the
# session's device time does not reach is lost, so the order is what matters most first.
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
data_runs "--set regen.samples=1 --set train.epochs=3" D="" E="--set train.loss_positions=all" \
  F="--set train.ttt_decay=0.6"
decode_runs D=/tmp/rD E=/tmp/rE F=/tmp/rF
wait
touch $S/finished_$tag
