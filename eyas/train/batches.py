"""Training batches: each split's sequences packed into micro-batches of a token budget, an epoch's micro-batches
dealt to the step's slots (processes x grad_accum), and the target features a batch trains on, stored or computed
online, read ahead of the loop where asked."""
from __future__ import annotations

import bisect
import random
from concurrent.futures import ThreadPoolExecutor

import torch

from ..config import Config
from ..engine_features import engine_online_features
from ..features import OfflineFeatures, OnlineFeatures
from .ttt import PackedBatch, count_positions, pack_samples


def pack_indices(lengths: list[int], budget: int, seed: int) -> list[list[int]]:
    """Sequences (already capped at `budget` tokens) into bins of at most `budget` tokens: shuffle,
    then best fit in decreasing length, then shuffle the bins. Deterministic in `seed`."""
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    order.sort(key=lambda i: -lengths[i])
    free: list[tuple[int, int]] = []  # (space left, bin) sorted
    bins: list[list[int]] = []
    for i in order:
        L = lengths[i]
        k = bisect.bisect_left(free, (L, -1))
        if k < len(free):
            space, b = free.pop(k)
        else:
            space, b = budget, len(bins)
            bins.append([])
        bins[b].append(i)
        if space - L > 0:
            bisect.insort(free, (space - L, b))
    rng.shuffle(bins)
    return [sorted(b) for b in bins]


class Data:
    """Token lengths, epoch packing and feature access for one split."""

    def __init__(self, tokens, features, max_len: int, budget: int, fp32: bool = False, all_positions: bool = False):
        self.tokens = tokens
        self.all_positions = all_positions  # train.loss_positions=all: the loss on every token, not the answers only
        self.features = features
        self.max_len = max_len
        self.budget = budget
        self.lengths = [min(int(x), max_len) for x in tokens.lengths()]
        self._epoch: tuple[tuple[int, int], list] | None = None
        self.fp32 = fp32  # train.precision=fp32 on a GPU: features cast up like on the CPU
        self.fixed = False  # every batch padded to the budget, wherever it runs (a graphed or compiled step)

    def bins(self, seed: int) -> list[list[int]]:
        return self.slot_bins(seed, 1)[0]

    def slot_bins(self, seed: int, slots: int) -> list[list[list[int]]]:
        """An epoch's micro-batches for each of `slots` slots (processes x grad_accum), slot j taking its
        step-i micro-batch from its own list. Sequence i always belongs to slot i % slots, so a process
        meets the same sequences every epoch (its feature cache serves them all after the first) and
        packs them anew each epoch. The lists depend on `slots`, not on how the slots are spread over
        processes, so 2 processes and 1 process with grad_accum 2 train on the same batches."""
        key = (seed, slots)
        if self._epoch is None or self._epoch[0] != key:
            out = []
            for j in range(slots):
                idx = list(range(j, len(self.lengths), slots))
                packed = pack_indices([self.lengths[i] for i in idx], self.budget,
                                      seed if slots == 1 else seed * 1_000_003 + j)
                out.append([[idx[k] for k in b] for b in packed])
            self._epoch = (key, out)
        return self._epoch[1]

    def counts(self, bins: list[list[int]], steps: int) -> list[int]:
        total = [0] * steps
        for b in bins:
            for i in b:
                _, m = self.tokens[i]
                L = self.lengths[i]
                if self.all_positions:
                    m = torch.ones_like(m)
                for j, c in enumerate(count_positions(m[:L], [L], steps)):
                    total[j] += c
        return total

    def batch(self, idx: list[int], device, multiple: int) -> PackedBatch:
        samples = self.features.get(idx)
        # on the GPU (or wherever the drafter's step is compiled) every batch has the budget's shape, so compiled
        # kernels are built once; elsewhere no padding
        dev = torch.device(device)
        pad_to = self.budget if dev.type == "cuda" or self.fixed else 0
        batch = pack_samples(samples, self.max_len, pad_to, multiple).to(device)
        if self.all_positions:  # the padding stays out: step_targets counts only rows below n_real
            batch.loss_mask = torch.ones_like(batch.loss_mask)
        if batch.aux.device.type != "cuda" or self.fp32:  # fp32 drafter math: stored bf16/fp8 features cast up
            batch.aux, batch.final = batch.aux.float(), batch.final.float()
        return batch


def make_features(cfg: Config, target, tokens, split: str, cache_bytes: int = 0, host_bytes: int = 0):
    if cfg.train.online and cfg.features.from_vllm:  # the target runs in vLLM; this process holds its head
        return engine_online_features(cfg, target, tokens, cache_bytes, host_bytes)
    if cfg.train.online:
        return OnlineFeatures(target, tokens, max_batch_tokens=max(cfg.features.batch_tokens, cfg.train.batch_tokens),
                              cache_bytes=cache_bytes, norm=cfg.features.norm, host_bytes=host_bytes)
    feats = OfflineFeatures(cfg.out, split)
    return ReadAhead(feats, cfg.train.num_workers) if cfg.train.num_workers > 0 and split == "train" else feats


class ReadAhead:
    """Stored features read ahead of the training loop (train.num_workers threads): while a step runs, the
    micro-batches of the next ones are read from their shards (and fp8 ones dequantized), so a step that would wait
    for the disk finds its batch read. What a batch holds does not depend on when it was read, so the losses are
    the same as reading in the loop. Anything else (lengths, a batch asked for that was not read ahead) goes to the
    features themselves."""

    def __init__(self, features, workers: int):
        self.features, self.workers = features, workers
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="eyas-read-ahead")
        self.pending: dict[tuple, object] = {}

    def ahead(self, batches: list[list[int]]) -> None:
        for idx in batches:
            key = tuple(idx)
            if key not in self.pending:
                self.pending[key] = self.pool.submit(self.features.get, list(idx))

    def get(self, idx: list[int]):
        fut = self.pending.pop(tuple(idx), None)
        return fut.result() if fut is not None else self.features.get(idx)

    def __getattr__(self, name):
        return getattr(self.features, name)
