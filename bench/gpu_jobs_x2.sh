#!/usr/bin/env bash
# The jobs of a 2-GPU session, as chains started by bench/gpu_queue.sh:
#   JOBS="bench/gpu_jobs_x2.sh smol" bash bench/gpu_queue.sh S   (once SmolLM2 is staged)
#   JOBS="bench/gpu_jobs_x2.sh big" bash bench/gpu_queue.sh S    (SmolLM2 with BIG_ARGS, e.g. every turn:
#     BIG_ARGS="--set regen.limit=6000 --set regen.turns=0"; default: every first turn)
#   JOBS="bench/gpu_jobs_x2.sh qwen" bash bench/gpu_queue.sh S   (once Qwen2.5-Coder-0.5B is staged)
#   JOBS="bench/gpu_jobs_x2.sh bench" and JOBS="bench/gpu_jobs_x2.sh variants" (fifth session): with the 16,194
#     regenerated conversations of the fourth session carried as .carry/big_regen.tgz
#   JOBS="bench/gpu_jobs_x2.sh multiturn" bash bench/gpu_queue.sh S   (sixth session): the first MT_TURNS (default
#     2) user turns of every conversation, regenerated on both GPUs under torchrun, then the default pipeline on
#     them on GPU 0, with decoding (the target's norms fused and not); beside it
#     QGPU=1 TAIL_BENCH=1 JOBS="bench/gpu_jobs_x2.sh qwen" ...: the Qwen pipeline on GPU 1, then the benchmarks
#   JOBS="bench/gpu_jobs_x2.sh dist" bash bench/gpu_queue.sh S   (once SmolLM2 is staged): the graphs' GPU tests;
#     training on 1 GPU, 2 with CUDA graphs (AccumGraph), 2 with eager DDP and 2 with FSDP2; extraction on 1 GPU,
#     2 data-parallel and 2 tensor-parallel (each job's log has its tok/s)
# smol: alone on the machine (with ALSO_BENCH=1 the regen and extraction benchmarks first), training throughput on
#   one GPU and on both under torchrun (the scaling), with the feature cache (computed ahead) and without it;
#   then the default pipeline and the decoding benchmarks on GPU 1.
# big and qwen wait for the torchrun job, then run on GPU 0 beside the smol chain's pipeline (their
#   throughput figures say so). big: the default pipeline with BIG_ARGS, then decoding on ShareGPT.
#   qwen: the Qwen pipeline (QWEN_LIMIT first turns, default 10,000, QWEN_EPOCHS epochs, default 8), the
#   extraction benchmark and decoding on HumanEval and ShareGPT.
# Between device calls the machine must never sit idle for 30 s: it is given back, with these jobs.
# Each job logs to $S/NAME.log and writes its results into $S; the regenerated data of each pipeline comes
# back as $S/<chain>_regen.tgz, so a later session can carry it instead of regenerating.
mode=$1; S=$2; tag=$3
source bench/gpu_lib.sh
if [ $mode = smol ]; then
  machine_info
  bt="--conversations 1500 --steps 120 --batch-tokens 8192"
  # alone on the machine, one after another (host-bound work slows down next to other jobs)
  if [ -n "${ALSO_BENCH:-}" ]; then  # measured in the fourth session; ALSO_BENCH=1 runs them again
    CUDA_VISIBLE_DEVICES=0 job regen_bench python3 bench/bench_regen.py --prompts 1024 --batch-size 256 \
      --max-new-tokens 256 --engine static --baseline-batches 2 --out $S/regen_bench.json
    CUDA_VISIBLE_DEVICES=0 job smol_extract python3 bench/bench_extract.py --target smollm2 --sequences 2000 \
      --out $S/smol_extract.json
  fi
  CUDA_VISIBLE_DEVICES=1 job train_1gpu python3 bench/bench_train.py $bt --workdir /tmp/bt1 --out $S/train_1gpu.json
  for w in bt2 bt3 bt4; do mkdir -p /tmp/$w && cp -r /tmp/bt1/data /tmp/bt1/vocab /tmp/$w/; done  # same data, no checkpoint
  job train_2gpu torchrun --standalone --nproc_per_node 2 bench/bench_train.py $bt --workdir /tmp/bt2 --out $S/train_2gpu.json
  CUDA_VISIBLE_DEVICES=1 job train_1gpu_nocache python3 bench/bench_train.py $bt --feature-cache-gb 0 --workdir /tmp/bt3 \
    --out $S/train_1gpu_nocache.json
  job train_2gpu_nocache torchrun --standalone --nproc_per_node 2 bench/bench_train.py $bt --feature-cache-gb 0 \
    --workdir /tmp/bt4 --out $S/train_2gpu_nocache.json
  touch $S/gpus_free
  run=/tmp/gpurun
  CUDA_VISIBLE_DEVICES=1 job pipeline python3 -m eyas run --out $run
  keep $run smol
  if [ -d $run/draft ]; then
    CUDA_VISIBLE_DEVICES=1 job decode_sharegpt python3 bench/bench_decode.py --draft $run/draft --prompts sharegpt \
      --limit 80 --k 3,7 --max-new-tokens 256 --budget 60 --hf-budget 15 --out $S/decode_sharegpt.json
    CUDA_VISIBLE_DEVICES=1 job decode_humaneval python3 bench/bench_decode.py --draft $run/draft --prompts humaneval \
      --limit 40 --k 3,7 --max-new-tokens 256 --budget 40 --skip-hf --out $S/decode_humaneval.json
  fi
