"""The train stage: EAGLE-3 drafter training with training-time test, on one process or many.

One code path for 1 and N processes (torchrun: gloo on CPU, NCCL on GPU). With more than one process the
drafter is wrapped in DDP, sharded by FSDP2 (`train.parallel=fsdp`), or, where the step runs as CUDA graphs
(`train.cuda_graph`, the GPU default), left whole while `stepgraph.AccumGraph` sums the gradients with one
all-reduce between its graphs. Each optimizer step takes a *group* of
`world × grad_accum` packed micro-batches; rank r trains on micro-batches r·A .. r·A+A-1 of it.
The loss of every TTT step is normalised by the number of loss-masked positions of the whole
group (computed from the token data, known to every rank), so the update is the same for any
split of a group over processes and micro-batches.

Run directory: `ckpt/step-NNNNNNN/` (model.safetensors, optim.safetensors, state.json) and
`ckpt/latest.json` written atomically; `ckpt/best.json` + `draft/` (the drafter with the best
validation simulated acceptance length, written with save_drafter); `train/metrics.jsonl`,
`train/curves.png`, `train/tb/` (TensorBoard, when it is installed). A killed run started again
with the same command continues from the last checkpoint and, on the CPU, repeats the same losses. On one
process, Ctrl-C or SIGTERM lets the step under way finish and saves a checkpoint there before stopping.
"""
from .drafter_init import finetune_source
from .stage import check_train_settings, run_train

__all__ = ["check_train_settings", "finetune_source", "run_train"]
