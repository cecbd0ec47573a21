#!/usr/bin/env bash
# A GPU session as queues of jobs that outlive any one device call (the machine keeps a process started
# with setsid while calls follow each other). Stage first (see BENCHMARKS.md): the stage pieces unpacked into
# ~/eyas-stage. Then, in each device call, from the repo root:
#   [JOBS="bench/gpu_jobs.sh ARGS"] bash bench/gpu_queue.sh SECONDS
# A call whose JOBS (default bench/gpu_jobs.sh) has not been started yet starts it in the background, so
# several chains can run side by side (one per GPU); every call then waits until all started chains are
# finished or SECONDS have passed, and packs everything the jobs wrote so far into $OUT/state.tgz.
# A jobs script gets the state folder and its tag and touches $S/finished_<tag> at its end.
# Send each poll the moment the last one returns: the machine goes back after 30 s without a call, with its disk
# (the twentieth and thirty-first sessions lost a run's last stages that way). Polls of close to the call limit
# (SECONDS 580 in a 600 s call) leave the fewest gaps; anything else for the machine goes in the same call.
set -uo pipefail
S=/tmp/gq; mkdir -p $S
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
JOBS=${JOBS:-bench/gpu_jobs.sh}
tag=$(echo "$JOBS" | tr -c 'A-Za-z0-9_\n' '_' | sed 's/^bench_//')
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site ~/eyas-stage/wheels/*.whl 2>&1 | tail -1
  cp .carry/sharegpt.json.gz ~/eyas-stage/ 2>/dev/null
fi
if [ ! -f $S/started_$tag ]; then
  touch $S/started_$tag
  setsid nohup bash $JOBS "$S" "$tag" > $S/queue_$tag.log 2>&1 < /dev/null &
fi
unfinished() { for f in $S/started_*; do [ -f $S/finished_${f#$S/started_} ] || return 0; done; return 1; }
while unfinished && [ $(( $(date +%s) - t0 )) -lt ${1:-540} ]; do sleep 3; done
tar czf "$OUT/state.tgz" -C $S --exclude='*.tgz' . 2>/dev/null
cp $S/*.tgz "$OUT"/ 2>/dev/null
for f in $S/queue_*.log; do echo "== $f"; cat $f; done
for f in $S/*.log; do case $f in */queue_*.log) ;; *) echo "== $f"; tr '\r' '\n' < "$f" | grep -v '^\s*$' | tail -4;; esac; done
