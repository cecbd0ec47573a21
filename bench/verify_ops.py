"""Which torch ops a verify pass over K+1 tokens runs that a one-token step does not: FastLM.forward of the
target at T=1 and at T=K+1 (same cache, same position), each under the torch profiler, and the aten ops whose
counts differ. On a CPU this shows the copies a multi-token forward adds when it folds the query heads as a
one-token step does (`--fold`; BENCHMARKS.md, eighth session: 61 `aten::clone` at T=4 for SmolLM2, about two per
layer); through SDPA's enable_gqa (FastLM.gqa_steps, the default since the tenth session) it adds none. On a GPU,
run bench/profile_round.py for the kernels.

    PYTHONPATH=. python3 bench/verify_ops.py [--target smollm2] [--k 3] [--fold]
"""
from __future__ import annotations

import argparse
import collections


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2", help="an eyas target FastLM supports")
    ap.add_argument("--k", type=int, default=3, help="drafts per round: the verify pass covers K+1 tokens")
    ap.add_argument("--dtype", default="float32", help="the target's dtype")
    ap.add_argument("--fold", action="store_true", help="fold the query heads at T > 1 too (FastLM.gqa_steps off)")
    a = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from eyas.config import TargetConfig
    from eyas.fastlm import FastLM
    from eyas.target import load_target

    FastLM.gqa_steps = not a.fold
    t = load_target(TargetConfig(name=a.target, dtype=a.dtype))
    lm = FastLM(t.model, 1, 128, aux_layers=t.aux_layers)
    dev = t.device
    lm.forward(torch.randint(0, 1000, (1, 20), device=dev), torch.zeros(1, dtype=torch.long, device=dev))
    counts = {}
    for T in (1, a.k + 1):
        ids, pos = torch.randint(0, 1000, (1, T), device=dev), torch.tensor([20], device=dev)
        with profile(activities=[ProfilerActivity.CPU]) as p:
            lm.forward(ids, pos, want_aux=True, upto=128)
        counts[T] = collections.Counter(e.name for e in p.events() if e.name.startswith("aten::"))
    one, many = counts[1], counts[a.k + 1]
    print(f"{'aten op':40} {'T=1':>6} {f'T={a.k + 1}':>6}")
    for name in sorted(set(one) | set(many)):
        if one[name] != many[name]:
            print(f"{name:40} {one[name]:6} {many[name]:6}")
    print(f"{'all aten ops':40} {sum(one.values()):6} {sum(many.values()):6}")


if __name__ == "__main__":
    main()
