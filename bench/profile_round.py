"""Where a speculative round's time goes, batch 1, greedy: the target's plain step against the fused round
(K drafts, the verify pass, the drafter's rebuild; one CUDA graph) at K = 3 and 7, with the drafter's
projections fused and rope from a table (Eagle3Drafter.fuse) and without, and the CUDA kernels that one
eager drafter step and one eager verify pass launch.

    PYTHONPATH=. python3 bench/profile_round.py [--draft DIR] [--out round.json]

Without --draft the drafter is untrained (the default SmolLM2 GPU shape: MLP 6,144, 32,000-token head);
its acceptance does not matter here, since a fused round always runs K drafter steps, one verify and one
rebuild. Times: device-synchronised wall time per plain step (new tokens) and per round (Generation
draft and verify seconds over rounds), after one warm-up generation, over --tokens new tokens.
"""
from __future__ import annotations

import argparse
import json

import torch


def kernels(fn, dev) -> dict:
    """CUDA kernels (and copies) one eager call of fn launches, and their summed device time (ms)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize(dev)
    evs = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"kernels": len(evs), "device_ms": round(sum(e.device_time for e in evs) / 1e3, 4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default="", help="a drafter folder (default: an untrained one of the GPU shape)")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per timed generation")
    ap.add_argument("--out", default="round.json")
    a = ap.parse_args()

    from eyas.config import TargetConfig
    from eyas.decode import Decoder
    from eyas.draft import build_drafter
    from eyas.evaluate import load_eval_drafter, prompt_ids
    from eyas.target import load_target

    target = load_target(TargetConfig(name=a.target))
    dev = target.device
    if a.draft:
        drafter = load_eval_drafter(a.draft, target)
    else:
        torch.manual_seed(0)
        drafter = build_drafter(target, 32000, intermediate_size=6144)
    prompt = prompt_ids(target.tokenizer, [{"role": "user", "content": "Write a long story about a lighthouse "
                                                                       "keeper who finds a map in a bottle."}])
    max_len = len(prompt) + max(a.tokens, 32) + 16  # the warm-up generates 32; K + 1 more at most
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "prompt_tokens": len(prompt), "new_tokens": a.tokens, "draft": a.draft or "untrained"}

    plain = Decoder(target, None, k=1, max_len=max_len, compile=dev.type == "cuda")
    plain.generate(prompt, 32, (), speculative=False)
    g = plain.generate(prompt, a.tokens, (), speculative=False)
    res["plain_step_ms"] = round(1e3 * g.seconds / len(g.tokens), 4)
    print(f"plain step: {res['plain_step_ms']:.3f} ms", flush=True)
    plain.close()
    for k in (3, 7):
        for fuse in (True, False):
            Decoder.fuse_drafter = fuse
            dec = Decoder(target, drafter, k=k, max_len=max_len, compile=dev.type == "cuda")
            dec.generate(prompt, 32, ())
            g = dec.generate(prompt, a.tokens, ())
            name = f"round_k{k}" + ("" if fuse else "_unfused_drafter")
            res[name + "_ms"] = round(1e3 * (g.draft_seconds + g.verify_seconds) / max(1, len(g.accepted)), 4)
            res[name + "_tau"] = round(g.acceptance_length, 3)
            print(f"{name}: {res[name + '_ms']:.3f} ms per round (tau {g.acceptance_length:.2f}, "
                  f"{res[name + '_ms'] / res['plain_step_ms']:.2f} plain steps)", flush=True)
            if dev.type == "cuda" and k == 3:
                L = len(prompt) + 8
                pos = torch.tensor([L], device=dev)
                h = torch.zeros(1, 1, drafter.config.hidden_size, device=dev, dtype=target.dtype)
                t = torch.zeros(1, 1, dtype=torch.long, device=dev)
                upto = dec._upto(L + k + 1)
                with torch.no_grad():
                    res[f"draft_step_eager{'' if fuse else '_unfused'}"] = kernels(
                        lambda: dec._drafter_fwd(t, h, pos, upto), dev)
                    if fuse:
                        ids = torch.zeros(1, k + 1, dtype=torch.long, device=dev)
                        res["verify_k3_eager"] = kernels(
                            lambda: dec._target_fwd(ids, pos + torch.arange(k + 1, device=dev), upto), dev)
            dec.close()
    Decoder.fuse_drafter = True
    for key in ("draft_step_eager", "draft_step_eager_unfused", "verify_k3_eager"):
        if key in res:
            print(f"{key}: {res[key]}", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
