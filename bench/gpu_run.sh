#!/usr/bin/env bash
# shellcheck disable=SC2016
HELP='bench/gpu_run.sh: run a list of benchmark commands on a GPU lease, detached, and collect what they wrote.

A device call lasts at most 10 minutes and the machine goes back 30 s after the last call ends, with its disk.
So the jobs run in a process of their own (setsid) that outlives the call, and each later call polls them.

  bash bench/gpu_run.sh unpack DIR...          copy carried stage pieces (made by stage.py, below) into
                                               $EYAS_STAGE_DIR (default ~/eyas-stage)
  bash bench/gpu_run.sh start LIST [SECONDS]   install the staged wheels, start the job list LIST (a file, or -
                                               for standard input) detached, then poll
  bash bench/gpu_run.sh poll [SECONDS]         wait until every started list has finished or SECONDS (default
                                               540) have passed, then copy the results into $OUT
  bash bench/gpu_run.sh send PATH [N]          pack the device folder PATH (a trained drafter) into 15 MiB pieces
                                               and copy pieces 4N..4N+3 into $OUT (a call returns at most 64 MiB);
                                               call again with N+1 until it says all are sent. Here, join them:
                                               cat NAME.part*.tgz | tar xz (NAME: the last part of PATH)
  bash bench/gpu_run.sh take DIR...            copy carried pieces (NAME.partNN.tgz, up to 4 a call) into
                                               $EYAS_STAGE_DIR/parts
  bash bench/gpu_run.sh join NAME DEST         unpack the taken pieces of NAME into the folder DEST (DEST/NAME)
  bash bench/gpu_run.sh --help                 this text

