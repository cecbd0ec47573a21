"""Target hidden-state features: the tensors the drafter trains on.

A feature sample for one tokenized sequence holds
    input_ids [T] (long), loss_mask [T] (bool),
    aux [T, 3·H_t]  the residual streams entering the aux layers, concatenated,
    final [T, H_t]  the target's last normed hidden state (lm_head(final) = target logits),
    top [T] (int32) the target's own next-token choice, argmax over its full vocabulary; computed
                    once here so training need not multiply by the full lm_head every epoch.
`OnlineFeatures` computes them from a target held in the process; offline shards (written by
`eyas extract`) yield the same tensors for the same sequences.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import Config
from .data.prepare import TokenSet
from .util import (EyasError, atomic_path, atomic_write_json, dist_barrier, dist_env, human_bytes, log, mem_available,
                   progress, read_json, sha256_file, sha256_json, to_device)


@dataclass
class Sample:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor
    top: torch.Tensor | None = None  # [T] int32; None for shards written before eyas stored it


@torch.no_grad()
def target_top(final: torch.Tensor, lm_head: torch.nn.Module, chunk: int = 4096) -> torch.Tensor:
    """The target's argmax token over its full vocabulary for final states [n, H] -> [n] int32, in
    row chunks so the full logits never exist all at once."""
    W = lm_head.weight
    x = final.reshape(-1, final.shape[-1])
    # the module, not its weight: under tensor parallelism its hooks gather the sharded logits
    out = [lm_head(x[i:i + chunk].to(W.dtype)).argmax(-1).to(torch.int32) for i in range(0, x.shape[0], chunk)]
    return (torch.cat(out) if out else torch.zeros(0, dtype=torch.int32, device=W.device)).view(final.shape[:-1])


@torch.no_grad()
def compute_features(target, seqs: list[torch.Tensor],
                     norm: str = "hf") -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One right-padded batch forward over `seqs` (1-D token tensors). With causal attention,
    padding on the right never changes the states of the real tokens, so no mask is needed.
    The batch is assembled on the host and sent in one copy. norm: the target's RMSNorm numerics
    (features.norm, Target.capture)."""
    if not seqs:
        return []
    T = max(len(s) for s in seqs)
    batch = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s.cpu()
    aux, final = target.capture(to_device(batch, target.device), norm=norm)
    top = target_top(final, target.model.get_output_embeddings())
    return [(aux[i, : len(s)], final[i, : len(s)], top[i, : len(s)]) for i, s in enumerate(seqs)]


