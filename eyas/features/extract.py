"""`eyas extract`: the target's features for the train and val splits, written as shards (eyas.features.shards), each
process its share of a plan that depends only on the tokens, so a killed run redoes exactly the unfinished shards.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import Config
from ..data.prepare import TokenSet, ensure_tokens, load_tokens
from ..rope import target_rope
from ..target import load_target
from ..util import (EyasError, atomic_write_json, dist_barrier, dist_env, human_bytes, log, progress, read_json,
                    sha256_file, sha256_json)
from .online import plan_batches, target_top
from .shards import (FORMAT, MAX_SHARD_BYTES, STORE_DTYPES, _entry, _merge_index, _shard_matches, _shard_meta,
                     _shard_name, _ShardBuffers, _token_tensors, _Writer, bytes_per_token, features_dir, quantize_fp8,
                     writer_threads)


def plan_shards(lengths: list[int], world: int, shard_tokens: int) -> list[list[list[int]]]:
    """[rank][shard] -> sequence indices (longest first)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # sorted() is stable
    plans = []
    for r in range(world):
        shards, cur, cur_tok = [], [], 0
        for i in order[r::world]:
            if cur and cur_tok + lengths[i] > shard_tokens:
                shards.append(cur)
                cur, cur_tok = [], 0
            cur.append(i)
            cur_tok += lengths[i]
        if cur:
            shards.append(cur)
        plans.append(shards)
    return plans


def tokens_sha256(tokens: TokenSet) -> str:
    h = hashlib.sha256()
    h.update(tokens.offsets.contiguous().numpy().tobytes())
    h.update(tokens.input_ids.contiguous().numpy().tobytes())
    h.update(tokens.loss_mask.contiguous().numpy().tobytes())
    return h.hexdigest()