A job list has one job a line, "NAME COMMAND...", run from the repository root one after the other by bash (so
$R, the results folder, and other variables expand); a job that fails is logged and the next one runs. Blank
lines and lines starting with # are skipped. Each job writes its output to $R/NAME.log; $R/runner.log gets a
start line and an end line with the exit code and the seconds. Every job sees EYAS_STAGE_DIR, PYTHONPATH (the
repository and the staged wheels in /tmp/site) and PYTHONUNBUFFERED=1; a carried .whl-spec folder (speculators
and its dependencies, see bench/speculators_train.py --help) is installed into /tmp/specsite, which a job adds to
its own PYTHONPATH. Several lists may be started (one per GPU, with CUDA_VISIBLE_DEVICES in their commands).
Examples: bench/jobs/*.txt.

Each poll packs $R (logs, JSON results; files over 64 MiB left out) into $OUT/results.tgz, split into pieces of
14 MiB where larger (join them with cat), and prints runner.log and the last lines of each job log.

A lease, step by step (the device tool carries at most 64 MiB a call, working tree included):
  here, once:   echo /.stage46/ >> .git/info/exclude
                python3 ../shared/tools/stage.py --model smollm2 --data sharegpt,humaneval --wheels gguf \
                  --out .stage46 --chunk-mib 46
  call 1..N-1:  bash bench/gpu_run.sh unpack .stage46/00                   carry [".stage46/00"], and so on
  call N:       bash bench/gpu_run.sh unpack .stage46/0N && bash bench/gpu_run.sh start bench/jobs/LIST.txt 560
                                                                          carry [".stage46/0N"] (and ".whl-spec")
  then:         bash bench/gpu_run.sh poll 575, sent the moment the last call returns, until it says all finished.
Record each figure in BENCHMARKS.md with its date, machine, command and the baseline from the same run.'

set -uo pipefail
R=${GPU_RUN_DIR:-/tmp/gpu_run}  # the results folder, on the device machine's disk
OUT=${OUT:-/tmp/out}
STAGE=${EYAS_STAGE_DIR:-$HOME/eyas-stage}

install_wheels() {  # the staged wheels into /tmp/site, a carried .whl-spec into /tmp/specsite (once a machine)
  if [ ! -d /tmp/site ] && ls "$STAGE"/wheels/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$STAGE"/wheels/*.whl 2>&1 | tail -1
  fi
  if [ ! -d /tmp/specsite ] && ls .whl-spec/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/specsite .whl-spec/*.whl 2>&1 | tail -1
  fi
}

machine_info() {  # the GPUs, driver, torch and transformers versions and the core count, into $R/machine.txt
  { date -u '+%F %T UTC'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda devices', torch.cuda.device_count())" 2>&1 | tail -1
    echo "cores $(nproc)"
    git rev-parse HEAD 2>/dev/null && git status --short 2>/dev/null | head -20
  } > "$R/machine.txt"
}

run_list() {  # run_list FILE TAG: each job in turn; touches $R/finished_TAG at the end
  local file=$1 tag=$2 name cmd t rc
  export EYAS_STAGE_DIR=$STAGE PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site R
  while IFS= read -r line || [ -n "$line" ]; do
    case $line in ''|'#'*) continue ;; esac
    name=${line%%[[:space:]]*}; cmd=${line#"$name"}
    t=$(date +%s)
    echo "$(date +%T) start $name:$cmd" >> "$R/runner.log"
    bash -c "$cmd" > "$R/$name.log" 2>&1 < /dev/null
    rc=$?
    echo "$(date +%T) end $name rc=$rc $(( $(date +%s) - t ))s" >> "$R/runner.log"
  done < "$file"
  touch "$R/finished_$tag"
}

collect() {  # $R into $OUT/results.tgz (in 14 MiB pieces where larger), then the logs' last lines
  mkdir -p "$OUT"
  local w; w=$(mktemp -d)
  tar czf "$w/results.tgz" -C "$R" --exclude='*.pid' $(cd "$R" && find . -type f -size -64M | sed 's|^\./||') 2>/dev/null
  if [ "$(stat -c %s "$w/results.tgz")" -gt $((15 * 1024 * 1024)) ]; then
    split -b 14m -d -a 1 --additional-suffix=.tgz "$w/results.tgz" "$OUT/results.part"
    echo "results in $(ls "$OUT"/results.part*.tgz | wc -l) pieces: cat results.part*.tgz > results.tgz"
  else
    mv "$w/results.tgz" "$OUT/results.tgz"
  fi
  rm -rf "$w"
  echo "== runner.log"; cat "$R/runner.log" 2>/dev/null
  for f in "$R"/*.log; do
    case $f in */runner.log|*/list_*.log) ;; *) echo "== $f"; tr '\r' '\n' < "$f" | grep -v '^\s*$' | tail -4 ;; esac
  done
}

unfinished() {  # whether any started list is still running
  local f
  for f in "$R"/started_*; do
    [ -e "$f" ] || return 1
    [ -f "$R/finished_${f#"$R"/started_}" ] || return 0
  done
  return 1
}

poll() {  # poll SECONDS
  local t0; t0=$(date +%s)
  while unfinished && [ $(( $(date +%s) - t0 )) -lt "${1:-540}" ]; do sleep 3; done
  collect
  if unfinished; then echo "still running: poll again at once"; else echo "all finished"; fi
}

