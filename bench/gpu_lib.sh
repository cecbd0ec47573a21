# Sourced by the GPU job scripts: the environment every job runs in and `job`, which runs one job with
# its log in the state folder $S and a start/end line (with the exit code and seconds) on stdout.
export EYAS_STAGE_DIR=~/eyas-stage EYAS_PROGRESS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
job() {  # job NAME COMMAND...: run it, log to $S/NAME.log
  local name=$1; shift
  local t=$(date +%s)
  echo "$(date +%T) start $name: $*"
  "$@" > "$S/$name.log" 2>&1
  local rc=$?
  echo "$(date +%T) end $name rc=$rc $(( $(date +%s) - t ))s"
}
keep() {  # keep RUN PREFIX: the run's results into $S
  cp $1/manifest.json $S/$2_manifest.json 2>/dev/null; cp $1/eval/report.json $S/$2_report.json 2>/dev/null
  cp $1/report.md $S/$2_report.md 2>/dev/null; cp $1/train/summary.json $S/$2_train_summary.json 2>/dev/null
  cp $1/vocab/coverage.json $S/$2_coverage.json 2>/dev/null
  grep -v '"step": [0-9]*[1-9], "epoch"' $1/train/metrics.jsonl > $S/$2_train_metrics_sparse.jsonl 2>/dev/null
  du -sb $1/* > $S/$2_run_bytes.txt 2>/dev/null
  [ -z "${NO_REGEN_TGZ:-}" ] && [ -d $1/data/regen ] && tar czf $S/$2_regen.tgz -C $1/data regen
}
machine_info() {  # the GPUs, torch and transformers versions and the core count, into $S/gpu.txt; starts the sampler
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.device_count())"
    nproc
  } > $S/gpu.txt 2>&1
  clock_sampler
}
clock_sampler() {  # every 10 s, one line a GPU into $S/gpu_clocks.csv: its SM clock (and the most it allows), power,
  # temperature, use, the reasons the driver gives for holding the clock down (a bit mask), then the host's 1-minute
  # load. For training speeds that drift over minutes within one run (thirty-sixth and thirty-seventh sessions).
  [ -f $S/gpu_clocks.pid ] && kill -0 $(cat $S/gpu_clocks.pid) 2>/dev/null && return
  local q=timestamp,index,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active
  # (a query prints once; nvidia-smi's -c sets the compute mode, a setting to leave alone)
  nvidia-smi --query-gpu=$q --format=csv > /dev/null 2>&1 || q=${q/clocks_event_reasons/clocks_throttle_reasons}
  nvidia-smi --query-gpu=$q --format=csv 2>&1 | head -1 | sed 's/$/, load1/' > $S/gpu_clocks.csv
  setsid bash -c "while sleep 10; do nvidia-smi --query-gpu=$q --format=csv,noheader | sed \"s/\$/, \$(cut -d' ' -f1 /proc/loadavg)/\"; done >> $S/gpu_clocks.csv" < /dev/null > /dev/null 2>&1 &
  echo $! > $S/gpu_clocks.pid
}
carried() {  # carried TGZ RUN [PATH]: regen shards carried in as .carry/TGZ, untarred into RUN/data unless
  # RUN/data/PATH is there already (default: the regen folder; a later sample's plan, e.g. regen/plan-s2.json)
  # (said in the queue's log when missing: .carry is on the machine only in the call that carries it)
  [ -f .carry/$1 ] || echo "$(date +%T) MISSING .carry/$1: the jobs that need it start from nothing"
  if [ -f .carry/$1 ] && [ ! -e $2/data/${3:-regen} ]; then mkdir -p $2/data && tar xzf .carry/$1 -C $2/data; fi
}
stage_done() {  # stage_done RUN STAGE: whether RUN's manifest says STAGE finished
  python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['stages'].get(sys.argv[2], {})
sys.exit(r.get('status') != 'done')" $1/manifest.json $2 2>/dev/null
}
regen_only() {  # regen_only NAME RUN SETTING...: `eyas run --out RUN SETTING...` stopped once its regen stage is
  # done (samples regenerated for a later lease), logged to $S/NAME.log
  local name=$1 run=$2 pid; shift 2
  echo "$(date +%T) start $name: python3 -m eyas run --out $run $* (stopped after regen)"
  setsid python3 -m eyas run --out $run "$@" > $S/$name.log 2>&1 < /dev/null & pid=$!
  until stage_done $run regen || ! kill -0 $pid 2>/dev/null; do sleep 5; done
  kill -- -$pid 2>/dev/null; wait $pid 2>/dev/null
  echo "$(date +%T) end $name (regen done: $(stage_done $run regen && echo yes || echo no))"
}
pieces() {  # pieces NAME DIR PATH...: DIR's PATHs (globs) into $S/NAME.partN.tgz, pieces of at most 14 MiB that
  # come back through the device's file limit (16 MiB each); here `cat NAME.part*.tgz > NAME.tgz` joins them
  [ -d "$2" ] || return 0
  local name=$1 dir=$2; shift 2
  # packed and split outside $S, then moved in: a poll meanwhile (it copies $S/*.tgz and tars the rest of $S) sees
  # neither the whole archive nor a half-written piece
  local w; w=$(mktemp -d)
  (cd $dir && tar czf $w/whole $(eval echo "$@") 2>/dev/null)  # what is there (a missing plan is no reason to stop)
  [ -s $w/whole ] || { rm -rf $w; return 0; }
  split -b 14m -d -a 1 --additional-suffix=.tgz $w/whole $w/$name.part && mv $w/$name.part*.tgz $S/
  rm -rf $w
  ls -l $S/$name.part*.tgz
}
decode_runs() {  # decode_runs NAME=RUN...: each run's drafter on the chat prompts' first turns, K=3 and 7, plain
  # decoding beside it, into $S/decode_NAME.json (a run with no drafter is left out)
  local nr
  for nr in "$@"; do
    [ -d ${nr#*=}/draft ] || continue
    job decode_${nr%%=*} timeout 150 python3 bench/bench_decode.py --draft ${nr#*=}/draft --prompts sharegpt \
      --limit 80 --k 3,7 --max-new-tokens 256 --budget 8 --skip-hf --out $S/decode_${nr%%=*}.json
  done
}
flex_ab() {  # the regen engine's decode steps through flex attention bounded by each row's own position (FastLM's
  # flex_decode, forty-seventh session) against SDPA over the longest row's span, each twice in turn (the untimed
  # warm-up compiles flex), after the GPU test that the flex step's graph picks SDPA's tokens (about 200 s in all)
  job test_flex_decode timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fastlm.py -k flex_decode
  job regen_flex timeout 420 python3 bench/bench_regen.py --prompts 1024 --batch-size 512 --max-new-tokens 512 \
    --max-prompt-tokens 2048 --baseline-batches 0 --engine static:flex=1,static,static:flex=1,static \
    --out $S/regen_flex.json
}
flex_tests() {  # the GPU tests of the flex attention: flex equals dense (with gradients), and a warmed-up unroll
  # never waits for the device
  job test_no_waits timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ttt.py -k "never_waits or flex"
}
decode_greedy() {  # decode_greedy NAME RUN: RUN's drafter on the greedy answers to its 256 validation prompts, K=3
  # (the text training's greedy_tau forecasts), into $S/decode_greedy_NAME.json (a run with no drafter is left out)
  [ -d $2/draft ] || return 0
  job decode_greedy_$1 timeout 300 python3 bench/bench_decode.py --draft $2/draft --prompts greedy:$2 --limit 256 \
    --k 3 --max-new-tokens 256 --budget 100 --skip-hf --out $S/decode_greedy_$1.json
}
data_runs() {  # data_runs "BASE" NAME="SETTINGS"...: `eyas run` into /tmp/rNAME with BASE and its SETTINGS, the first
  # from nothing, each later one on the first's regenerated data, tokens and vocabulary (copied: the stages whose keys
  # its settings leave alone are skipped); each run's results kept in $S as runNAME_*
  local base=$1 first="" nr name; shift
  for nr in "$@"; do
    name=${nr%%=*}
    if [ -n "$first" ]; then
      mkdir -p /tmp/r$name
      cp -r /tmp/r$first/data /tmp/r$first/vocab /tmp/r$first/manifest.json /tmp/r$name/ 2>/dev/null
    fi
    job run_${name,,} python3 -m eyas run --out /tmp/r$name $base ${nr#*=}
    NO_REGEN_TGZ=1 keep /tmp/r$name run$name
    first=${first:-$name}
  done
}
ab_runs() {  # ab_runs "SETTINGS" "B's SETTINGS": run A with SETTINGS, then run B on A's data with both (data_runs)
  data_runs "$1" A="" B="$2"
}
