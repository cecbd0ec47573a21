"""Where one decode step of the target goes, on transformers' StaticCache against eyas' fastlm.

    PYTHONPATH=. python bench/profile_step.py [--target smollm2] [--context 300] [--cache 2048]

Prefills `--context` random tokens into a cache of `--cache` slots, then times 10 one-token steps on
each path and prints the torch profiler's top operators for one transformers step (batch 1, fp32).
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2", help="target preset or path")
    ap.add_argument("--context", type=int, default=300, help="tokens already in the cache")
    ap.add_argument("--cache", type=int, default=2048, help="cache slots (the decoder's max_len)")
    a = ap.parse_args()

    from torch.profiler import profile

    from eyas.config import TargetConfig
    from eyas.decode import FastTargetRunner, TargetRunner
    from eyas.target import load_target

    t = load_target(TargetConfig(name=a.target, dtype="float32", device="cpu"))
    ids = torch.randint(0, 1000, (1, a.context))
    step = torch.randint(0, 1000, (1, 1))
    pos = torch.arange(a.context, a.context + 1)
    with torch.no_grad():
        for name, runner, upto in (("transformers StaticCache", TargetRunner(t, a.cache), None),
                                   ("eyas fastlm", FastTargetRunner(t, a.cache), ((a.context + 256) // 256) * 256)):
            runner.forward(ids, torch.arange(a.context), last_only=True)
            for _ in range(3):
                runner.forward(step, pos, upto=upto)
            t0 = time.perf_counter()
            for _ in range(10):
                runner.forward(step, pos, upto=upto)
            print(f"{name}: {(time.perf_counter() - t0) / 10 * 1000:.1f} ms per one-token step")
            if isinstance(runner, TargetRunner):
                with profile(record_shapes=True) as p:
                    runner.forward(step, pos)
                print(p.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=6))
            runner.close()


if __name__ == "__main__":
    main()
