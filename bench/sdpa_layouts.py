"""The attention step of one target layer in each query/KV head layout, at T = 1 and T = K+1: which copies
each makes (aten::clone and aten::contiguous, with the shapes they copy), how many CUDA kernels it launches,
and its time as a CUDA graph replay. SmolLM2's shapes by default (9 query heads, 3 KV heads, head dim 64).

    PYTHONPATH=. python3 bench/sdpa_layouts.py [--t 1,4] [--dtype bfloat16] [--out sdpa.json]

Layouts: `fold` (FastLM's default: query heads folded into the query length, KV stored once), `expand` (KV
stored per query head, q a strided view), `expand_cq` (the same with q made contiguous first), `gqa` (KV
stored once, SDPA's enable_gqa).
"""
from __future__ import annotations

import argparse
import collections
import json

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--t", default="1,4", help="query tokens per call, a comma list")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--slots", type=int, default=256, help="cache slots attended")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="sdpa_layouts.json")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = getattr(torch, a.dtype)
    nh, nkv, D, S = a.heads, a.kv_heads, a.head_dim, a.slots
    rep = nh // nkv
    kg = torch.randn(1, nkv, S, D, device=dev, dtype=dt)
    vg = torch.randn(1, nkv, S, D, device=dev, dtype=dt)
    ke = kg[:, :, None].expand(1, nkv, rep, S, D).reshape(1, nh, S, D).contiguous()
    ve = vg[:, :, None].expand(1, nkv, rep, S, D).reshape(1, nh, S, D).contiguous()
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "dtype": a.dtype, "shapes": [nh, nkv, D, S], "runs": {}}

    def layouts(T):
        qk = torch.randn(1, T, nh + nkv, D, device=dev, dtype=dt)  # rope's output, as FastLM has it
        m = torch.zeros(1, 1, T, S, device=dev, dtype=dt)
        m[..., S - T + 1:] = float("-inf")
        mf = m[:, :, None].expand(1, 1, rep, T, S).reshape(1, 1, rep * T, S)

        def fold():
            q = qk[:, :, :nh].transpose(1, 2).reshape(1, nkv, rep * T, D)
            o = F.scaled_dot_product_attention(q, kg, vg, attn_mask=mf)
            return o.reshape(1, nh, T, D).transpose(1, 2).reshape(1, T, -1)

        def expand():
            o = F.scaled_dot_product_attention(qk[:, :, :nh].transpose(1, 2), ke, ve, attn_mask=m)
            return o.transpose(1, 2).reshape(1, T, -1)

        def expand_cq():
            o = F.scaled_dot_product_attention(qk[:, :, :nh].transpose(1, 2).contiguous(), ke, ve, attn_mask=m)
            return o.transpose(1, 2).reshape(1, T, -1)

        def gqa():
            o = F.scaled_dot_product_attention(qk[:, :, :nh].transpose(1, 2), kg, vg, attn_mask=m, enable_gqa=True)
            return o.transpose(1, 2).reshape(1, T, -1)

        return {"fold": fold, "expand": expand, "expand_cq": expand_cq, "gqa": gqa}

    from torch.profiler import ProfilerActivity, profile

    # this folder's round profiler: graph_ms times one call as a CUDA graph over replays; device_events, the kernels
    from profile_round import device_events, graph_ms

    for T in [int(x) for x in a.t.split(",")]:
        ref = None
        for name, fn in layouts(T).items():
            r = {}
            try:
                out = fn()
            except Exception as e:  # a layout this torch refuses
                res["runs"][f"{name}_T{T}"] = {"error": f"{type(e).__name__}: {e}"}
                print(name, T, "error", e, flush=True)
                continue
            ref = out if ref is None else ref
            r["max_diff_vs_fold"] = float((out.float() - ref.float()).abs().max())
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with profile(activities=acts, record_shapes=True) as p:
                fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            evs = p.events()
            c = collections.Counter(e.name for e in evs if e.name.startswith("aten::"))
            r["copies"] = {k: c[k] for k in ("aten::clone", "aten::contiguous", "aten::copy_")}
            r["copied_shapes"] = [str(e.input_shapes) for e in evs if e.name in ("aten::clone", "aten::contiguous")]
            r["ops"] = sorted(k for k in c if "attention" in k)
            if dev.type == "cuda":
                r["kernels"] = [e.name[:90] for e in device_events(p)]
                r["graph_us"] = round(1e3 * graph_ms(fn, dev, 2000), 2)
            res["runs"][f"{name}_T{T}"] = r
            print(name, T, {k: v for k, v in r.items() if k != "kernels"}, r.get("kernels"), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
