"""Target hidden-state features: the tensors the drafter trains on.

A feature sample for one tokenized sequence holds
    input_ids [T] (long), loss_mask [T] (bool),
    aux [T, 3·H_t]  the residual streams entering the aux layers, concatenated,
    final [T, H_t]  the target's last normed hidden state (lm_head(final) = target logits),
    top [T] (int32) the target's own next-token choice, argmax over its full vocabulary; computed
                    once here so training need not multiply by the full lm_head every epoch.
`OnlineFeatures` computes them from a target held in the process; offline shards (written by
`eyas extract`) yield the same tensors for the same sequences.

    online.py   Sample, OnlineFeatures and the sizes of its caches
    shards.py   the shard format, fp8 storage, the shard writer
    offline.py  OfflineFeatures: reading the shards back
    extract.py  `eyas extract`: the plan of shards and the capture that fills them
"""
from __future__ import annotations

from .extract import extract_split, plan_shards, run_extract
from .offline import OfflineFeatures
from .online import (HostSlab, OnlineFeatures, Sample, compute_features, feature_cache_budget, host_cache_budget,
                     plan_batches, target_top, train_step_bytes)
from .shards import (FORMAT, MAX_SHARD_BYTES, STORE_DTYPES, bytes_per_token, dequantize_fp8, features_dir,
                     quantize_fp8)

__all__ = ["FORMAT", "MAX_SHARD_BYTES", "STORE_DTYPES", "HostSlab", "OfflineFeatures", "OnlineFeatures", "Sample",
           "bytes_per_token", "compute_features", "dequantize_fp8", "extract_split", "feature_cache_budget",
           "features_dir", "host_cache_budget", "plan_batches", "plan_shards", "quantize_fp8", "run_extract",
           "target_top", "train_step_bytes"]
