"""Host time of building a TTT step's flex block mask (eyas.ttt._block_mask, torch's compiled create_block_mask)
against deriving it from the batch's last-step mask (BlockMask.from_kv_blocks with fewer kv blocks a row): the
saving "one mask a batch instead of one a TTT step" could give. At a few hundred tokens the mask's own arithmetic
is negligible, so the time is the host's: Python, Dynamo's guards and the launches. Checks that the derived masks
list the same blocks as the built ones.

    PYTHONPATH=. python3 bench/mask_build_cost.py [--tokens 256] [--steps 3] [--repeat 50] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eyas import ttt  # noqa: E402


def derive(full, steps: int, j: int):
    """Step j's mask from the last step's: each query block drops the diagonal blocks of the steps after j (every
    query block has one a step, listed after its causal blocks, in ascending kv order)."""
    from torch.nn.attention.flex_attention import BlockMask

    return BlockMask.from_kv_blocks(full.kv_num_blocks - (steps - 1 - j), full.kv_indices, full.full_kv_num_blocks,
                                    full.full_kv_indices, BLOCK_SIZE=full.BLOCK_SIZE, mask_mod=full.mask_mod,
                                    seq_lengths=full.seq_lengths)


def per_call_ms(fn, repeat: int, sync) -> float:
    for _ in range(3):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - t) / repeat * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="packed batch length (two sequences)")
    ap.add_argument("--steps", type=int, default=3, help="TTT steps")
    ap.add_argument("--repeat", type=int, default=50, help="calls timed")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n, K = a.tokens, a.steps
    doc = torch.zeros(n, dtype=torch.long, device=dev)
    doc[n * 2 // 5:] = 1
    full = ttt._block_mask(doc, K, K - 1)
    same = []
    for j in range(K):
        ref, d = ttt._block_mask(doc, K, j), derive(full, K, j)
        cnt = ref.kv_num_blocks
        rows = [ref.kv_indices[0, 0, r, :int(c)].tolist() == d.kv_indices[0, 0, r, :int(c)].tolist()
                for r, c in enumerate(cnt.flatten().tolist())]
        same.append(bool(torch.equal(cnt, d.kv_num_blocks) and all(rows)
                         and torch.equal(ref.q_num_blocks, d.q_num_blocks)))
    out = {"tokens": n, "steps": K, "device": str(dev), "torch": torch.__version__,
           "build_ms": round(per_call_ms(lambda: ttt._block_mask(doc, K, 1), a.repeat, sync), 3),
           "derive_ms": round(per_call_ms(lambda: derive(full, K, 1), a.repeat, sync), 3),
           "derived_equal_built": same, "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv)}
    out["saving_per_step_ms"] = round((K - 1) * (out["build_ms"] - out["derive_ms"]), 3)
    print(json.dumps(out, indent=1))
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
