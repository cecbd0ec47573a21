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
