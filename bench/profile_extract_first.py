"""The first extraction in a process against the ones after it, each under the torch profiler (host side):
what the first pays that the later ones do not. On an H200 (BENCHMARKS.md, eighth session) it was cuDNN's
per-shape attention plans.

    PYTHONPATH=. python3 bench/profile_extract_first.py [--sequences 2000] [--runs 3]

Runs bench_extract's extraction (eyas.features.extract_split, bf16, a fresh run folder each time) --runs
times over the same tokenized ShareGPT sequences and prints each run's tok/s, its timing and its top host ops.
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path


def main():
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_extract as B

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    B.data_args(ap)
    ap.add_argument("--runs", type=int, default=3, help="extractions, one after another in this process")
    ap.add_argument("--rows", type=int, default=12, help="host ops listed per run")
    ap.add_argument("--workdir", default="/tmp/eyas-extract-first", help="where the shards go (removed after each run)")
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from eyas.config import TargetConfig
    from eyas.target import load_target

    target = load_target(TargetConfig(name=a.target))
    tokens = B.tokenize(target, a.sequences, a.max_seq_len)
    args = types.SimpleNamespace(target=a.target, batch_tokens=a.batch_tokens)
    for i in range(a.runs):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            dt, info, _ = B.extract_once(args, target, tokens, Path(a.workdir), "bf16")
        print(f"run {i}: {tokens.n_tokens / dt:,.0f} tok/s {info['timing']}", flush=True)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows), flush=True)


if __name__ == "__main__":
    main()
