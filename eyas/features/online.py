"""Features computed in the process that trains: the target runs over each batch (OnlineFeatures), with a host
and device cache of the samples it computed, and the sizes those caches may take.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from ..data.prepare import TokenSet
from ..util import human_bytes, log, mem_available, to_device


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


def plan_batches(lengths: list[int], batch_tokens: int) -> list[tuple[int, int]]:
    """Consecutive [start, stop) ranges of a longest-first list whose padded size
    (count × first length) stays within batch_tokens (a longer sequence goes alone)."""
    out, start = [], 0
    for j in range(1, len(lengths) + 1):
        if j == len(lengths) or (j - start + 1) * lengths[start] > batch_tokens:
            out.append((start, j))
            start = j
    return out


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