send() {  # send PATH N: PATH's pieces 4N..4N+3 into $OUT
  local path=${1%/} n=${2:-0} name pack total i
  [ -d "$path" ] || { echo "gpu_run.sh send: $path is not a folder on this machine" >&2; exit 2; }
  name=$(basename "$path")
  # packed once for this folder as it is now (its path, files, sizes and times); written whole before it counts
  pack=$( (realpath "$path"; find "$path" -type f -printf '%P %s %T@\n' | sort) | md5sum | cut -c1-12)
  pack=${GPU_RUN_SEND_DIR:-/tmp/gpu_send}/$pack
  if [ ! -f "$pack/done" ]; then
    rm -rf "$pack"; mkdir -p "$pack"
    tar czf - -C "$(dirname "$path")" "$name" | split -b 15m -d -a 2 --additional-suffix=.tgz - "$pack/$name.part"
    touch "$pack/done"
  fi
  total=$(ls "$pack"/*.tgz | wc -l)
  mkdir -p "$OUT"
  for i in $(seq $((4 * n)) $((4 * n + 3))); do
    [ "$i" -lt "$total" ] && cp "$pack/$name.part$(printf %02d "$i").tgz" "$OUT/"
  done
  if [ $((4 * n + 4)) -lt "$total" ]; then
    echo "sent pieces $((4 * n))-$((4 * n + 3)) of $total: send $path $((n + 1)) next"
  else
    echo "all $total pieces sent: cat $name.part*.tgz | tar xz"
  fi
}

case ${1:-} in
  -h|--help|help|'')
    echo "$HELP" ;;
  unpack)
    shift
    [ $# -gt 0 ] || { echo "gpu_run.sh unpack: name the carried stage pieces, e.g. .stage46/00" >&2; exit 2; }
    for d in "$@"; do
      [ -f "$d/unpack.sh" ] || { echo "gpu_run.sh unpack: $d/unpack.sh not found (was $d carried?)" >&2; exit 2; }
      bash "$d/unpack.sh" "$STAGE" || exit $?
    done ;;
  start)
    list=${2:-}
    [ -n "$list" ] || { echo "gpu_run.sh start: name a job list (a file, or - for standard input)" >&2; exit 2; }
    mkdir -p "$R"
    if [ "$list" = - ]; then tag=stdin$(date +%s); else tag=$(basename "$list" .txt | tr -c 'A-Za-z0-9_\n' '_'); fi
    if [ -e "$R/started_$tag" ]; then
      echo "gpu_run.sh start: $tag was started already on this machine; polling it"
    else
      if [ "$list" = - ]; then cat > "$R/list_$tag.txt"; else
        [ -f "$list" ] || { echo "gpu_run.sh start: $list not found" >&2; exit 2; }
        cp "$list" "$R/list_$tag.txt"
      fi
      install_wheels
      [ -f "$R/machine.txt" ] || machine_info
      touch "$R/started_$tag"
      setsid nohup bash "$0" _run "$R/list_$tag.txt" "$tag" > "$R/list_$tag.log" 2>&1 < /dev/null &
    fi
    poll "${3:-540}" ;;
  poll)
    [ -d "$R" ] || { echo "gpu_run.sh poll: nothing started on this machine ($R is missing): it was given back?" >&2; exit 2; }
    poll "${2:-540}" ;;
  send)
    [ -n "${2:-}" ] || { echo "gpu_run.sh send: name a folder on this machine, e.g. /tmp/r15/draft" >&2; exit 2; }
    send "$2" "${3:-0}" ;;
  take)
    shift
    [ $# -gt 0 ] || { echo "gpu_run.sh take: name the carried folders of pieces" >&2; exit 2; }
    mkdir -p "$STAGE/parts"
    for d in "$@"; do
      ls "$d"/*.part*.tgz > /dev/null 2>&1 || { echo "gpu_run.sh take: no NAME.partNN.tgz in $d (was it carried?)" >&2
                                               exit 2; }
      cp "$d"/*.part*.tgz "$STAGE/parts/"
    done
    ls "$STAGE/parts" ;;
  join)
    [ -n "${3:-}" ] || { echo "gpu_run.sh join: name the pieces' NAME and a destination folder" >&2; exit 2; }
    ls "$STAGE/parts/$2".part*.tgz > /dev/null 2>&1 || { echo "gpu_run.sh join: no pieces of $2 taken" >&2; exit 2; }
    mkdir -p "$3" && cat "$STAGE/parts/$2".part*.tgz | tar xzf - -C "$3" && echo "$3/$2 ready" ;;
  _run)
    run_list "$2" "$3" ;;
  *)
    echo "gpu_run.sh: unknown command ${1}; see bash bench/gpu_run.sh --help" >&2; exit 2 ;;
esac
