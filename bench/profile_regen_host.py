"""The static regen engine's host-side Python work, on the CPU with the tiny target (its compute is small,
so what remains is bookkeeping): a cProfile of one `eyas regen` run, top functions by cumulative time.

    PYTHONPATH=. python3 bench/profile_regen_host.py --prompts 512 --batch-size 128 --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--rows", type=int, default=30, help="functions listed")
    a = p.parse_args(argv)

    from bench_regen import prompts, regen_config
    from eyas.config import TargetConfig
    from eyas.data.regen import run_regen
    from eyas.target import load_target

    target = load_target(TargetConfig(name="tiny", device="cpu"))
    users = prompts(target, a.prompts, a.max_prompt_tokens)
    cfg = regen_config(users, a, "static")
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    rep = run_regen(cfg, target=target)
    prof.disable()
    print(f"{len(users)} prompts, {rep['records']} records, {time.perf_counter() - t0:.2f} s wall")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(a.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
