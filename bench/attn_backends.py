"""Which scaled_dot_product_attention backend suits FastLM's shapes (GPU): the decode step of regeneration
(queries of one KV head folded into 3 rows, an additive mask) and right-padded prefills of ever new shapes.

    PYTHONPATH=. python3 bench/attn_backends.py --out attn.json

For each backend PyTorch offers with a mask (cuDNN, memory-efficient, math):
- `decode_ms[span]`: one attention call of B=256 rows over `span` cache slots (CUDA events, mean of 50);
- `prefill_first_ms` / `prefill_again_ms`: wall time of a whole FastLM prefill forward (the real target)
  the first time a (rows, width) shape is seen and the second time, averaged over several new shapes.
  A backend that builds a plan per shape pays for it in the first figure, on the host.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--out", default="attn.json")
    a = p.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from eyas.config import TargetConfig
    from eyas.fastlm import FastLM
    from eyas.target import load_target

    dev = torch.device("cuda")
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH}
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
           "decode_ms": {}, "prefill_first_ms": {}, "prefill_again_ms": {}}
    B, H, rep, D = 256, 3, 3, 64
    for name, be in backends.items():
        row = {}
        for span in (256, 768, 1280):
            q = torch.randn(B, H, rep, D, device=dev, dtype=torch.bfloat16)
            k = torch.randn(B, H, span, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            mask = torch.zeros(B, 1, rep, span, device=dev, dtype=torch.bfloat16)
            mask[:, :, :, span // 2:] = float("-inf")
            try:
                with sdpa_kernel([be]):
                    for _ in range(3):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _ in range(50):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    e1.record()
                    torch.cuda.synchronize()
                row[str(span)] = round(e0.elapsed_time(e1) / 50, 4)
            except RuntimeError as e:
                row[str(span)] = f"unsupported: {str(e).splitlines()[0][:80]}"
        res["decode_ms"][name] = row
    print(json.dumps(res["decode_ms"], indent=1), file=sys.stderr)

    target = load_target(TargetConfig(name=a.target))
    lm = FastLM(target.model, 256, 1344)
    w = torch.randint(0, 1000, (4, 64), device=dev)  # warm-up: cuBLAS handles, the default backend
    lm.forward(w, torch.zeros(4, dtype=torch.long, device=dev), rows=torch.arange(4, device=dev), upto=64,
               last_idx=torch.full((4,), 63, device=dev))
    g = torch.Generator().manual_seed(0)
    for name, be in backends.items():
        first, again = [], []
        for i in range(6):
            rows = int(torch.randint(8, 64, (1,), generator=g))
            width = int(torch.randint(100, 1000, (1,), generator=g))
            ids = torch.randint(0, 1000, (rows, width), device=dev)
            zero = torch.zeros(rows, dtype=torch.long, device=dev)
            r = torch.arange(rows, device=dev)
            last = torch.full((rows,), width - 1, device=dev)
            with sdpa_kernel([be]):
                for dst in (first, again):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    lm.forward(ids, zero, rows=r, upto=width, last_idx=last)
                    torch.cuda.synchronize()
                    dst.append((time.perf_counter() - t) * 1000)
        res["prefill_first_ms"][name] = round(sum(first) / len(first), 2)
        res["prefill_again_ms"][name] = round(sum(again) / len(again), 2)
    print(json.dumps({k: res[k] for k in ("prefill_first_ms", "prefill_again_ms")}, indent=1), file=sys.stderr)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
