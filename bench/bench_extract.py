"""Benchmark `eyas extract` against the target's plain forward on the same batches, in one run.

    PYTHONPATH=. python3 bench/bench_extract.py --target smollm2 --sequences 2000 --out results.json
    PYTHONPATH=. python3 bench/bench_extract.py --target qwen-coder-0.5b --sequences 2000 --out qwen.json

Measures, over the same length-sorted token-budget batches:
  forward_tok_s    model(input_ids).logits (what a user's plain prefill costs), torch's default attention
                   (cuDNN on an H200) with its per-shape plans built in a first pass: the strictest baseline
  forward_no_cudnn_tok_s  the same forward with the attention kernels the captures use (no cuDNN)
  capture_tok_s    the aux+final capture alone (no copy to the host, no disk)
  extract_tok_s    the whole extraction (bf16 and fp8): capture, quantize, copy to host, write shards, with
                   where its time went (`timing`: pinning buffers, the main thread waiting for a free
                   buffer, the final drain, and the writer threads' summed GPU-wait, write and hash seconds)
  steps_tok_s      the extraction's GPU loop built up one step at a time, each timed over all batches:
                   capture; + the real tokens picked out (index_select); + the target's top id (lm_head and
                   argmax); + fp8 quantization; + the copies into pinned host memory (no writing): where the
                   gap between capture and extract_fp8 lies
  disk             the same number of bytes as the bf16 shards written by plain 256 MiB writes (GB/s into
                   the page cache, and with an fsync at the end): the disk's own bound
and bytes/token on disk for bf16 and fp8, and the draft-vocabulary coverage at --vocab-size over
the loss-masked tokens of the same sequences. Token counts are real (unpadded) tokens.
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from eyas.config import PRESETS, TargetConfig, preset
from eyas.data import read_dataset
from eyas.data.prepare import TokenSet, tokens_dir
from eyas.data.tokenize import tokenize_conversation
from eyas.engine.fastlm import one_off_kernels
from eyas.features import (MAX_SHARD_BYTES, bytes_per_token, extract_split, plan_batches, plan_shards, quantize_fp8,
                           target_top)
from eyas.features.extract import _pad_batch
from eyas.target import load_target
from eyas.util import atomic_write_json
from eyas.vocab import choose_vocab, count_tokens, required_token_ids


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def tokenize(target, n: int, max_len: int) -> TokenSet:
    convs, _ = read_dataset("sharegpt")
    items = []
    for c in convs:
        if not c.turns or c.turns[0].role != "user":
            continue
        t = tokenize_conversation(target.tokenizer, c, max_len, "keep", target.eot_token_ids)
        if sum(t.loss_mask):
            items.append(t)
        if len(items) == n:
            break
    return TokenSet.from_tokenized(items)


def batches_of(tokens: TokenSet, batch_tokens: int, shard_tokens: int) -> list[list[int]]:
    """The forwards a one-process bf16 extraction runs: its shards (features.plan_shards), each cut into
    token-budget batches (features.plan_batches), so the baselines run the very same batch shapes."""
    lengths = tokens.lengths().tolist()
    out = []
    for shard in plan_shards(lengths, 1, shard_tokens)[0]:
        out += [shard[a:b] for a, b in plan_batches([lengths[i] for i in shard], batch_tokens)]
    return out


def timed(fn, batches, tokens: TokenSet, dev) -> float:
    """Real tokens per second of fn(batch) over all batches (after one warm-up batch)."""
    pin = dev.type == "cuda"
    fn(_pad_batch(tokens, batches[0], pin)[0].to(dev))
    sync(dev)
    t0 = time.perf_counter()
    n = 0
    with torch.inference_mode():
        for b in batches:
            x, lens = _pad_batch(tokens, b, pin)
            fn(x.to(dev, non_blocking=True))
            n += sum(lens)
    sync(dev)
    return n / (time.perf_counter() - t0)


def data_args(ap: argparse.ArgumentParser) -> None:
    """The target, the sequences and the batch budget (shared with bench/profile_extract_first.py)."""
    ap.add_argument("--target", default="smollm2", help="an eyas target (smollm2, qwen-coder-0.5b, an HF folder); with "
                    "--random-target, the one whose tokenizer and data settings it takes")
    ap.add_argument("--random-target", default="", metavar="SHAPE",
                    help="time a target of random weights drawn in memory instead (no checkpoint on disk, for "
                         "shapes larger than the disk): a config.json (bench/random_target.py --shape-only writes "
                         "one) or a bench_decode.py --random-target shape; its vocabulary is --target's tokenizer's")
    ap.add_argument("--sequences", type=int, default=2000, help="ShareGPT conversations to tokenize and extract")
    ap.add_argument("--max-seq-len", type=int, default=2048, help="tokens per conversation at most")
    ap.add_argument("--batch-tokens", type=int, default=32768, help="padded tokens per forward (features.batch_tokens)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data_args(ap)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--writer-variants", default="",
                    help="more bf16/fp8 extractions with the shard writers changed, comma-separated: e.g. "
                         "bf16:hash=0,bf16:write=0,bf16:hash=0:write=0,bf16:threads=8 (see extract_once)")
    ap.add_argument("--profile", action="store_true",
                    help="also run one bf16 extraction under the torch profiler and print its top ops")
    ap.add_argument("--workdir", default="", help="where shards are written (default: a temp folder, removed)")
    ap.add_argument("--out", default="results.json")
    args = ap.parse_args()

    if args.random_target:
        from bench_decode import random_target

        target = random_target(args.random_target, args.target)
    else:
        target = load_target(TargetConfig(name=args.target))
    dev = target.device
    t0 = time.perf_counter()
    tokens = tokenize(target, args.sequences, args.max_seq_len)
    t_tok = time.perf_counter() - t0
    shard_tokens = preset(args.target if args.target in PRESETS else "smollm2").features.shard_tokens
    shard_tokens = max(1, min(shard_tokens, MAX_SHARD_BYTES // bytes_per_token(target.hidden_size, "bf16")))
    batches = batches_of(tokens, args.batch_tokens, shard_tokens)
    model = target.model

    def forward(x):
        return model(input_ids=x, use_cache=False).logits

    def forward_no_cudnn(x):
        with one_off_kernels(dev):
            return forward(x)

    def capture(x):
        return target.capture(x)

    name = target.name if args.random_target else args.target
    res = {"target": name, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "dtype": str(target.dtype).replace("torch.", ""), "torch": torch.__version__,
           "sequences": len(tokens), "tokens": tokens.n_tokens, "batch_tokens": args.batch_tokens,
           "batches": len(batches), "tokenize_s": round(t_tok, 1),
           "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    # alternate plain forward and capture twice; keep the best of each (same batches, same run). The plain
    # forward takes torch's default attention (cuDNN on an H200), its plans built in the first pass, so its
    # best is the strictest baseline; captures avoid cuDNN (eyas.target.CAPTURE_WITHOUT_CUDNN), and so does
    # forward_no_cudnn_tok_s, the plain forward under the same kernel choice
    fw, fw1, cap = [], [], []
    for _ in range(2):
        fw.append(timed(forward, batches, tokens, dev))
        fw1.append(timed(forward_no_cudnn, batches, tokens, dev))
        cap.append(timed(capture, batches, tokens, dev))
    res["forward_tok_s"], res["forward_no_cudnn_tok_s"], res["capture_tok_s"] = max(fw), max(fw1), max(cap)

    res["steps_tok_s"] = loop_steps(target, batches, tokens, dev)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="eyas-bench-"))
    try:
        for dtype in ("bf16", "fp8"):
            dt, info, man = extract_once(args, target, tokens, work / dtype, dtype)
            res[f"extract_{dtype}_tok_s"] = tokens.n_tokens / dt
            res[f"extract_{dtype}_s"] = round(dt, 2)
            res[f"bytes_per_token_{dtype}"] = round(man["bytes_per_token_measured"], 1)
            res[f"shards_{dtype}"] = man["shards"]
            res[f"timing_{dtype}"] = info.get("timing")
        res["writer_variants"] = {}
        for v in [v for v in args.writer_variants.split(",") if v]:
            dtype, *opts = v.split(":")
            dt, info, _ = extract_once(args, target, tokens, work / "variant", dtype, dict(o.split("=") for o in opts))
            res["writer_variants"][v] = {"tok_s": round(tokens.n_tokens / dt, 1), "seconds": round(dt, 2),
                                         "vs_forward": round(tokens.n_tokens / dt / res["forward_tok_s"], 3),
                                         "timing": info.get("timing")}
            print(f"extract {v}: {tokens.n_tokens / dt:,.0f} tok/s ({dt:.2f} s) {info.get('timing')}", flush=True)
        if args.profile:  # one more bf16 extraction under the torch profiler: where the host's time goes
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with profile(activities=acts) as prof:
                extract_once(args, target, tokens, work / "profiled", "bf16")
            for key in ("self_cpu_time_total", "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"):
                print(prof.key_averages().table(sort_by=key, row_limit=25), flush=True)
        res["disk"] = disk_write(work, res["tokens"] * res["bytes_per_token_bf16"])
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    for dtype in ("bf16", "fp8"):
        res[f"extract_{dtype}_vs_forward"] = res[f"extract_{dtype}_tok_s"] / res["forward_tok_s"]
    res["capture_vs_forward"] = res["capture_tok_s"] / res["forward_tok_s"]

    counts = count_tokens(tokens, target.vocab_size)
    size = min(args.vocab_size, target.vocab_size)
    keep = choose_vocab(counts, size, required_token_ids(target, counts))
    res["vocab"] = {"size": size, "target_vocab": target.vocab_size, "loss_tokens": int(counts.sum()),
                    "coverage": float(counts[keep].sum()) / float(counts.sum()),
                    "data": "ShareGPT assistant turns (not regenerated)"}

    rows = [("plain forward (logits)", res["forward_tok_s"], 1.0),
            ("plain forward, no cuDNN", res["forward_no_cudnn_tok_s"], res["forward_no_cudnn_tok_s"] / res["forward_tok_s"]),
            ("capture only (aux+final)", res["capture_tok_s"], res["capture_vs_forward"]),
            ("extract bf16 -> shards", res["extract_bf16_tok_s"], res["extract_bf16_vs_forward"]),
            ("extract fp8 -> shards", res["extract_fp8_tok_s"], res["extract_fp8_vs_forward"])]
    print(f"\n{name} on {res['device']}: {res['sequences']} sequences, {res['tokens']:,} tokens, "
          f"{res['batches']} batches of <= {args.batch_tokens} tokens")
    print(f"{'':28}{'tok/s':>14}{'vs forward':>12}")
    for name, v, r in rows:
        print(f"{name:28}{v:14,.0f}{100 * r:11.1f}%")
    print("the extraction loop step by step (tok/s): " + ", ".join(f"{k} {v:,.0f}" for k, v in res["steps_tok_s"].items()))
    print(f"bytes/token: bf16 {res['bytes_per_token_bf16']}, fp8 {res['bytes_per_token_fp8']}")
    for dtype in ("bf16", "fp8"):
        print(f"extract {dtype}, seconds: {res[f'extract_{dtype}_s']} in all; {res[f'timing_{dtype}']}")
    dk = res["disk"]
    print(f"the disk alone: {dk['gb']:.1f} GB in {dk['seconds']:.1f} s = {dk['gb_per_s']:.2f} GB/s with fsync, "
          f"{dk['before_fsync_gb_per_s']:.2f} GB/s into the page cache; bf16 extraction needs {res['forward_tok_s'] * res['bytes_per_token_bf16'] / 1e9:.2f} GB/s "
          f"to keep up with the forward")
    print(f"draft vocab {size:,} of {target.vocab_size:,}: coverage {100 * res['vocab']['coverage']:.2f}% "
          f"of {res['vocab']['loss_tokens']:,} trained-on tokens")
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


def extract_once(args, target, tokens: TokenSet, run: Path, dtype: str, opts: dict | None = None):
    """One timed extract_split into a fresh `run` folder (removed after); opts change the shard writers for
    this run only: threads=N writer threads, hash=0 no sha256, write=0 nothing written to the files (empty
    files: the rest of the work, including the wait for the GPU's copies, is the same); and cudnn=1 lets
    the captures use cuDNN's attention (after the baselines, whose plain forwards planned these shapes);
    fresh=1 empties torch's cache of pinned host memory first, so this run pins its shard buffers anew as a
    process's first extraction does (later runs otherwise reuse the first one's), and bg=0 pins them all on
    the main thread before the loop, as eyas did before the background pinning (eyas.features.shards._ShardBuffers)."""
    import eyas.features.extract as F  # where the extraction looks up its writer threads and buffers
    import eyas.features.shards as FS  # where the shard writer looks up write_safetensors

    opts = opts or {}
    shutil.rmtree(run, ignore_errors=True)
    d = tokens_dir(run)
    tokens.save(d / "train.safetensors")
    atomic_write_json(d / "meta.json", {"train_ids": tokens.ids, "val_ids": []})
    cfg = preset(args.target if args.target in PRESETS else "smollm2")
    cfg.out = str(run)
    cfg.features.dtype = dtype
    cfg.features.batch_tokens = args.batch_tokens
    import eyas.target as T

    saved = F.writer_threads, FS.write_safetensors, T.CAPTURE_WITHOUT_CUDNN, F._ShardBuffers
    if opts.get("bg", "1") == "0":
        class MainThreadBuffers(saved[3]):
            def __init__(self, n_tokens, hidden, dtype, pin, count=3, device=None):
                super().__init__(n_tokens, hidden, dtype, pin, count=1, device=device)
                for _ in range(count - 1):
                    self.put(self._new())
        F._ShardBuffers = MainThreadBuffers
    if opts.get("fresh", "0") == "1" and target.device.type == "cuda":  # nothing is pinned elsewhere
        empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
        if empty is None:
            raise SystemExit("fresh=1: this torch has no way to empty its pinned-memory cache")
        gc.collect()
        empty()
    if opts.get("cudnn", "0") == "1":  # torch's default attention choice in the captures (cuDNN on an H200)
        T.CAPTURE_WITHOUT_CUDNN = False
    if "threads" in opts:
        F.writer_threads = lambda: int(opts["threads"])
    if opts.get("hash", "1") == "0" or opts.get("write", "1") == "0":
        FS.write_safetensors = lambda path, tensors, meta, times=None: saved[1](
            path, tensors, meta, times, hash_data=opts.get("hash", "1") != "0", write_data=opts.get("write", "1") != "0")
    dev = target.device
    try:
        sync(dev)
        t0 = time.perf_counter()
        info = extract_split(cfg, target, "train")
        sync(dev)
        dt = time.perf_counter() - t0
    finally:
        F.writer_threads, FS.write_safetensors, T.CAPTURE_WITHOUT_CUDNN, F._ShardBuffers = saved
    man = json.loads((Path(info["dir"]) / "manifest.json").read_text())
    shutil.rmtree(run, ignore_errors=True)
    return dt, info, man


def loop_steps(target, batches, tokens: TokenSet, dev) -> dict:
    """The extraction loop (eyas.features.extract._extract_shard) built up step by step, tok/s of each prefix."""
    lm_head = target.model.get_output_embeddings()
    H = target.hidden_size
    pin = dev.type == "cuda"
    most = max(sum(int(tokens.offsets[i + 1] - tokens.offsets[i]) for i in b) for b in batches)
    host = {"aux": torch.empty(most, 3 * H, dtype=torch.float8_e4m3fn, pin_memory=pin),
            "final": torch.empty(most, H, dtype=torch.float8_e4m3fn, pin_memory=pin),
            "aux_s": torch.empty(most, 3, pin_memory=pin), "final_s": torch.empty(most, 1, pin_memory=pin),
            "top": torch.empty(most, dtype=torch.int32, pin_memory=pin)}
    lens_of = {id(b): [int(tokens.offsets[i + 1] - tokens.offsets[i]) for i in b] for b in batches}
    order = iter([])

    def make(upto: int):
        def fn(x):
            aux, final = target.capture(x)
            if upto < 2:
                return
            lens = next(order)
            T = x.shape[1]
            rows = torch.cat([torch.arange(L) + r * T for r, L in enumerate(lens)]).to(dev, non_blocking=True)
            aux = aux.reshape(-1, aux.shape[-1]).index_select(0, rows)
            final = final.reshape(-1, final.shape[-1]).index_select(0, rows)
            if upto < 3:
                return
            top = target_top(final, lm_head)
            if upto < 4:
                return
            aux, aux_s = quantize_fp8(aux, 3)
            final, final_s = quantize_fp8(final, 1)
            if upto < 5:
                return
            n = aux.shape[0]
            for k, v in (("aux", aux), ("final", final), ("aux_s", aux_s), ("final_s", final_s), ("top", top)):
                host[k][:n].copy_(v, non_blocking=True)
        return fn

    out = {}
    for upto, name in enumerate(("capture", "+index_select", "+top_id", "+fp8", "+copy_to_host"), 1):
        # timed() runs batches[0] once as a warm-up, then every batch: the lengths follow that order
        order = iter([lens_of[id(batches[0])]] + [lens_of[id(b)] for b in batches])
        out[name] = timed(make(upto), batches, tokens, dev)
    return out


def disk_write(folder: Path, nbytes: float, chunk: int = 256 << 20) -> dict:
    """The disk's own sustained write rate: as many bytes as the bf16 extraction wrote, in 256 MiB
    writes of one buffer, then fsync (so the page cache does not hide the disk), into `folder`."""
    import os

    buf = os.urandom(chunk)
    path = folder / "disk-write-test.bin"
    n = max(1, int(nbytes) // chunk)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(buf)
        f.flush()
        t_write = time.perf_counter() - t0
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    gb = n * chunk / 1e9
    return {"gb": gb, "seconds": round(dt, 2), "gb_per_s": round(gb / dt, 3),
            "before_fsync_gb_per_s": round(gb / t_write, 3)}


if __name__ == "__main__":
    main()
