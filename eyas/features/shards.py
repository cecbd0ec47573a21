"""Offline feature shards: the on-disk format `eyas extract` writes and OfflineFeatures reads, the fp8 storage, and the
shard writer (host buffers the GPU copies into, writer threads that save and hash each shard).
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..data.prepare import TokenSet
from ..util import EyasError, atomic_path, atomic_write_json, read_json


# --------------------------------------------------------------------------------------------
# Offline features: `eyas extract` writes shards, OfflineFeatures reads them.
#
# <run>/features/<split>/
#   manifest.json          target identity, aux layers, dtype, plan, counts, bytes per token
#   index.json             every shard: file, rank, sequences, tokens, bytes, sha256 (rank 0 merges)
#   rank-RRR.json          one rank's finished shards (progress; resume reads it)
#   shard-RRR-KKKKK.safetensors
#       input_ids int32 [N], loss_mask uint8 [N], offsets int64 [n+1] (into the shard's tokens),
#       seq_index int64 [n] (sequence index in the split's TokenSet),
#       aux [N, 3H], final [N, H] in the stored dtype (bf16 | fp32 | fp8 e4m3),
#       fp8 only: aux_scale float32 [N, 3], final_scale float32 [N, 1] (one scale per token and layer)
#
# Plan: sequences are sorted by length (longest first, stable) and dealt round-robin to the
# ranks; each rank cuts its list into shards of at most `shard_tokens` tokens and each shard into
# forward passes of at most `batch_tokens` padded tokens. The plan depends only on the tokens,
# the world size and the shard size, so a killed run redoes exactly the unfinished shards.
# --------------------------------------------------------------------------------------------

FORMAT = "eyas-features-1"
STORE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MAX_SHARD_BYTES = 256 << 20  # a shard stays under ~256 MiB whatever shard_tokens says (short tail, small buffers)


def writer_threads() -> int:
    """Threads that save shards: half the cores, 2 to 4 (each writes and hashes one shard at a time)."""
    return max(2, min(4, (os.cpu_count() or 2) // 2))


def quantize_fp8(x: torch.Tensor, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, layers*H] -> (q float8_e4m3fn [N, layers*H], scale float32 [N, layers]); each token's
    slice of each layer is scaled so its largest magnitude maps to 448."""
    N = x.shape[0]
    xs = x.float().view(N, layers, -1)
    scale = xs.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    q = (xs / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(N, -1), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    N, L = scale.shape
    return (q.float().view(N, L, -1) * scale.float().unsqueeze(-1)).view(N, -1).to(dtype)


def bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Stored bytes per token: 3 aux + 1 final state, fp8 scales, plus the token id, the target's
    top id and the loss mask."""
    elems = 4 * hidden_size
    per = {"bf16": 2 * elems, "fp32": 4 * elems, "fp8": elems + 4 * 4}[dtype]
    return per + 4 + 4 + 1


def features_dir(run_dir: str | Path, split: str = "train") -> Path:
    return Path(run_dir) / "features" / split


class _ShardBuffers:
    """Host buffers the GPU copies into (pinned on CUDA) and the writer threads save from; one
    more than there are writer threads, so the target computes the next shard while others are written.

    The first buffer is made at once, the others on a background thread: pinning is slow, and the first shard
    needs only one buffer (the thread's pinning can stall the loop about as long as it saves, so the gain is
    small). `get` hands out a free buffer, waiting for one if none is; `put` returns it."""

    def __init__(self, n_tokens: int, hidden: int, dtype: str, pin: bool, count: int = 3,
                 device: torch.device | None = None):
        self.free: queue.Queue = queue.Queue()
        self._spec = (n_tokens, hidden, dtype, pin)
        # the process's GPU, made current on the background thread (a new thread starts on GPU 0); None off the GPU
        self._device = device if pin and device is not None and device.type == "cuda" else None
        self.error: BaseException | None = None
        self.background_s = 0.0  # seconds the background thread spent making (pinning) buffers
        self.free.put(self._new())
        self._filler = None
        if count > 1:
            self._filler = threading.Thread(target=self._fill, args=(count - 1,), daemon=True)
            self._filler.start()

    def _new(self) -> dict:
        n_tokens, hidden, dtype, pin = self._spec
        sd = STORE_DTYPES[dtype]
        b = {"aux": torch.empty(n_tokens, 3 * hidden, dtype=sd, pin_memory=pin),
             "final": torch.empty(n_tokens, hidden, dtype=sd, pin_memory=pin),
             "top": torch.empty(n_tokens, dtype=torch.int32, pin_memory=pin)}
        if dtype == "fp8":
            b["aux_scale"] = torch.empty(n_tokens, 3, dtype=torch.float32, pin_memory=pin)
            b["final_scale"] = torch.empty(n_tokens, 1, dtype=torch.float32, pin_memory=pin)
        return b

    def _fill(self, n: int) -> None:
        t0 = time.perf_counter()
        try:
            if self._device is not None:
                torch.cuda.set_device(self._device)
            for _ in range(n):
                self.free.put(self._new())
        except BaseException as e:  # raised by get() on the main thread when it runs out of buffers
            self.error = e
        finally:
            self.background_s = time.perf_counter() - t0

    def get(self) -> dict:
        while True:
            try:
                return self.free.get(timeout=0.2)
            except queue.Empty:
                if self.error is not None:
                    raise self.error

    def put(self, b: dict) -> None:
        self.free.put(b)

    def join(self) -> None:
        if self._filler is not None:
            self._filler.join()


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                      times: dict | None = None, hash_data: bool = True, write_data: bool = True) -> tuple[int, str]:
    """Write a safetensors file straight from the (pinned) host buffers, hashing as it goes:
    no serialized copy, and file writes and hashing release the GIL, so several writer threads
    run in parallel. Tensors are laid out in the order given; returns (bytes, sha256). `times`, when
    given, gains the seconds spent writing ("write_s") and hashing ("hash_s"). hash_data / write_data
    False leave the hashing / the writes out (bench/bench_extract.py, to see what each costs: the file
    is then not a valid shard)."""
    header: dict = {}
    off = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = metadata
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    h = hashlib.sha256()
    size = 0
    t_write = t_hash = 0.0
    with atomic_path(path, 8 + len(hb) + off) as tmp:
        with open(tmp, "wb") as f:
            for chunk in [struct.pack("<Q", len(hb)), hb,
                          *(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for t in tensors.values())]:
                t0 = time.perf_counter()
                if write_data:
                    f.write(chunk)
                t1 = time.perf_counter()
                if hash_data:
                    h.update(chunk)
                t_hash += time.perf_counter() - t1
                t_write += t1 - t0
                size += len(chunk)
    if times is not None:
        times["write_s"] = times.get("write_s", 0.0) + t_write
        times["hash_s"] = times.get("hash_s", 0.0) + t_hash
    return size, h.hexdigest()


class _Writer:
    """Saves shards on background threads (atomic rename), then reports each finished shard.
    `times` sums, over all threads, the seconds spent waiting for the GPU's copies ("gpu_wait_s"),
    writing ("write_s") and hashing ("hash_s")."""

    def __init__(self, on_done, threads: int = 2):
        self.q: queue.Queue = queue.Queue(maxsize=threads)
        self.on_done = on_done
        self.error: BaseException | None = None
        self.times: dict[str, float] = {"gpu_wait_s": 0.0, "write_s": 0.0, "hash_s": 0.0}
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _loop(self):
        while (item := self.q.get()) is not None:
            path, tensors, meta, event, release, entry = item
            try:
                if self.error is None:
                    mine: dict[str, float] = {}
                    if event is not None:
                        t0 = time.perf_counter()
                        event.synchronize()
                        mine["gpu_wait_s"] = time.perf_counter() - t0
                    size, digest = write_safetensors(path, tensors, meta, mine)
                    with self._lock:
                        for k, v in mine.items():
                            self.times[k] += v
                    entry.update(bytes=size, sha256=digest)
                    self.on_done(entry)
            except BaseException as e:  # reported on the main thread
                self.error = e
            finally:
                release()

    def submit(self, *item):
        self.check()
        self.q.put(item)

    def check(self):
        if self.error is not None:
            raise self.error

    def close(self):
        for _ in self.threads:
            self.q.put(None)
        for t in self.threads:
            t.join()
        self.check()


def _shard_name(rank: int, k: int) -> str:
    return f"shard-{rank:03d}-{k:05d}.safetensors"


def _entry(rank: int, k: int, seqs: list[int], lengths: list[int]) -> dict:
    return {"file": _shard_name(rank, k), "rank": rank, "shard": k, "sequences": len(seqs),
            "tokens": sum(lengths[i] for i in seqs)}


def _token_tensors(tokens: TokenSet, seqs: list[int]) -> dict[str, torch.Tensor]:
    ids, masks, lens = [], [], []
    for i in seqs:
        a, b = int(tokens.offsets[i]), int(tokens.offsets[i + 1])
        ids.append(tokens.input_ids[a:b])
        masks.append(tokens.loss_mask[a:b])
        lens.append(b - a)
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.long), 0)
    return {"input_ids": torch.cat(ids).to(torch.int32), "loss_mask": torch.cat(masks).to(torch.uint8),
            "offsets": offsets, "seq_index": torch.tensor(seqs, dtype=torch.long)}


def _shard_matches(path: Path, plan_key: str, seqs: list[int]) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("eyas", "{}"))
            return meta.get("plan") == plan_key and f.get_tensor("seq_index").tolist() == seqs
    except (SafetensorError, OSError, ValueError):
        return False


def _shard_meta(plan_key: str, rank: int, k: int) -> dict[str, str]:
    # one key: safetensors writes its metadata map in an arbitrary order, which would make
    # otherwise identical shards differ byte for byte
    return {"eyas": json.dumps({"plan": plan_key, "rank": rank, "shard": k}, sort_keys=True)}


def _merge_index(d: Path, world: int, plan_key: str, n_ranks: int, manifest_path: Path) -> None:
    entries = []
    for r in range(n_ranks):
        prog = read_json(d / f"rank-{r:03d}.json")
        if prog.get("plan") != plan_key:
            raise EyasError(f"{d / f'rank-{r:03d}.json'}: progress of another extraction plan")
        entries += prog["shards"]
    index = {"format": FORMAT, "plan": plan_key, "shards": entries,
             "sequences": sum(e["sequences"] for e in entries), "tokens": sum(e["tokens"] for e in entries),
             "bytes": sum(e["bytes"] for e in entries)}
    atomic_write_json(d / "index.json", index)
    man = read_json(manifest_path)
    man.update(complete=True, shards=len(entries), bytes=index["bytes"],
               bytes_per_token_measured=index["bytes"] / max(1, index["tokens"]))
    atomic_write_json(manifest_path, man)
