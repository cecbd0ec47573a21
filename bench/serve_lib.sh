# shellcheck shell=bash
# What bench/serve_vllm.sh and bench/serve_sglang.sh share, sourced by both: waiting for a server they started and
# stopping it. Each server's pid and log are $R/<kind>_$PORT.pid and .log; $WAIT bounds the wait in seconds.

STAGE=${EYAS_STAGE_DIR:-$HOME/eyas-stage}  # the unpacked stage pieces
R=${R:-/tmp/gpu_run}  # gpu_run.sh's results folder: pids and logs
WAIT=${WAIT:-900}

server_wait() {  # server_wait KIND T0: until /health on $PORT answers; exit 1 with the log's tail if the server dies
  local kind=$1 t0=$2
  while ! curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1; do
    if ! kill -0 "$(cat "$R/${kind}_$PORT.pid")" 2>/dev/null; then
      echo "serve_$kind.sh: the server exited; its log's last lines:" >&2; tail -30 "$R/${kind}_$PORT.log" >&2; exit 1
    fi
    if [ $(( $(date +%s) - t0 )) -gt "$WAIT" ]; then
      echo "serve_$kind.sh: no answer from /health in $WAIT s" >&2; tail -30 "$R/${kind}_$PORT.log" >&2; exit 1
    fi
    sleep 2
  done
}

server_stop() {  # server_stop KIND: end the server's process group (then kill -9), keep its log under a dated name
  local kind=$1 pid
  if [ -f "$R/${kind}_$PORT.pid" ]; then
    pid=$(cat "$R/${kind}_$PORT.pid")
    kill -- -"$pid" 2>/dev/null || kill "$pid" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -9 -- -"$pid" 2>/dev/null
    rm -f "$R/${kind}_$PORT.pid"
    cp "$R/${kind}_$PORT.log" "$R/${kind}_$PORT.$(date +%s).log" 2>/dev/null
  fi
  echo "stopped"
}