elif [ $mode = bench ]; then
  # alone on the machine, one after another: GPU tests, regeneration (row groups, host-check interval and
  # fused projections side by side), extraction (with its time split), training on 1 and 2 GPUs
  machine_info
  job gputests python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fastlm.py tests/test_ttt.py tests/test_regen.py
  # (the fifth session ran --baseline-batches 2 --engine static,static:groups=0,static:check=16,static:groups=0:fuse=0)
  CUDA_VISIBLE_DEVICES=0 job regen_bench python3 bench/bench_regen.py --prompts 1024 --batch-size 256 \
    --max-new-tokens 256 --baseline-batches 3 --out $S/regen_bench.json \
    --engine static,static:overlap=1,static:overlap=1:check=8,static:norm=1,static:norm=1:overlap=1,static
  CUDA_VISIBLE_DEVICES=0 job smol_extract python3 bench/bench_extract.py --target smollm2 --sequences 2000 \
    --out $S/smol_extract.json
  bt="--conversations 1500 --steps 120 --batch-tokens 8192"
  CUDA_VISIBLE_DEVICES=1 job train_1gpu python3 bench/bench_train.py $bt --workdir /tmp/bt1 --out $S/train_1gpu.json
  mkdir -p /tmp/bt2 && cp -r /tmp/bt1/data /tmp/bt1/vocab /tmp/bt2/
  job train_2gpu torchrun --standalone --nproc_per_node 2 bench/bench_train.py $bt --workdir /tmp/bt2 --out $S/train_2gpu.json
  touch $S/gpus_free