def _broadcast(obj):
    """Rank 0's `obj` on every process (the others pass None)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _pad_batch(tokens: TokenSet, seqs: list[int], pin: bool) -> tuple[torch.Tensor, list[int]]:
    lens = [int(tokens.offsets[i + 1] - tokens.offsets[i]) for i in seqs]
    batch = torch.zeros(len(seqs), max(lens), dtype=torch.long, pin_memory=pin)
    for r, (i, L) in enumerate(zip(seqs, lens)):
        a = int(tokens.offsets[i])
        batch[r, :L] = tokens.input_ids[a:a + L]
    return batch, lens


def _extract_shard(target, tokens: TokenSet, seqs: list[int], batch_tokens: int, dtype: str, buf: dict,
                   on_tokens, norm: str = "hf") -> int:
    """Run the target over one shard's sequences (already longest first), filling `buf`'s leading
    rows; returns the number of tokens. buf None: compute only (a tensor-parallel process other than
    rank 0, which takes part in every forward but writes nothing)."""
    dev = target.device
    pin = dev.type == "cuda"
    lm_head = target.model.get_output_embeddings()
    lens_all = [int(tokens.offsets[i + 1] - tokens.offsets[i]) for i in seqs]
    pos = 0
    for a, b in plan_batches(lens_all, batch_tokens):
        batch, lens = _pad_batch(tokens, seqs[a:b], pin)
        T = batch.shape[1]
        rows = torch.cat([torch.arange(L) + r * T for r, L in enumerate(lens)])
        aux, final = target.capture(batch.to(dev, non_blocking=True), norm=norm)
        rows = rows.to(dev, non_blocking=True)
        aux = aux.reshape(-1, aux.shape[-1]).index_select(0, rows)
        final = final.reshape(-1, final.shape[-1]).index_select(0, rows)
        n = aux.shape[0]
        top = target_top(final, lm_head)
        if buf is None:
            pos += n
            on_tokens(n)
            continue
        buf["top"][pos:pos + n].copy_(top, non_blocking=True)
        if dtype == "fp8":
            aux, aux_s = quantize_fp8(aux, 3)
            final, final_s = quantize_fp8(final, 1)
            buf["aux_scale"][pos:pos + n].copy_(aux_s, non_blocking=True)
            buf["final_scale"][pos:pos + n].copy_(final_s, non_blocking=True)
        sd = STORE_DTYPES[dtype]
        buf["aux"][pos:pos + n].copy_(aux.to(sd), non_blocking=True)
        buf["final"][pos:pos + n].copy_(final.to(sd), non_blocking=True)
        pos += n
        on_tokens(n)
    return pos


# plan keys added after manifests were first written, with the value an older manifest without them stands for
PLAN_DEFAULTS = {"norm": "hf"}


def _check_manifest(path: Path, want: dict) -> None:
    have = {**PLAN_DEFAULTS, **read_json(path)}
    want = {**PLAN_DEFAULTS, **want}
    diffs = [k for k in want if have.get(k) != want[k]]
    if have.get("source") != want.get("source") and "source" not in diffs:  # an engine's features, or not
        diffs.append("source")
    if not diffs:
        return
    if "target" in diffs:
        raise EyasError(f"{path}: these features belong to target {have.get('target', {}).get('name')} "
                        f"(sha256 {have.get('target', {}).get('sha256')}, aux layers "
                        f"{have.get('target', {}).get('aux_layers')}), not {want['target']['name']} "
                        f"(sha256 {want['target']['sha256']}, aux layers {want['target']['aux_layers']}); "
                        f"delete {path.parent} or use another --out")
    detail = ", ".join(f"{k}: {have.get(k)!r} -> {want.get(k)!r}" for k in diffs)
    raise EyasError(f"{path}: features were extracted with other settings ({detail}); finish them with the "
                    f"same settings, or delete {path.parent} to start over")


@dataclasses.dataclass
class _Share:
    """One process's share of a split's extraction: its shards (sequence indices, longest first) under the plan
    `plan_key`, in folder `d`."""
    split: str
    d: Path
    tokens: TokenSet
    lengths: list[int]
    rank: int
    world: int
    plan_key: str
    bpt: int  # bytes per token stored
    shards: list[list[int]]

    def tokens_of(self, ks) -> int:
        return sum(self.lengths[i] for k in ks for i in self.shards[k])


def extract_split(cfg: Config, target, split: str) -> dict:
    """Extract one split's features into <run>/features/<split>/ (this rank's share of them)."""
    run = Path(cfg.out)
    rank, world, _ = dist_env()
    tp_world = 0
    if cfg.target.tensor_parallel:  # one data-parallel rank: all processes run the same batches, rank 0 writes
        tp_world, writes, rank, world = world, rank == 0, 0, 1
    else:
        writes = True
    dtype = cfg.features.dtype
    tokens = load_tokens(run, split)
    d = features_dir(run, split)
    d.mkdir(parents=True, exist_ok=True)
    bpt = bytes_per_token(target.hidden_size, dtype)
    shard_tokens = max(1, min(cfg.features.shard_tokens, MAX_SHARD_BYTES // bpt))
    lengths = tokens.lengths().tolist()
    plans = plan_shards(lengths, world, shard_tokens)
    plan = {"format": FORMAT, "split": split, "target": target.identity(), "dtype": dtype,
            "hidden_size": target.hidden_size, "aux_layers": list(target.aux_layers),
            "tokens_sha256": tokens_sha256(tokens), "world_size": world, "shard_tokens": shard_tokens,
            # a key added later joins the plan only off its default, so older plans (and their keys) stay valid
            **{k: v for k, v in {"norm": cfg.features.norm}.items() if v != PLAN_DEFAULTS[k]}}
    plan_key = sha256_json(plan)[:16]
    manifest_path = d / "manifest.json"
    if manifest_path.exists():
        _check_manifest(manifest_path, plan)
    elif rank == 0 and writes:
        atomic_write_json(manifest_path, {**plan, "complete": False, "sequences": len(tokens),
                                          "tokens": tokens.n_tokens, "bytes_per_token": bpt,
                                          "estimated_bytes": tokens.n_tokens * bpt,
                                          **({"tensor_parallel": tp_world} if tp_world else {})})
    dist_barrier()
    share = _Share(split, d, tokens, lengths, rank, world, plan_key, bpt, plans[rank])
    if not writes:  # a tensor-parallel process: rank 0 says which shards to compute
        return _follow(cfg, target, share)
    prog_path = d / f"rank-{rank:03d}.json"
    done, todo = _unfinished(share, prog_path)
    # refuse before starting when the disk cannot hold the rest (all ranks write to this folder)
    need = share.tokens_of(todo) * bpt * world
    free = shutil.disk_usage(d).free
    if tp_world:
        _broadcast(todo if need <= free else [])  # the other tensor-parallel processes compute the same shards
    if need > free:
        raise EyasError(f"{d}: extracting the remaining features needs about {human_bytes(need)} "
                        f"({bpt:,} bytes/token, dtype {dtype}) but only {human_bytes(free)} is free; free space, "
                        f"use --dtype fp8 (about half of bf16), or point --out at a larger disk")

    lock = threading.Lock()

    def record(entry):
        with lock:
            done[entry["file"]] = entry
            atomic_write_json(prog_path, {"plan": plan_key, "rank": rank,
                                          "shards": sorted(done.values(), key=lambda e: e["shard"])})

    if not todo:
        atomic_write_json(prog_path, {"plan": plan_key, "rank": rank,
                                      "shards": sorted(done.values(), key=lambda e: e["shard"])})
    # where the time went (seconds): making (pinning) the first host buffer on the main thread and the others on
    # a background thread ("buffers_background_s", overlapping the loop), the main thread waiting for a free
    # buffer (still being pinned, or the writers are behind) or queueing a shard, its whole loop over the shards,
    # and the wait for the last writes at the end
    timing = {"buffers_s": 0.0, "wait_buffer_s": 0.0, "drain_s": 0.0}
    if todo:
        _write_shards(cfg, target, share, todo, record, timing)
    dist_barrier()
    if rank == 0:
        _merge_index(d, world, plan_key, len(plans), manifest_path)
    dist_barrier()
    return {"split": split, "sequences": sum(len(s) for s in share.shards),
            "tokens": share.tokens_of(range(len(share.shards))), "extracted_tokens": share.tokens_of(todo),
            "reused_shards": len(share.shards) - len(todo), "shards": len(share.shards),
            "dtype": dtype, "bytes_per_token": bpt, "dir": str(d),
            "timing": {k: round(v, 6) if isinstance(v, float) else v for k, v in timing.items()}}


def _follow(cfg: Config, target, share: _Share) -> dict:
    """A tensor-parallel process other than rank 0: it takes part in every forward of the shards rank 0 names, and
    writes nothing."""
    todo = _broadcast(None)
    with torch.inference_mode():
        for k in todo:
            _extract_shard(target, share.tokens, share.shards[k], cfg.features.batch_tokens, cfg.features.dtype,
                           None, lambda n: None, cfg.features.norm)
    dist_barrier()  # rank 0 merges the index between these two
    dist_barrier()
    return {"split": share.split, "sequences": 0, "tokens": 0, "shards": 0, "reused_shards": 0,
            "dtype": cfg.features.dtype, "extracted_tokens": share.tokens_of(todo), "bytes_per_token": share.bpt,
            "dir": str(share.d), "writes": False}


def _unfinished(share: _Share, prog_path: Path) -> tuple[dict[str, dict], list[int]]:
    """This rank's finished shards (entries with size and sha256, from its progress file and from shards written
    but not recorded when a run was killed) and the shards still to extract. Temporaries a killed run of this rank
    left behind are removed."""
    d, rank = share.d, share.rank
    done: dict[str, dict] = {}
    if prog_path.exists():
        prog = read_json(prog_path)
        if prog.get("plan") == share.plan_key:
            done = {e["file"]: e for e in prog.get("shards", [])}
    for pat in (f".shard-{rank:03d}-*.tmp", f".rank-{rank:03d}.json.*.tmp"):
        for stale in d.glob(pat):
            stale.unlink(missing_ok=True)
    todo = []
    for k, seqs in enumerate(share.shards):
        name = _shard_name(rank, k)
        p = d / name
        e = done.get(name)
        if e and p.exists() and p.stat().st_size == e["bytes"]:
            continue
        if p.exists() and _shard_matches(p, share.plan_key, seqs):  # written, but killed before it was recorded
            done[name] = _entry(rank, k, seqs, share.lengths) | {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            continue
        done.pop(name, None)
        todo.append(k)
    return done, todo


def _write_shards(cfg: Config, target, share: _Share, todo: list[int], record, timing: dict) -> None:
    """Extract shards `todo` of this rank's share into host buffers the writer threads save (`record` is told of
    each saved shard); `timing` gains where the time went."""
    dtype, d, rank, my = cfg.features.dtype, share.d, share.rank, share.shards
    pin = target.device.type == "cuda"
    threads = writer_threads()
    t0 = time.perf_counter()
    bufs = _ShardBuffers(max(share.tokens_of([k]) for k in todo), target.hidden_size, dtype, pin,
                         count=threads + 1, device=target.device)
    timing["buffers_s"] = time.perf_counter() - t0
    writer = _Writer(record, threads)
    timing["writer_threads"] = threads
    written = [0]
    bar = progress(total=share.tokens_of(todo), desc=f"extract {share.split}" + (
        f" rank {rank}" if share.world > 1 else ""), unit="tok", unit_scale=True,
        **({} if rank == 0 else {"disable": True}))
    sleep = float(os.environ.get("EYAS_DEBUG_SHARD_SLEEP", "0"))  # tests: make a run slow enough to kill
    t_loop = time.perf_counter()
    try:
        with torch.inference_mode():
            for k in todo:
                seqs = my[k]
                t0 = time.perf_counter()
                buf = bufs.get()
                timing["wait_buffer_s"] += time.perf_counter() - t0
                n = _extract_shard(target, share.tokens, seqs, cfg.features.batch_tokens, dtype, buf, bar.update,
                                   cfg.features.norm)
                tok = _token_tensors(share.tokens, seqs)
                tensors = {"offsets": tok["offsets"], "seq_index": tok["seq_index"],
                           **{key: v[:n] for key, v in buf.items()},
                           "input_ids": tok["input_ids"], "loss_mask": tok["loss_mask"]}
                event = None
                if pin:
                    event = torch.cuda.Event()
                    event.record()
                written[0] += n * share.bpt
                bar.set_postfix_str(f"{written[0] / 1e9:.2f} GB", refresh=False)
                t0 = time.perf_counter()
                writer.submit(d / _shard_name(rank, k), tensors, _shard_meta(share.plan_key, rank, k), event,
                              lambda b=buf: bufs.put(b), _entry(rank, k, seqs, share.lengths))
                timing["wait_buffer_s"] += time.perf_counter() - t0
                if sleep:
                    time.sleep(sleep)
    finally:
        t0 = time.perf_counter()
        timing["loop_s"] = t0 - t_loop  # queueing every shard (the GPU may still be busy with the last)
        try:
            writer.close()
        finally:
            timing["drain_s"] = time.perf_counter() - t0
            timing.update(writer.times)
            bufs.join()
            timing["buffers_background_s"] = bufs.background_s
            bar.close()


def run_extract(cfg: Config, target=None) -> dict:
    """`eyas extract`: capture the target's aux and final hidden states for the train and val
    splits into feature shards. Under torchrun each rank extracts its share on its own GPU."""
    if cfg.features.from_vllm:  # the stage's entry hands this to eyas.engine_features (pipeline.stage_spec)
        raise EyasError("features.from_vllm: the features are read from vLLM by eyas.engine_features."
                        "run_engine_extract, not extracted here")
    rank, world, local = dist_env()
    own_pg = False
    if world > 1:
        if not dist.is_initialized():
            # gloo for the barriers and broadcasts; a tensor-parallel target on GPUs also needs NCCL
            tp_gpu = cfg.target.tensor_parallel and torch.cuda.is_available() and cfg.target.device != "cpu"
            dist.init_process_group(backend="cpu:gloo,cuda:nccl" if tp_gpu else "gloo")
            own_pg = True
    try:
        if target is None:
            tcfg = cfg.target
            if world > 1 and torch.cuda.is_available() and tcfg.device in ("auto", "cuda"):
                torch.cuda.set_device(local)
                tcfg = dataclasses.replace(tcfg, device=f"cuda:{local}")
            target = load_target(tcfg, allow_tp=True)
        if not cfg.train.finetune_from:  # features for a drafter that cannot be built would be wasted
            target_rope(target.config, f"target '{cfg.target.name}'")
        if rank == 0:  # made now if missing; refused if made from other data or given settings (ensure_tokens)
            ensure_tokens(cfg, target)
        dist_barrier()
        t0 = time.perf_counter()
        splits = [extract_split(cfg, target, s) for s in ("train", "val")]
        dt = time.perf_counter() - t0
        extracted = sum(s["extracted_tokens"] for s in splits)
        res = {"rank": rank, "world_size": world, "dtype": cfg.features.dtype, "splits": splits,
               "seconds": round(dt, 2), "tokens_per_s": round(extracted / dt, 1) if dt > 0 else None}
        if rank == 0:
            log(f"extract: {sum(s['tokens'] for s in splits):,} tokens on rank 0 "
                f"({extracted:,} extracted now) at {res['tokens_per_s']} tok/s into {Path(cfg.out) / 'features'}")
        return res
    finally:
        if own_pg:
            dist.destroy_process_group()
