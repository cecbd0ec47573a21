#!/usr/bin/env bash
# A GPU session as a queue of jobs that outlives any one device call (the machine keeps a process started
# with setsid while calls follow each other). Stage first (see BENCHMARKS.md): the stage pieces unpacked into
# ~/eyas-stage and .carry/sharegpt.json.gz carried. Then, in each device call, from the repo root:
#   bash bench/gpu_queue.sh SECONDS
# The first call starts bench/gpu_jobs.sh in the background; every call waits until the queue is finished
# or SECONDS have passed, then packs everything the jobs wrote so far into $OUT/state.tgz.
set -uo pipefail
S=/tmp/gq; mkdir -p $S
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
if [ ! -f $S/started ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site ~/eyas-stage/wheels/*.whl 2>&1 | tail -1
  cp .carry/sharegpt.json.gz ~/eyas-stage/ 2>/dev/null
  touch $S/started
  setsid nohup bash bench/gpu_jobs.sh "$S" > $S/queue.log 2>&1 < /dev/null &
fi
while [ ! -f $S/finished ] && [ $(( $(date +%s) - t0 )) -lt ${1:-540} ]; do sleep 3; done
tar czf "$OUT/state.tgz" -C $S --exclude='*.tgz' . 2>/dev/null
echo "== queue"; cat $S/queue.log
for f in $S/*.log; do case $f in */queue.log) ;; *) echo "== $f"; tr '\r' '\n' < "$f" | grep -v '^\s*$' | tail -6;; esac; done