elif [ $mode = dist ]; then
  # alone on the machine, one after another: the drafter trained on one GPU, on two with DDP and on two with FSDP2
  # (issue 5 names both), then extraction on one GPU, on two data-parallel and on two tensor-parallel (issue 4),
  # each into the folder of a training run above (its tokens: same data settings, so nothing is tokenized again)
  # Since AccumGraph, two processes run the step as CUDA graphs as one does (train.cuda_graph, the default):
  # train_2gpu_graph is the default's scaling, train_2gpu_ddp the eager DDP step it replaced (--cuda-graph 0);
  # first the GPU tests of the graphs, the two-GPU one among them
  machine_info
  job gputests_graph python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_train.py -k graph
  bt="--conversations 1500 --steps 120 --batch-tokens 16384 --draft-intermediate-size 6144"
  CUDA_VISIBLE_DEVICES=0 job train_1gpu python3 bench/bench_train.py $bt --workdir /tmp/bt1 --out $S/train_1gpu.json
  for w in bt2 bt3 bt4; do mkdir -p /tmp/$w && cp -r /tmp/bt1/data /tmp/bt1/vocab /tmp/$w/; done
  job train_2gpu_graph torchrun --standalone --nproc_per_node 2 bench/bench_train.py $bt --workdir /tmp/bt4 \
    --out $S/train_2gpu_graph.json
  job train_2gpu_ddp torchrun --standalone --nproc_per_node 2 bench/bench_train.py $bt --cuda-graph 0 \
    --workdir /tmp/bt2 --out $S/train_2gpu_ddp.json
  job train_2gpu_fsdp torchrun --standalone --nproc_per_node 2 bench/bench_train.py $bt --parallel fsdp \
    --workdir /tmp/bt3 --out $S/train_2gpu_fsdp.json
  ex="--source $EYAS_STAGE_DIR/sharegpt.json.gz --limit 1500 --max-seq-len 2048"
  CUDA_VISIBLE_DEVICES=0 job extract_1gpu python3 -m eyas extract --out /tmp/bt1 $ex
  job extract_dp2 torchrun --standalone --nproc_per_node 2 -m eyas extract --out /tmp/bt2 $ex
  job extract_tp2 torchrun --standalone --nproc_per_node 2 -m eyas extract --tensor-parallel --out /tmp/bt3 $ex
  for w in bt1 bt2 bt3; do cp /tmp/$w/features/train/manifest.json $S/extract_manifest_$w.json 2>/dev/null; done
elif [ $mode = variants ]; then
  # two drafters on the same 16,194 regenerated conversations, one per GPU, against the fourth session's
  # default-settings run (val step-0 0.687, tau 2.85): a 4x wider MLP, and 32K-token batches at lr 2e-3
  export NO_REGEN_TGZ=1  # the data came with the call (unpacked at once: later calls do not carry it)
  for v in wide b32k; do mkdir -p /tmp/$v/data && tar xzf .carry/big_regen.tgz -C /tmp/$v/data; done
  while [ ! -f $S/gpus_free ]; do sleep 5; done
  ( CUDA_VISIBLE_DEVICES=0 job wide_pipeline python3 -m eyas run --out /tmp/wide --set regen.limit=20000 \
      --set train.draft_intermediate_size=6144; keep /tmp/wide wide
    [ -d /tmp/wide/draft ] && CUDA_VISIBLE_DEVICES=0 job wide_decode_sharegpt python3 bench/bench_decode.py \
      --draft /tmp/wide/draft --prompts sharegpt --limit 80 --k 3,7 --max-new-tokens 256 --budget 60 --skip-hf \
      --out $S/wide_decode_sharegpt.json ) &
  ( CUDA_VISIBLE_DEVICES=1 job b32k_pipeline python3 -m eyas run --out /tmp/b32k --set regen.limit=20000 \
      --set train.batch_tokens=32768 --set train.lr=2e-3; keep /tmp/b32k b32k
    [ -d /tmp/b32k/draft ] && CUDA_VISIBLE_DEVICES=1 job b32k_decode_sharegpt python3 bench/bench_decode.py \
      --draft /tmp/b32k/draft --prompts sharegpt --limit 80 --k 3,7 --max-new-tokens 256 --budget 60 \
      --hf-budget 15 --out $S/b32k_decode_sharegpt.json ) &
  wait