class OnlineFeatures:
    """Features computed on the fly from the target, for sequence indices of a TokenSet.

    With `cache_bytes` > 0 the features of each sequence are kept (on the target's device) after
    their first computation, up to that many bytes, and later epochs read them instead of running the
    target again. Sequences that do not fit are computed every time."""

    def __init__(self, target, tokens: TokenSet, max_batch_tokens: int = 16384, cache_bytes: int = 0,
                 norm: str = "hf", host_bytes: int = 0):
        self.target = target
        self.norm = norm
        self.tokens = tokens
        self.max_batch_tokens = max_batch_tokens
        self.cache_bytes = max(0, int(cache_bytes))
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.cached_bytes = 0
        self.hits = self.misses = 0
        # what does not fit on the device: the host's memory (pinned under CUDA), copied over per batch
        self.device = torch.device(target.device)
        self.host = HostSlab(host_bytes, pin=self.device.type == "cuda")
        self.host_cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.host_hits = 0
        self.warm_tokens = 0  # tokens the last `warm` computed

    def __len__(self) -> int:
        return len(self.tokens)

    def cache_stats(self) -> dict:
        return {"limit_bytes": self.cache_bytes, "bytes": self.cached_bytes, "sequences": len(self.cache),
                "of": len(self.tokens), "hits": self.hits, "misses": self.misses,
                "host_limit_bytes": self.host.limit, "host_bytes": self.host.used,
                "host_sequences": len(self.host_cache), "host_hits": self.host_hits}

    def full(self) -> bool:
        return self.cached_bytes >= self.cache_bytes * 0.999 and self.host.used >= self.host.limit * 0.999

    def _keep(self, i: int, aux: torch.Tensor, final: torch.Tensor, top: torch.Tensor) -> bool:
        n = aux.numel() * aux.element_size() + final.numel() * final.element_size() + top.numel() * top.element_size()
        if self.cached_bytes + n <= self.cache_bytes:
            # copies, so the padded batch they were cut from can be freed
            self.cache[i] = (aux.clone(), final.clone(), top.clone())
            self.cached_bytes += n
            return True
        held = self.host.put((aux, final, top))
        if held is None:
            return False
        self.host_cache[i] = held
        return True

    def _cached(self, i: int):
        hit = self.cache.get(i)
        if hit is not None:
            return hit
        held = self.host_cache.get(i)
        if held is None:
            return None
        self.host_hits += 1
        # the slab is never written again, so the copies may run behind the host
        return tuple(t.to(self.device, non_blocking=True) for t in held)

    def _forwards(self, seqs: list[torch.Tensor], batch_tokens: int):
        """The target over `seqs` (1-D token tensors) longest first (stable), in forwards of at most
        `batch_tokens` padded tokens (`plan_batches`): yields each forward's positions in `seqs` and
        their (aux, final, top)."""
        order = sorted(range(len(seqs)), key=lambda k: -len(seqs[k]))
        for a, b in plan_batches([len(seqs[k]) for k in order], batch_tokens):
            group = order[a:b]
            yield group, compute_features(self.target, [seqs[k] for k in group], self.norm)

    def warm(self, indices: list[int], batch_tokens: int, keep: str = "shortest") -> int:
        """Compute and keep the features of `indices` before training, longest first in forwards of up to
        `batch_tokens` padded tokens (an extraction's batches, several times faster than a training batch's
        own small forwards); stops once the cache is full.
        keep (train.feature_cache_keep): which sequences the budgets hold when not all fit, the longest or the
        shortest. Returns the number of sequences kept; `warm_tokens` is the tokens the forwards computed."""
        todo = [i for i in dict.fromkeys(indices) if i not in self.cache and i not in self.host_cache]
        kept = 0
        self.warm_tokens = 0
        if keep == "shortest":
            todo, kept = self._shortest_that_fit(todo, batch_tokens)
        elif keep != "longest":
            raise ValueError(f"keep={keep!r}: longest or shortest")
        for group, feats in self._forwards([self.tokens[i][0] for i in todo], batch_tokens):
            kept += sum(self._keep(todo[j], *f) for j, f in zip(group, feats))
            self.misses += len(group)
            self.warm_tokens += sum(len(self.tokens[todo[j]][0]) for j in group)
            if self.full():
                break
        return kept

    def _shortest_that_fit(self, todo: list[int], batch_tokens: int) -> tuple[list[int], int]:
        """The shortest of `todo` whose features fit the room the two budgets have left, by the bytes a token
        takes (measured on the shortest sequence, kept at once: the second value says whether it was) and the
        host slab's alignment."""
        order = sorted(todo, key=lambda i: len(self.tokens[i][0]))  # stable
        if not order:
            return order, 0
        first = order[0]
        n_first = len(self.tokens[first][0])
        (_, feats), = self._forwards([self.tokens[first][0]], batch_tokens)
        per_token = sum(t.numel() * t.element_size() for t in feats[0]) / max(1, n_first)
        self.misses += 1
        self.warm_tokens += n_first
        if not self._keep(first, *feats[0]):
            return [], 0
        room = max(0, self.cache_bytes - self.cached_bytes) + max(0, self.host.limit - self.host.used)
        chosen, used = [], 0.0
        for i in order[1:]:
            n = len(self.tokens[i][0]) * per_token + 3 * HostSlab.ALIGN
            if used + n > room:
                break
            chosen.append(i)
            used += n
        return chosen, 1

    def get(self, indices: list[int]) -> list[Sample]:
        """Samples in the order of `indices`. The forwards take the sequences longest first, cut
        like an extraction plan (`plan_batches`), so a batch pads little whatever order the
        training bins list their sequences in (a bin drawn at random padded to 2-3x its tokens).
        input_ids and loss_mask stay where the token set keeps them (`pack_samples` moves them in one
        copy); the features are on the target's device. Cached sequences skip the forward."""
        pairs = [self.tokens[i] for i in indices]
        out: list[Sample | None] = [None] * len(pairs)
        todo = []
        for k, i in enumerate(indices):
            hit = self._cached(i)
            if hit is None:
                todo.append(k)
            else:
                out[k] = Sample(pairs[k][0], pairs[k][1], *hit)
        self.hits += len(indices) - len(todo)
        self.misses += len(todo)
        for group, feats in self._forwards([pairs[k][0] for k in todo], self.max_batch_tokens):
            for j, (aux, final, top) in zip(group, feats):
                k = todo[j]
                out[k] = Sample(pairs[k][0], pairs[k][1], aux, final, top)
                if self.cache_bytes or self.host.limit:
                    self._keep(indices[k], aux, final, top)
        return out


