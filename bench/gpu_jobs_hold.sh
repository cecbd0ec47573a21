#!/usr/bin/env bash
# A short lease (thirty-seventh session, what was left after its L2S3 run was lost): the GPU tests of the regen
# engine built only when a shard is left to write (commit 1ffbcd7) and of the feature budget, then whether the GPU
# holds its speed under minutes of full load (bench/gpu_hold.py beside the clock sampler), since the training speed
# of the L2S3 runs drifted between about 170k and 300k tok/s over stretches of hundreds of steps that no batch order
# explains (the bins are shuffled whole). Stage SmolLM2 alone (no ShareGPT needed):
#   python3 ../shared/tools/stage.py --model smollm2 --data humaneval --wheels gguf --out .stage48 --chunk-mib 48
#   call 1: bash .stage48/00/unpack.sh ~/eyas-stage
#   call 2: bash .stage48/01/unpack.sh ~/eyas-stage && JOBS="bench/gpu_jobs_hold.sh" bash bench/gpu_queue.sh 330
S=$1; tag=$2
source bench/gpu_lib.sh
machine_info
job test_regen_gpu timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_regen.py tests/test_features.py
job hold timeout 200 python3 bench/gpu_hold.py --seconds 150 --out $S/hold.json
sleep 11  # one more clock line after the load
touch $S/finished_$tag
