#!/usr/bin/env bash
# One training seed on a short lease: run S<seed> from nothing with train.seed=<seed> (one sample, 3 epochs, the
# defaults otherwise). train.seed moves only the drafter's initial weights and the batch order: regeneration
# (regen.seed), tokenization and the validation split do not read it, and the whole chain is deterministic across
# sessions (run D of the twenty-seventh session repeated the twenty-second's run B to the last digit), so S<seed> sets
# beside the known seed-0 figures without rerunning them (bench/gpu_jobs_seeds.sh runs seeds 0, 1 and 2 at once and
# needs about 1,800 s of device time). Started like the other job scripts, the seed first:
#   call 1: bash .stage/00/unpack.sh ~/eyas-stage
#   call 2: bash .stage/01/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_seed.sh 2" bash bench/gpu_queue.sh 540
#   polls:  JOBS="bench/gpu_jobs_seed.sh 2" bash bench/gpu_queue.sh 540
# Then the drafter decodes the chat prompts (K=3 and 7) and the validation prompts its training answered greedily for
# greedy_tau (K=3, the same 256 new tokens at most): the decoder's τ there is what greedy_tau forecasts, and plain
# decoding's entry says how many of the training's answers (transformers' generate) the decoder wrote too.
# Budget: start and staging 90-350 s; the run 715-780 s, the chat decode 66-80 s and the greedy decode 128 s (S1, S2).
# The jobs are bench/gpu_jobs_variant.sh's with the name S<seed> and --seeds <seed>.
seed=$1; S=$2; tag=$3
exec bash bench/gpu_jobs_variant.sh --seeds $seed S$seed "$S" "$tag"
