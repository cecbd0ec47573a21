"""Host time of the flex block masks a training step needs, one a TTT step: built by torch's compiled
create_block_mask (eyas.ttt._block_mask, `MASKS = "once"`) against what `MASKS = "derive"` does: the last step's made
from the documents' bounds (eyas.ttt._last_step_mask) and every earlier step's cut from it (eyas.ttt._derive_mask);
and, for the record, torch's BlockMask.from_kv_blocks on the cut key lists (which recomputes the query side). At a
few hundred tokens the mask's own arithmetic is negligible, so the time is the host's: Python, Dynamo's guards and
the launches. Checks that the made and cut masks list the same blocks as the built ones, on both sides.

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


def from_kv_blocks(last, steps: int, j: int):
    """Step j's mask through torch's constructor from the cut key lists (the thirty-third session's way)."""
    from torch.nn.attention.flex_attention import BlockMask

    return BlockMask.from_kv_blocks(last.kv_num_blocks - (steps - 1 - j), last.kv_indices, last.full_kv_num_blocks,
                                    last.full_kv_indices, BLOCK_SIZE=last.BLOCK_SIZE, mask_mod=last.mask_mod,
                                    seq_lengths=last.seq_lengths)


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
    if n % ttt.FLEX_BLOCK:
        ap.error(f"--tokens must be a multiple of {ttt.FLEX_BLOCK} (batches are padded so on CUDA)")
    doc = torch.zeros(n, dtype=torch.long, device=dev)
    doc[n * 2 // 5:] = 1
    last = ttt._last_step_mask(doc, K)
    listed = ttt.block_lists
    same = [listed(ttt._block_mask(doc, K, K - 1)) == listed(last)]
    same += [listed(ttt._block_mask(doc, K, j)) == listed(ttt._derive_mask(last, K, j)) for j in range(K - 1)]
    out = {"tokens": n, "steps": K, "device": str(dev), "torch": torch.__version__,
           "build_ms": round(per_call_ms(lambda: ttt._block_mask(doc, K, 0), a.repeat, sync), 3),
           "last_step_ms": round(per_call_ms(lambda: ttt._last_step_mask(doc, K), a.repeat, sync), 3),
           "derive_ms": round(per_call_ms(lambda: ttt._derive_mask(last, K, 0), a.repeat, sync), 3),
           "from_kv_blocks_ms": round(per_call_ms(lambda: from_kv_blocks(last, K, 0), a.repeat, sync), 3),
           "made_and_cut_equal_built": same, "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv)}
    out["saving_per_step_ms"] = round(K * out["build_ms"] - out["last_step_ms"] - (K - 1) * out["derive_ms"], 3)
    print(json.dumps(out, indent=1))
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
