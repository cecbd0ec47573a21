#!/usr/bin/env bash
# shellcheck disable=SC2016
HELP='bench/serve_vllm.sh: install the staged vLLM on a GPU lease, serve a target with or without an eyas drafter,
stop it. Used by bench/jobs/vllm_parity.txt; each step is one command, so a job list can put eyas parity and
bench/bench_serving.py between them.

  bash bench/serve_vllm.sh install                 pip-install $EYAS_STAGE_DIR/vllm-wheels/*.whl (made by
                                                   bench/stage_vllm.py) into /tmp/vllm-site, no network
  bash bench/serve_vllm.sh start TARGET [DRAFT K]  serve TARGET (a transformers folder) on $PORT (default 8000),
                                                   with DRAFT (an eyas vLLM export) drafting K tokens when given;
                                                   waits for the install and until /health answers
                                                   (at most $WAIT s each, default 900)
  bash bench/serve_vllm.sh stop                    stop the server started on $PORT
  bash bench/serve_vllm.sh --help                  this text

The server runs with PYTHONPATH=/tmp/vllm-site in front of the image'"'"'s packages, greedy-friendly settings
($VLLM_ARGS adds more, e.g. --attention-backend TRITON_ATTN or --enforce-eager), and logs to
$R/vllm_$PORT.log (R: the gpu_run.sh results folder, default /tmp/gpu_run).'

set -uo pipefail
# shellcheck source=bench/serve_lib.sh
source "$(dirname "$0")/serve_lib.sh"
SITE=/tmp/vllm-site
PORT=${PORT:-8000}

case ${1:-} in
  -h|--help|help|'')
    echo "$HELP" ;;
  install)
    ls "$STAGE"/vllm-wheels/vllm-*.whl > /dev/null 2>&1 || {
      echo "serve_vllm.sh install: no vLLM wheel in $STAGE/vllm-wheels (stage it with bench/stage_vllm.py)" >&2; exit 2; }
    if [ ! -d "$SITE/vllm" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$STAGE"/vllm-wheels/*.whl || exit $?
    fi
    touch "$SITE/.installed"
    PYTHONPATH=$SITE python3 -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch",
torch.__version__, "transformers", transformers.__version__)' 2>&1 | tail -1 ;;
  start)
    target=${2:?serve_vllm.sh start: name the target folder}; draft=${3:-}; k=${4:-3}
    [ -d "$target" ] || { echo "serve_vllm.sh start: target folder $target not found" >&2; exit 2; }
    mkdir -p "$R"
    spec=()
    if [ -n "$draft" ]; then
      [ -f "$draft/config.json" ] || { echo "serve_vllm.sh start: $draft/config.json not found" >&2; exit 2; }
      spec=(--speculative-config "{\"method\": \"eagle3\", \"model\": \"$draft\", \"num_speculative_tokens\": $k}")
    fi
    t0=$(date +%s)
    while [ ! -f "$SITE/.installed" ]; do  # an install running beside this job
      [ $(( $(date +%s) - t0 )) -lt "$WAIT" ] || { echo "serve_vllm.sh: vLLM is not installed in $SITE" >&2; exit 2; }
      sleep 2
    done
    # shellcheck disable=SC2086
    PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} setsid nohup python3 -m vllm.entrypoints.cli.main serve "$target" \
      --port "$PORT" --max-model-len 4096 --gpu-memory-utilization 0.6 --seed 0 --served-model-name target \
      "${spec[@]}" ${VLLM_ARGS:-} > "$R/vllm_$PORT.log" 2>&1 < /dev/null &
    echo $! > "$R/vllm_$PORT.pid"
    server_wait vllm "$t0"
    echo "vllm ready on port $PORT in $(( $(date +%s) - t0 )) s (draft: ${draft:-none}, k: ${draft:+$k})" ;;
  stop)
    server_stop vllm ;;
  *)
    echo "serve_vllm.sh: unknown step ${1}; see --help" >&2; exit 2 ;;
esac
