#!/usr/bin/env bash
# One setting against the three-seed yardstick on a short lease: run <NAME> from nothing with the one-sample recipe
# (regen.samples=1, train.epochs=3, train.seed=0; bench/gpu_jobs_seed.sh runs it with another seed) plus the given
# settings, then the chat prompts (K=3 and 7) and the greedy validation prompts (K=3), as for the seeds. Seeds 0, 1
# and 2 of that recipe gave eval τ 2.953 ± 0.028 at K=3 and 2.850 ± 0.028 / 3.650 ± 0.037 on the chat prompts
# (BENCHMARKS.md, twenty-ninth session): one run of a setting says more than the seed does about 0.09 from those
# means. Started like the others:
#   call 1: bash .stage/00/unpack.sh ~/eyas-stage
#   call 2: bash .stage/01/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_variant.sh E5 train.epochs=5" bash bench/gpu_queue.sh 540
#   polls:  JOBS="bench/gpu_jobs_variant.sh E5 train.epochs=5" bash bench/gpu_queue.sh 540
# (NAME, then KEY=VALUE settings; gpu_queue.sh appends the state folder and the tag). Budget: the run is about 700 s
# at 3 epochs (S2: 674 s of stages; T10 707 s) plus about 100 s for every added epoch (an estimate from S2's 359 s
# train stage), the chat decode about 70 s and the greedy decode about 130 s (S2).
# `--seeds 0,1` first (before NAME) trains the setting once per seed, all on the first run's regenerated data
# (copied; data_runs in gpu_lib.sh), so each seed pairs with the yardstick's run of the same seed (the chain is
# deterministic: see gpu_jobs_seed.sh). Each later seed adds about 350 s (T10PC's retraining on T10's data, train to
# export with its 43 s eval, thirtieth session) and its chat decode; the greedy-prompt decode runs for the first seed
# only.
# The recipe's regenerated answers are the same in every session (D's data), so the first run saves its regeneration
# (about 260 s) by carrying them in when the variant leaves the regeneration alone (every setting train.*, vocab.*,
# eval.* or export.*): put them in .carry/regenD.tgz and carry that path in the call that starts the chain (with
# the last stage piece; `stage.py --chunk-mib 40` leaves room for its 9 MB). Without it the run regenerates, and
# the answers come back as regenD.part*.tgz beside state.tgz (`cat regenD.part*.tgz > .carry/regenD.tgz` here),
# from the first poll after the regen stage ends (the thirty-second session lost a machine after that poll, and the
# answers with it, when they were packed only at the run's end).
# A carried copy made with other settings stops the run at once (regen checks its plan), so nothing trains on it.
args=("$@"); seeds=0
if [ "${args[0]}" = "--seeds" ]; then seeds=${args[1]}; args=("${args[@]:2}"); fi
n=${#args[@]}
S=${args[$((n - 2))]}; tag=${args[$((n - 1))]}; name=${args[0]}
sets="--set regen.samples=1 --set train.epochs=3"
own_regen=""  # a setting that changes what the first run regenerates: then nothing is carried or sent back
for kv in "${args[@]:1:$((n - 3))}"; do
  case $kv in
    train.seed=*) echo "give the seed as --seeds ${kv#*=}, not as a setting" >&2; touch $S/finished_$tag; exit 2;;
    train.*|vocab.*|eval.*|export.*) ;;
    *) own_regen=$kv;;
  esac
  sets="$sets --set $kv"
done
source bench/gpu_lib.sh
machine_info
took=""  # (.carry is on the machine only in the call that carried it, so what was taken is remembered here)
if [ -z "$own_regen" ] && [ -f .carry/regenD.tgz ]; then carried regenD.tgz /tmp/r$name && took=1; fi
runs=(); names=()
for seed in ${seeds//,/ }; do  # the first seed's run is NAME, the others NAMEs<seed>, on the first's data
  nm=$name; [ ${#names[@]} -gt 0 ] && nm=${name}s$seed
  runs+=("$nm=--set train.seed=$seed"); names+=("$nm=/tmp/r$nm")
done
echo "$(date +%T) variant $name, seeds $seeds: $sets"
watcher=""  # the answers go into pieces as soon as the regen stage is done, so the next poll brings them back
if [ -z "$own_regen" ] && [ -z "$took" ]; then
  (until stage_done /tmp/r$name regen; do sleep 5; done; pieces regenD /tmp/r$name/data regen) & watcher=$!
fi
data_runs "$sets" "${runs[@]}"
if [ -n "$watcher" ]; then  # the run is over: its regen either finished (the watcher packs within 5 s) or not
  if stage_done /tmp/r$name regen; then wait $watcher
  else kill $watcher 2>/dev/null; wait $watcher 2>/dev/null; pieces regenD /tmp/r$name/data regen; fi
fi
decode_runs "${names[@]}"
decode_greedy $name /tmp/r$name
wait
touch $S/finished_$tag
