#!/usr/bin/env bash
# shellcheck disable=SC2016
HELP='bench/serve_sglang.sh: install the staged SGLang on a GPU lease, serve a target with or without an eyas drafter,
stop it. Used by bench/jobs/sglang_parity.txt; each step is one command, so a job list can put eyas parity and
bench/bench_serving.py between them.

  bash bench/serve_sglang.sh install            pip-install $EYAS_STAGE_DIR/sglang-wheels/*.whl (made by
                                                bench/stage_sglang.py) into /tmp/sglang-site and
                                                sglang-transformers/*.whl into /tmp/sglang-tf, no network, then
                                                import the server modules once to show they load (and
                                                the EAGLE worker, whose graph capture imports the
                                                DeepSeek attention backends)
  bash bench/serve_sglang.sh start TARGET [DRAFT K [TOPK [TOKENS]]]
                                                serve TARGET (a transformers folder) on $PORT (default 30000), with
                                                DRAFT (an eyas SGLang export) as the EAGLE-3 drafter: K steps
                                                (--speculative-num-steps), TOPK drafts per step (default 1, a chain)
                                                and TOKENS verified per round with the root (default K+1 for a chain;
                                                name it for a tree); waits for the install and until /health answers
                                                (at most $WAIT s each, default 900)
  bash bench/serve_sglang.sh stop               stop the server started on $PORT
  bash bench/serve_sglang.sh --help             this text

The server runs with PYTHONPATH=/tmp/sglang-tf:/tmp/sglang-site ($SGLANG_TF, $SGLANG_SITE) in front of the
image'"'"'s packages (the
transformers SGLang pins comes first for the server alone; eyas keeps the image'"'"'s), HF_HUB_OFFLINE=1,
greedy-friendly settings ($SGLANG_ARGS adds more, e.g. --dtype bfloat16 or --attention-backend fa3), and logs to
$R/sglang_$PORT.log (R: the gpu_run.sh results folder, default /tmp/gpu_run). Where the stage left out
FlashAttention-3 (bench/stage_sglang.py without --fa3), it serves with --attention-backend triton.'

set -uo pipefail
# shellcheck source=bench/serve_lib.sh
source "$(dirname "$0")/serve_lib.sh"
SITE=${SGLANG_SITE:-/tmp/sglang-site}
TF=${SGLANG_TF:-/tmp/sglang-tf}
PORT=${PORT:-30000}

case ${1:-} in
  -h|--help|help|'')
    echo "$HELP" ;;
  install)
    ls "$STAGE"/sglang-wheels/sglang-*.whl > /dev/null 2>&1 || {
      echo "serve_sglang.sh install: no SGLang wheel in $STAGE/sglang-wheels (stage it with bench/stage_sglang.py)" >&2
      exit 2; }
    if [ ! -d "$SITE/sglang" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$STAGE"/sglang-wheels/*.whl \
        || exit $?
    fi
    if [ ! -d "$TF/transformers" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$TF" "$STAGE"/sglang-transformers/*.whl \
        || exit $?
    fi
    touch "$SITE/.installed"
    PYTHONPATH=$TF:$SITE python3 -c 'import sglang, sgl_kernel, torch, transformers
import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler
import sglang.srt.speculative.eagle_worker_v2, sglang.srt.layers.attention.dsa_backend
import sglang.srt.layers.attention.deepseek_v4_backend
print("sglang", sglang.__version__, "sgl_kernel", sgl_kernel.__version__, "torch", torch.__version__,
"transformers", transformers.__version__)' 2>&1 | tail -3 ;;
  start)
    target=${2:?serve_sglang.sh start: name the target folder}; draft=${3:-}; k=${4:-3}; topk=${5:-1}; tokens=${6:-}
    [ -d "$target" ] || { echo "serve_sglang.sh start: target folder $target not found" >&2; exit 2; }
    mkdir -p "$R"
    spec=()
    if [ -n "$draft" ]; then
      [ -f "$draft/config.json" ] || { echo "serve_sglang.sh start: $draft/config.json not found" >&2; exit 2; }
      if [ -z "$tokens" ]; then
        [ "$topk" = 1 ] || { echo "serve_sglang.sh start: name TOKENS (verified per round) for a tree of topk $topk" >&2
                             exit 2; }
        tokens=$((k + 1))
      fi
      spec=(--speculative-algorithm EAGLE3 --speculative-draft-model-path "$draft" --speculative-num-steps "$k"
            --speculative-eagle-topk "$topk" --speculative-num-draft-tokens "$tokens")
    fi
    t0=$(date +%s)
    while [ ! -f "$SITE/.installed" ]; do  # an install running beside this job
      [ $(( $(date +%s) - t0 )) -lt "$WAIT" ] || {
        echo "serve_sglang.sh: SGLang is not installed in $SITE" >&2; exit 2; }
      sleep 2
    done
    backend=()
    ls "$SITE"/sgl_kernel/flash_ops.* > /dev/null 2>&1 || backend=(--attention-backend triton)
    # shellcheck disable=SC2086
    HF_HUB_OFFLINE=1 PYTHONPATH=$TF:$SITE${PYTHONPATH:+:$PYTHONPATH} setsid nohup python3 -m sglang.launch_server \
      --model-path "$target" --port "$PORT" --context-length 4096 --mem-fraction-static 0.6 --random-seed 0 \
      --served-model-name target "${backend[@]}" "${spec[@]}" ${SGLANG_ARGS:-} \
      > "$R/sglang_$PORT.log" 2>&1 < /dev/null &
    echo $! > "$R/sglang_$PORT.pid"
    server_wait sglang "$t0"
    echo "sglang ready on port $PORT in $(( $(date +%s) - t0 )) s" \
      "(draft: ${draft:-none}${draft:+, steps $k, topk $topk, tokens $tokens})" ;;
  stop)
    server_stop sglang ;;
  *)
    echo "serve_sglang.sh: unknown step ${1}; see --help" >&2; exit 2 ;;
esac