class HostSlab:
    """Tensors kept in the host's memory up to `limit` bytes, carved from chunks of at most 1 GiB (a power of
    two: torch's pinned-memory allocator rounds every request up to one). Pinned chunks let the copies in
    and out run on the GPU's stream without the host waiting. Nothing is ever freed or written twice, so a
    copy to the device may still be running when the host moves on."""

    CHUNK = 1 << 30
    ALIGN = 64

    def __init__(self, limit: int, pin: bool = False):
        self.limit = max(0, int(limit))
        self.pin = pin
        self.used = 0  # bytes handed out, with the padding to ALIGN
        self.chunks: list[torch.Tensor] = []
        self.offset = 0  # into the last chunk

    def _take(self, n: int) -> torch.Tensor | None:
        n = -(-n // self.ALIGN) * self.ALIGN
        if self.used + n > self.limit:
            return None
        if not self.chunks or self.offset + n > self.chunks[-1].numel():
            size = max(n, min(self.CHUNK, self.limit - self.used))
            if self.pin and size < self.CHUNK:  # the allocator would round it up anyway
                size = 1 << (size - 1).bit_length()
            try:
                chunk = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            except (RuntimeError, MemoryError) as e:  # the host had less than its budget said: the slab is full
                log(f"train: host memory for features stopped at {human_bytes(self.used)} of the "
                    f"{human_bytes(self.limit)} budgeted ({type(e).__name__}: {str(e).splitlines()[0][:160]}); the "
                    f"sequences past it are computed again when needed (train.feature_cache_host_gb sets the budget)")
                self.limit = self.used
                return None
            self.chunks.append(chunk)
            self.offset = 0
        out = self.chunks[-1][self.offset:self.offset + n]
        self.offset += n
        self.used += n
        return out

    def put(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        """Host copies of `tensors` (any devices, dtypes and shapes), or None when they do not fit."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        pad = [-(-n // self.ALIGN) * self.ALIGN for n in sizes]
        raw = self._take(sum(pad))
        if raw is None:
            return None
        out, at = [], 0
        for t, n, p in zip(tensors, sizes, pad):
            dst = raw[at:at + n].view(t.dtype).view(t.shape)
            dst.copy_(t, non_blocking=self.pin)
            out.append(dst)
            at += p
        return tuple(out)


def host_cache_budget(setting_gb: float, device, available: int | None = None, local_processes: int = 1) -> int:
    """Bytes of host memory the online features that do not fit on the GPU may take: the setting in GB, or for a
    negative setting (auto) on a GPU 80% of the memory available now, and never more than all of it but 16 GB,
    shared among this host's training processes; none on a CPU, where the GPU cache's setting already is host
    memory. Generous, because every sequence that fits in neither cache is recomputed by the target every epoch,
    which slows training far more than the host memory costs. Only what is used is pinned, in chunks of 1 GiB."""
    if setting_gb >= 0:
        return int(setting_gb * 1e9)
    if torch.device(device).type != "cuda" and available is None:
        return 0
    if available is None:
        available = mem_available()
    return max(0, int(min(available * 0.8, available - 16e9) / max(1, local_processes)))


def feature_cache_budget(setting_gb: float, device, step_bytes: int = 0, free: int | None = None) -> int:
    """Bytes of device memory the online features may keep: the setting in GB, or for a negative setting
    (auto) on a GPU 85% of the memory free now (after the target is loaded), less what the training steps
    will need on top (`step_bytes` with a quarter more, and 4 GB); none on a CPU, where the default reads
    stored features. Generous, because the target recomputes every sequence that is not kept, every epoch.
    Memory that torch's allocator still holds for tensors already freed counts as free: otherwise the regen
    stage's KV cache (tens of GB), dropped when the stage ends but kept by the allocator, would be taken from
    the features."""
    if setting_gb >= 0:
        return int(setting_gb * 1e9)
    device = torch.device(device)
    if device.type != "cuda" and free is None:
        return 0
    if free is None:
        import gc

        gc.collect()  # tensors held only by reference cycles, then the allocator's unused blocks back to the driver
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
    return max(0, int(min(free * 0.85, free - 1.25 * step_bytes - 4e9)))


def train_step_bytes(batch_tokens: int, ttt_steps: int, draft_vocab: int) -> int:
    """About the peak memory of a training step: its draft-vocabulary logits dominate, with about 3.2 fp32
    copies of [tokens, steps, vocab] live at once, a factor fitted to the measured peaks of SmolLM2 runs with a
    32K vocabulary (within about 5%; BENCHMARKS.md)."""
    return int(batch_tokens * ttt_steps * draft_vocab * 4 * 3.2)


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


def plan_batches(lengths: list[int], batch_tokens: int) -> list[tuple[int, int]]:
    """Consecutive [start, stop) ranges of a longest-first list whose padded size
    (count × first length) stays within batch_tokens (a longer sequence goes alone)."""
    out, start = [], 0
    for j in range(1, len(lengths) + 1):
        if j == len(lengths) or (j - start + 1) * lengths[start] > batch_tokens:
            out.append((start, j))
            start = j
    return out


def tokens_sha256(tokens: TokenSet) -> str:
    h = hashlib.sha256()
    h.update(tokens.offsets.contiguous().numpy().tobytes())
    h.update(tokens.input_ids.contiguous().numpy().tobytes())
    h.update(tokens.loss_mask.contiguous().numpy().tobytes())
    return h.hexdigest()


def _broadcast(obj):
    """Rank 0's `obj` on every process (the others pass None)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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


def _shard_name(rank: int, k: int) -> str:
    return f"shard-{rank:03d}-{k:05d}.safetensors"


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


def extract_split(cfg: Config, target, split: str) -> dict:
    """Extract one split's features into <run>/features/<split>/ (this rank's share of them)."""
    from .data.prepare import load_tokens

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
    H = target.hidden_size
    bpt = bytes_per_token(H, dtype)
    shard_tokens = max(1, min(cfg.features.shard_tokens, MAX_SHARD_BYTES // bpt))
    lengths = tokens.lengths().tolist()
    plans = plan_shards(lengths, world, shard_tokens)
    plan = {"format": FORMAT, "split": split, "target": target.identity(), "dtype": dtype, "hidden_size": H,
            "aux_layers": list(target.aux_layers), "tokens_sha256": tokens_sha256(tokens), "world_size": world,
            "shard_tokens": shard_tokens,
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
    if not writes:  # a tensor-parallel process: rank 0 says which shards to compute
        todo = _broadcast(None)
        with torch.inference_mode():
            for k in todo:
                _extract_shard(target, tokens, plans[0][k], cfg.features.batch_tokens, dtype, None, lambda n: None,
                               cfg.features.norm)
        dist_barrier()  # rank 0 merges the index between these two
        dist_barrier()
        return {"split": split, "sequences": 0, "tokens": 0, "shards": 0, "reused_shards": 0, "dtype": dtype,
                "extracted_tokens": sum(lengths[i] for k in todo for i in plans[0][k]), "bytes_per_token": bpt,
                "dir": str(d), "writes": False}

    # this rank's progress: finished shards (entries with size and sha256)
    prog_path = d / f"rank-{rank:03d}.json"
    done: dict[str, dict] = {}
    if prog_path.exists():
        prog = read_json(prog_path)
        if prog.get("plan") == plan_key:
            done = {e["file"]: e for e in prog.get("shards", [])}
    # temporaries a killed run of this rank left behind (shards and its progress file)
    for pat in (f".shard-{rank:03d}-*.tmp", f".rank-{rank:03d}.json.*.tmp"):
        for stale in d.glob(pat):
            stale.unlink(missing_ok=True)
    my = plans[rank]
    todo = []
    for k, seqs in enumerate(my):
        name = _shard_name(rank, k)
        p = d / name
        e = done.get(name)
        if e and p.exists() and p.stat().st_size == e["bytes"]:
            continue
        if p.exists() and _shard_matches(p, plan_key, seqs):  # written, but killed before it was recorded
            done[name] = _entry(rank, k, seqs, lengths) | {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            continue
        done.pop(name, None)
        todo.append(k)

    # refuse before starting when the disk cannot hold the rest (all ranks write to this folder)
    need = sum(lengths[i] for k in todo for i in my[k]) * bpt * world
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

    record_all = not todo
    if record_all:
        atomic_write_json(prog_path, {"plan": plan_key, "rank": rank,
                                      "shards": sorted(done.values(), key=lambda e: e["shard"])})
    my_tokens = sum(lengths[i] for seqs in my for i in seqs)
    todo_tokens = sum(lengths[i] for k in todo for i in my[k])
    # where the time went (seconds): making (pinning) the first host buffer on the main thread and the others on
    # a background thread ("buffers_background_s", overlapping the loop), the main thread waiting for a free
    # buffer (still being pinned, or the writers are behind) or queueing a shard, its whole loop over the shards,
    # and the wait for the last writes at the end
    timing = {"buffers_s": 0.0, "wait_buffer_s": 0.0, "drain_s": 0.0}
    if todo:
        pin = target.device.type == "cuda"
        threads = writer_threads()
        t0 = time.perf_counter()
        bufs = _ShardBuffers(max(sum(lengths[i] for i in my[k]) for k in todo), H, dtype, pin, count=threads + 1,
                             device=target.device)
        timing["buffers_s"] = time.perf_counter() - t0
        writer = _Writer(record, threads)
        timing["writer_threads"] = threads
        written = [0]
        bar = progress(total=todo_tokens, desc=f"extract {split}" + (f" rank {rank}" if world > 1 else ""),
                       unit="tok", unit_scale=True, **({} if rank == 0 else {"disable": True}))
        sleep = float(os.environ.get("EYAS_DEBUG_SHARD_SLEEP", "0"))  # tests: make a run slow enough to kill
        t_loop = time.perf_counter()
        try:
            with torch.inference_mode():
                for k in todo:
                    seqs = my[k]
                    t0 = time.perf_counter()
                    buf = bufs.get()
                    timing["wait_buffer_s"] += time.perf_counter() - t0
                    n = _extract_shard(target, tokens, seqs, cfg.features.batch_tokens, dtype, buf, bar.update,
                                       cfg.features.norm)
                    tok = _token_tensors(tokens, seqs)
                    tensors = {"offsets": tok["offsets"], "seq_index": tok["seq_index"],
                               **{key: v[:n] for key, v in buf.items()},
                               "input_ids": tok["input_ids"], "loss_mask": tok["loss_mask"]}
                    event = None
                    if pin:
                        event = torch.cuda.Event()
                        event.record()
                    written[0] += n * bpt
                    bar.set_postfix_str(f"{written[0] / 1e9:.2f} GB", refresh=False)
                    t0 = time.perf_counter()
                    writer.submit(d / _shard_name(rank, k), tensors,
                                  _shard_meta(plan_key, rank, k), event,
                                  lambda b=buf: bufs.put(b), _entry(rank, k, seqs, lengths))
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
    dist_barrier()
    if rank == 0:
        _merge_index(d, world, plan_key, len(plans), manifest_path)
    dist_barrier()
    return {"split": split, "sequences": sum(len(s) for s in my), "tokens": my_tokens,
            "extracted_tokens": todo_tokens, "reused_shards": len(my) - len(todo), "shards": len(my),
            "dtype": dtype, "bytes_per_token": bpt, "dir": str(d),
            "timing": {k: round(v, 6) if isinstance(v, float) else v for k, v in timing.items()}}


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
    from safetensors import SafetensorError, safe_open

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


def run_extract(cfg: Config, target=None) -> dict:
    """`eyas extract`: capture the target's aux and final hidden states for the train and val
    splits into feature shards. Under torchrun each rank extracts its share on its own GPU."""
    import dataclasses

    from .data.prepare import ensure_tokens
    from .target import load_target

    if cfg.features.from_vllm:  # the engine ran the target: read its states, load only the head here
        from .engine_features import run_engine_extract

        return run_engine_extract(cfg)
    rank, world, local = dist_env()
    own_pg = False
    if world > 1:
        import torch.distributed as dist

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
            from .rope import target_rope

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
            import torch.distributed as dist

            dist.destroy_process_group()


def _is_feature_manifest(path: Path) -> bool:
    try:
        return read_json(path).get("format") == FORMAT
    except (OSError, EyasError):
        return False


# shards whose bytes this process has checked against their recorded sha256: (path, size, mtime, sha256)
_VERIFIED: set[tuple[str, int, int, str]] = set()
_VERIFIED_LOCK = threading.Lock()


class OfflineFeatures:
    """Features read from the shards `eyas extract` wrote. `path` is a run directory, its
    `features/` folder or one split's folder. With `target` (a Target or its identity dict) the
    manifest must name the same target. fp8 features come back dequantized to `dtype` (default
    bf16); bf16 and fp32 ones in their stored dtype unless `dtype` says otherwise. Sizes and headers
    are checked on opening; each shard's bytes are checked against the sha256 index.json records the
    first time this process reads from it (a shard is at most MAX_SHARD_BYTES: a fraction of a second),
    or of every shard on opening with `verify=True`."""

    def __init__(self, path: str | os.PathLike, split: str = "train", target=None,
                 dtype: torch.dtype | None = None, verify: bool = False):
        from safetensors import SafetensorError, safe_open

        p = Path(path)
        for cand in (p / "features" / split, p / split, p):
            # the run's own manifest.json is not a feature manifest: only the canonical folder is taken on its name
            if (cand / "manifest.json").exists() and (cand == p / "features" / split
                                                      or _is_feature_manifest(cand / "manifest.json")):
                d = cand
                break
        else:
            raise EyasError(f"{p}: no extracted features for split '{split}' (run `eyas extract --out RUN` first)")
        self.dir = d
        man_path = d / "manifest.json"
        self.manifest = read_json(man_path)
        if self.manifest.get("format") != FORMAT:
            raise EyasError(f"{man_path}: not an eyas feature manifest (format {self.manifest.get('format')!r})")
        if not self.manifest.get("complete"):
            raise EyasError(f"{man_path}: extraction did not finish; run the same `eyas extract` again to resume it")
        if target is not None:
            want = target if isinstance(target, dict) else target.identity()
            have = self.manifest["target"]
            if any(have.get(k) != want.get(k) for k in ("sha256", "hidden_size", "aux_layers", "num_layers")):
                raise EyasError(f"{man_path}: features were extracted from target {have.get('name')} "
                                f"(sha256 {have.get('sha256')}, aux layers {have.get('aux_layers')}), not "
                                f"{want.get('name')} (sha256 {want.get('sha256')}, aux layers {want.get('aux_layers')})")
        self.dtype = self.manifest["dtype"]
        self.out_dtype = dtype or (torch.bfloat16 if self.dtype == "fp8" else STORE_DTYPES[self.dtype])
        index = read_json(d / "index.json")
        n = self.manifest["sequences"]
        self._files, self._offsets, self._keys = [], [], []
        self._shards = [(d / e["file"], e.get("sha256")) for e in index["shards"]]
        self._checked = [False] * len(self._shards)
        self._locks = [threading.Lock() for _ in self._shards]  # read-ahead threads: one hash of each shard
        self._loc = torch.full((n, 2), -1, dtype=torch.long)
        for s, e in enumerate(index["shards"]):
            f = d / e["file"]
            if not f.exists():
                raise EyasError(f"{f}: feature shard missing; run `eyas extract` again to rebuild it")
            size = f.stat().st_size
            if size != e["bytes"]:
                raise EyasError(f"{f}: shard is truncated or modified ({size:,} bytes, index.json says "
                                f"{e['bytes']:,}); delete it and run `eyas extract` again")
            if verify:
                self._verify(s)
            try:
                h = safe_open(str(f), "pt")
                seq_index = h.get_tensor("seq_index")
                offsets = h.get_tensor("offsets")
            except (SafetensorError, OSError) as err:
                raise EyasError(f"{f}: shard is corrupt ({err}); delete it and run `eyas extract` again") from None
            self._files.append(h)
            self._keys.append(set(h.keys()))
            self._offsets.append(offsets)
            self._loc[seq_index, 0] = s
            self._loc[seq_index, 1] = torch.arange(seq_index.numel())
        if (self._loc[:, 0] < 0).any():
            missing = int((self._loc[:, 0] < 0).sum())
            raise EyasError(f"{d / 'index.json'}: {missing} of {n} sequences are in no shard; run `eyas extract` again")

    def _verify(self, s: int) -> None:
        """Shard s's bytes against the sha256 index.json recorded when it was written, once per process: a byte
        flipped on the disk or in a copy would otherwise train unnoticed."""
        if self._checked[s]:
            return
        f, want = self._shards[s]
        with self._locks[s]:
            st = f.stat()
            key = (str(f.resolve()), st.st_size, st.st_mtime_ns, str(want))
            with _VERIFIED_LOCK:
                done = key in _VERIFIED
            if not done and want is not None:
                if sha256_file(f) != want:
                    raise EyasError(f"{f}: shard is corrupt (its sha256 is not the one {self.dir / 'index.json'} "
                                    f"records); delete it and run the same `eyas extract` again, which remakes the "
                                    f"missing shard and keeps the others")
                with _VERIFIED_LOCK:
                    _VERIFIED.add(key)
            self._checked[s] = True

    def __len__(self) -> int:
        return int(self._loc.shape[0])

    @property
    def carries_top(self) -> bool:
        """Whether every shard stores the target's top token (shards written before eyas stored it do not)."""
        return all("top" in k for k in self._keys)

    @property
    def lengths(self) -> torch.Tensor:
        out = torch.empty(len(self), dtype=torch.long)
        for s, off in enumerate(self._offsets):
            rows = (self._loc[:, 0] == s).nonzero().flatten()
            out[rows] = (off[1:] - off[:-1])[self._loc[rows, 1]]
        return out

    def get(self, indices: list[int]) -> list[Sample]:
        out = []
        for i in indices:
            s, r = (int(v) for v in self._loc[i])
            self._verify(s)
            f = self._files[s]
            a, b = int(self._offsets[s][r]), int(self._offsets[s][r + 1])
            aux, final = f.get_slice("aux")[a:b], f.get_slice("final")[a:b]
            if self.dtype == "fp8":
                aux = dequantize_fp8(aux, f.get_slice("aux_scale")[a:b], self.out_dtype)
                final = dequantize_fp8(final, f.get_slice("final_scale")[a:b], self.out_dtype)
            else:
                aux, final = aux.to(self.out_dtype), final.to(self.out_dtype)
            ids = f.get_slice("input_ids")[a:b].long()
            mask = f.get_slice("loss_mask")[a:b].bool()
            top = f.get_slice("top")[a:b] if "top" in self._keys[s] else None
            out.append(Sample(ids, mask, aux, final, top))
        return out