elif [ $mode = multiturn ]; then
  m=/tmp/mt; mt="--set regen.limit=20000 --set regen.turns=${MT_TURNS:-2}"
  job mt_regen torchrun --standalone --nproc_per_node 2 -m eyas regen --out $m $mt
  touch $S/gpus_free
  CUDA_VISIBLE_DEVICES=0 job mt_pipeline python3 -m eyas run --out $m $mt
  keep $m mt
  if [ -d $m/draft ]; then  # the target's norms unfused and fused (FastLM.fused_norm), side by side
    CUDA_VISIBLE_DEVICES=0 job mt_decode_sharegpt python3 bench/bench_decode.py --draft $m/draft --prompts sharegpt \
      --limit 80 --k 3,7 --max-new-tokens 256 --budget 40 --skip-hf --norm 0,1 --out $S/mt_decode_sharegpt.json
    CUDA_VISIBLE_DEVICES=0 job mt_decode_humaneval python3 bench/bench_decode.py --draft $m/draft --prompts humaneval \
      --limit 40 --k 3,7 --max-new-tokens 256 --budget 30 --skip-hf --out $S/mt_decode_humaneval.json
  fi
elif [ $mode = big ]; then
  while [ ! -f $S/gpus_free ]; do sleep 5; done
  b=/tmp/bigrun
  CUDA_VISIBLE_DEVICES=0 job big_pipeline python3 -m eyas run --out $b ${BIG_ARGS:---set regen.limit=20000}
  keep $b big
  if [ -d $b/draft ]; then
    CUDA_VISIBLE_DEVICES=0 job big_decode_sharegpt python3 bench/bench_decode.py --draft $b/draft --prompts sharegpt \
      --limit 80 --k 3,7 --max-new-tokens 256 --budget 60 --skip-hf --out $S/big_decode_sharegpt.json
  fi
elif [ $mode = qwen ]; then
  # QGPU (default 0): the GPU it runs on; QWEN_EXTRACT=1 adds the extraction benchmark; TAIL_BENCH=1 then runs,
  # on the same GPU, the GPU tests, regen with overlap=1 / norm=1 against the default, and the extraction steps
  g=${QGPU:-0}
  while [ ! -f $S/gpus_free ]; do sleep 5; done
  while [ ! -f ~/eyas-stage/qwen2.5-coder-0.5b-instruct.gguf ]; do sleep 5; done  # its pieces may still arrive
  q=/tmp/qrun
  CUDA_VISIBLE_DEVICES=$g job qwen_pipeline python3 -m eyas run --preset qwen-coder-0.5b --out $q \
    --set regen.limit=${QWEN_LIMIT:-10000} --set regen.turns=1 --set train.epochs=${QWEN_EPOCHS:-8}
  keep $q qwen
  [ -n "${QWEN_EXTRACT:-}" ] && CUDA_VISIBLE_DEVICES=$g job qwen_extract python3 bench/bench_extract.py \
    --target qwen-coder-0.5b --sequences 2000 --out $S/qwen_extract.json
  if [ -d $q/draft ]; then
    CUDA_VISIBLE_DEVICES=$g job qwen_decode_humaneval python3 bench/bench_decode.py --target qwen-coder-0.5b \
      --draft $q/draft --prompts humaneval --limit 40 --k 3,7 --max-new-tokens 256 --budget 30 --hf-budget 15 \
      --out $S/qwen_decode_humaneval.json
    CUDA_VISIBLE_DEVICES=$g job qwen_decode_sharegpt python3 bench/bench_decode.py --target qwen-coder-0.5b \
      --draft $q/draft --prompts sharegpt --limit 40 --k 3,7 --max-new-tokens 256 --budget 30 --skip-hf \
      --out $S/qwen_decode_sharegpt.json
  fi
  if [ -n "${TAIL_BENCH:-}" ]; then
    CUDA_VISIBLE_DEVICES=$g job gputests python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fastlm.py \
      tests/test_ttt.py tests/test_regen.py
    CUDA_VISIBLE_DEVICES=$g job regen_bench python3 bench/bench_regen.py --prompts 1024 --batch-size 256 \
      --max-new-tokens 256 --baseline-batches 2 --out $S/regen_bench.json \
      --engine static,static:overlap=1,static:norm=1,static:norm=1:overlap=1,static
    CUDA_VISIBLE_DEVICES=$g job smol_extract python3 bench/bench_extract.py --target smollm2 --sequences 2000 \
      --out $S/smol_extract.json
  fi
fi
touch $S/finished_$tag
