"""Where a speculative round's time goes, batch 1, greedy: the target's plain step against the fused round
(K drafts, the verify pass, the drafter's rebuild; one CUDA graph) at K = 3 and 7, with the drafter's
projections fused and rope from a table (Eagle3Drafter.fuse) and without, and the CUDA kernels that one
eager drafter step and one eager verify pass launch.

    PYTHONPATH=. python3 bench/profile_round.py [--draft DIR] [--out round.json]

Without --draft the drafter is untrained (the default SmolLM2 GPU shape: MLP 6,144, 32,000-token head);
its acceptance does not matter here, since a fused round always runs K drafter steps, one verify and one
rebuild. Times: device-synchronised wall time per plain step (new tokens) and per round (Generation
draft and verify seconds over rounds), after Decoder.warm_up and one warm-up generation, over --tokens new tokens; and each
part of a round captured alone as a CUDA graph (`parts_ms`: the target's one-token forward, the verify
pass over K+1 tokens, one drafter step, the drafter's rebuild over K+1 tokens, and their sum as a round
runs them), with the top kernels of each eager call by device time.

--trees 8,5,16 8,3,16 ... does the same for EAGLE-2 dynamic trees (eyas.tree_decode, TOPK,DEPTH,TOKENS): the wall
time per tree round, and with --parts its growth (the drafter's expansions and top-k selections), its verify over
TOKENS nodes (as the decoder runs it, each node over its own path, and in one call under the ancestor mask:
FastLM.tree_paths off) and the whole round, each captured alone. With an untrained drafter a round emits about one
token, so these are costs only; τ comes from bench_decode.py with a trained one.
"""
from __future__ import annotations

import argparse
import json

import torch


def device_events(prof) -> list:
    """The kernels (and device copies) a torch.profiler run recorded: not the spans that annotations (a
    profiler schedule's ProfilerStep#N, record_function) leave on the device's timeline, which cover kernels
    rather than being any."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not _annotation(e)]


def _annotation(e) -> bool:
    # (the step marks by name as well: otherwise a profile counts them as kernels)
    return bool(getattr(e, "is_user_annotation", False)) or e.name.startswith("ProfilerStep")


def step_spans_ms(prof) -> list[float]:
    """The device-timeline span (ms) of each step a profiler schedule marked (ProfilerStep#N annotations)."""
    return [e.device_time / 1e3 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and e.name.startswith("ProfilerStep")]


def by_kernel(evs) -> dict[str, list]:
    """Device events grouped by kernel name (first 120 characters): name -> [calls, device ms]."""
    out: dict[str, list] = {}
    for e in evs:
        c = out.setdefault(e.name[:120], [0, 0.0])
        c[0] += 1
        c[1] += e.device_time / 1e3
    return out


def self_device_us(avg) -> float:
    """Device time (us) of the kernels an op launched itself, from a key_averages() row (either torch spelling)."""
    dt = getattr(avg, "self_device_time_total", None)
    return getattr(avg, "self_cuda_time_total", 0) if dt is None else dt


def kernels(fn, dev) -> dict:
    """CUDA kernels (and copies) one eager call of fn launches, and their summed device time (ms); the top
    kernels by device time; and by_op: for each aten op, its calls and the device time of the kernels it
    launched itself (so a verify's extra kernels can be traced to the ops that add them, see op_diff); and
    copies_from: for each outermost aten op (with its input shapes) that ran an aten::copy_, how many."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as p:
        fn()
        torch.cuda.synchronize(dev)
    # which ops ran each copy (aten::copy_) and with what shapes: the outermost aten op above it
    copies_from: dict[str, int] = {}
    for e in p.events():
        if e.name == "aten::copy_" and e.device_type == torch.autograd.DeviceType.CPU:
            top, par = e, e.cpu_parent
            while par is not None and par.name.startswith("aten::"):
                top, par = par, par.cpu_parent
            key = f"{top.name} {top.input_shapes}"[:160]
            copies_from[key] = copies_from.get(key, 0) + 1
    evs = device_events(p)
    top = sorted(by_kernel(evs).items(), key=lambda kv: -kv[1][1])[:12]
    by_op = {}
    for e in p.key_averages():
        dt = self_device_us(e)
        if e.key.startswith("aten::") and dt > 0:
            by_op[e.key] = [e.count, round(dt / 1e3, 4)]
    return {"kernels": len(evs), "device_ms": round(sum(e.device_time for e in evs) / 1e3, 4),
            "top": [[n, c, round(ms, 4)] for n, (c, ms) in top], "by_op": by_op,
            "copies_from": dict(sorted(copies_from.items(), key=lambda kv: -kv[1]))}


def op_diff(one: dict, many: dict) -> list:
    """[op, calls at one token, calls at K+1, device ms at one, device ms at K+1] for the aten ops whose calls
    or own kernels' device time differ between two `kernels(...)["by_op"]`, the largest added time first."""
    rows = []
    for k in set(one) | set(many):
        (c1, t1), (c2, t2) = one.get(k, [0, 0.0]), many.get(k, [0, 0.0])
        if c1 != c2 or abs(t2 - t1) > 0.002:
            rows.append([k, c1, c2, round(t1, 4), round(t2, 4)])
    return sorted(rows, key=lambda r: r[3] - r[4])


REPLAYS = 200


def graph_ms(fn, dev, n: int = 0) -> float:
    """Milliseconds per replay of fn captured alone as a CUDA graph (n replays, device-synchronised):
    one part of a round timed by itself, with the launch cost a replay has in the round."""
    import time

    from eyas.engine.graphs import capture_cuda_graph

    n = n or REPLAYS
    if dev.type != "cuda":  # eager calls (a dry run of this script on a CPU)
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return round(1e3 * (time.perf_counter() - t0) / n, 4)
    g, _ = capture_cuda_graph(fn, dev, warmup=2)
    g.replay()
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        g.replay()
    torch.cuda.synchronize(dev)
    return round(1e3 * (time.perf_counter() - t0) / n, 4)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default="",
                    help="a drafter folder (default: an untrained one of the GPU shape; untrained:N with N decoder "
                         "layers)")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per timed generation")
    ap.add_argument("--out", default="round.json")
    ap.add_argument("--parts", type=int, default=1, help="1: also time each part of a round alone (parts_ms)")
    ap.add_argument("--replays", type=int, default=200, help="replays per timed part")
    ap.add_argument("--gqa", default="1",
                    help="the target's multi-token calls through SDPA's enable_gqa (FastLM.gqa_steps): 1 (the default), "
                         "0 (query heads folded, as in a one-token step), or 1,0 for both in one process (the second "
                         "only with the default drafter, under gqa_<n>)")
    ap.add_argument("--norm", default="2",
                    help="the target's RMSNorm as bench_decode.py --norm: 2 (one fused kernel in the model's dtype, the "
                         "default), 1 (the fused kernel with HF's rounding steps), 0 (the model's modules); a comma "
                         "list measures each (after the first, the default drafter only, under norm_<n>)")
    ap.add_argument("--overlap", default="1",
                    help="Decoder.overlap: 1 (the GPU default: the next plain step or fused round queued before the "
                         "last one's tokens are read), 0 (each read before the next is launched), or 1,0 for both "
                         "(the second under overlap_<n>, the default drafter only)")
    ap.add_argument("--trees", nargs="*", default=[],
                    help="EAGLE-2 trees (TOPK,DEPTH,TOKENS) whose rounds to time after the chains' (their parts "
                         "with --parts)")
    a = ap.parse_args(argv)
    global REPLAYS
    REPLAYS = a.replays

    from eyas.config import TargetConfig
    from bench_decode import bench_drafter, sweep_compile_limit
    from eyas.decode import Decoder
    from eyas.engine.fastlm import FastLM
    from eyas.evaluate import prompt_ids
    from eyas.target import load_target
    from eyas.tree import TreeSpec
    from eyas.tree_decode import TreeDecoder

    trees = [TreeSpec.parse(t, "--trees") for t in a.trees]
    sweep_compile_limit()
    target = load_target(TargetConfig(name=a.target))
    dev = target.device
    drafter = bench_drafter(a.draft, target)
    prompt = prompt_ids(target.tokenizer, [{"role": "user", "content": "Write a long story about a lighthouse "
                                                                       "keeper who finds a map in a bottle."}])
    # the warm-up generates 32; a round writes K + 1 slots past them at most (a tree's span)
    max_len = len(prompt) + max(a.tokens, 32) + max([16] + [max(t.tokens, t.depth + 1) + 1 for t in trees])
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "prompt_tokens": len(prompt), "new_tokens": a.tokens, "draft": a.draft or "untrained"}

    def measure(res, fuses):
        """This script's figures, with the target's multi-token calls as FastLM.gqa_steps now sets them, into res."""
        plain = Decoder(target, None, k=1, max_len=max_len, compile=dev.type == "cuda")
        res["compiled_elementwise"] = plain.elementwise_compiled
        plain.warm_up(speculative=False)  # every span's graph and kernels, before anything is timed
        plain.generate(prompt, 32, (), speculative=False)
        g = plain.generate(prompt, a.tokens, (), speculative=False)
        res["plain_step_ms"] = round(1e3 * g.seconds / len(g.tokens), 4)
        # wall time after the prefill per step, as bench_decode's ms_per_forward_after_prefill
        res["plain_step_wall_ms"] = round(1e3 * (g.seconds - g.prefill_seconds) / max(1, g.target_forwards), 4)
        print(f"plain step: {res['plain_step_ms']:.3f} ms ({res['plain_step_wall_ms']:.3f} after the prefill)",
              flush=True)
        L = len(prompt) + 8
        pos1 = torch.tensor([L], device=dev)
        ids1 = torch.zeros(1, 1, dtype=torch.long, device=dev)
        with torch.no_grad():
            if dev.type == "cuda":
                res["plain_step_eager"] = kernels(lambda: plain._target_fwd(ids1, pos1, plain._upto(L + 8)), dev)
            # the target's one-token forward alone as a graph: the plain step without its host work (argmax,
            # .item(), the next step's inputs)
            res["parts_ms"] = {"plain_forward": graph_ms(lambda: plain._target_fwd(ids1, pos1, plain._upto(L + 8)), dev)}
        plain.close()
        for k in (3, 7):
            for fuse in fuses:
                dec = Decoder(target, drafter, k=k, max_len=max_len, compile=dev.type == "cuda", fuse_drafter=fuse)
                dec.warm_up(plain=False)
                dec.generate(prompt, 32, ())
                g = dec.generate(prompt, a.tokens, ())
                name = f"round_k{k}" + ("" if fuse else "_unfused_drafter")
                res[name + "_ms"] = round(1e3 * (g.draft_seconds + g.verify_seconds) / max(1, len(g.accepted)), 4)
                res[name + "_tau"] = round(g.acceptance_length, 3)
                # the phase clock above reads an overlapped loop (Decoder.overlap) as one span; the wall time
                # after the prefill is what bench_decode reports
                res[name + "_wall_ms"] = round(1e3 * (g.seconds - g.prefill_seconds) / max(1, len(g.accepted)), 4)
                print(f"{name}: {res[name + '_ms']:.3f} ms per round by the phase clock, {res[name + '_wall_ms']:.3f} "
                      f"by the wall clock (tau {g.acceptance_length:.2f}, "
                      f"{res[name + '_wall_ms'] / res['plain_step_wall_ms']:.2f} plain steps)", flush=True)
                if a.parts:  # each part of the round as its own graph: where the round's time goes
                    pos = torch.tensor([L], device=dev)
                    upto = dec._upto(L + k + 1)
                    h = torch.zeros(1, 1, drafter.config.hidden_size, device=dev, dtype=target.dtype)
                    t = torch.zeros(1, 1, dtype=torch.long, device=dev)
                    idsk = torch.zeros(1, k + 1, dtype=torch.long, device=dev)
                    posk = pos + torch.arange(k + 1, device=dev)
                    auxk = torch.zeros(1, k + 1, 3 * drafter.config.hidden_size, device=dev, dtype=target.dtype)
                    lg = torch.zeros(1, drafter.config.draft_vocab_size, device=dev, dtype=target.dtype)
                    sfx = "" if fuse else "_unfused_drafter"
                    with torch.no_grad():
                        parts = res["parts_ms"]
                        if fuse:
                            parts[f"verify_k{k}"] = graph_ms(lambda: dec._target_fwd(idsk, posk, upto), dev)
                        parts[f"draft_step{sfx}"] = graph_ms(lambda: dec._drafter_fwd(t, h, pos, upto), dev)
                        parts[f"draft_rebuild_k{k}{sfx}"] = graph_ms(lambda: dec._drafter_fwd(idsk, auxk, posk, upto), dev)
                        parts[f"sum_k{k}{sfx}"] = round(parts[f"verify_k{k}"] + (k - 1) * parts[f"draft_step{sfx}"]
                                                        + parts[f"draft_rebuild_k{k}{sfx}"], 4)
                        # the whole round alone (as the decoder runs it, minus the host's read of its result)
                        parts[f"round_k{k}{sfx}"] = graph_ms(lambda: dec._round_fwd(t[0], h, lg, pos, upto), dev)
                    print(f"parts k={k}{sfx}: {parts}", flush=True)
                if dev.type == "cuda" and k == 3:
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
        for tree in trees:
            dec = TreeDecoder(target, drafter, tree, max_len=max_len, compile=dev.type == "cuda")
            dec.warm_up(plain=False)
            dec.generate(prompt, 32, ())
            g = dec.generate(prompt, a.tokens, ())
            name = f"round_tree_{tree.topk}_{tree.depth}_{tree.tokens}"
            res[name + "_wall_ms"] = round(1e3 * (g.seconds - g.prefill_seconds) / max(1, len(g.accepted)), 4)
            res[name + "_tau"] = round(g.acceptance_length, 3)
            print(f"{name}: {res[name + '_wall_ms']:.3f} ms per round by the wall clock (tau "
                  f"{g.acceptance_length:.2f}, {res[name + '_wall_ms'] / res['plain_step_wall_ms']:.2f} plain steps, "
                  f"graphs {'on' if dec.graphs.enabled else 'off'})", flush=True)
            if a.parts:
                pos = torch.tensor([len(prompt) + 8], device=dev)
                upto = dec._upto(int(pos) + dec.span)
                last = torch.zeros(1, dtype=torch.long, device=dev)
                h = torch.zeros(1, 1, drafter.config.hidden_size, device=dev, dtype=target.dtype)
                lg = torch.randn(1, drafter.config.draft_vocab_size, device=dev, dtype=target.dtype)
                sfx = f"tree_{tree.topk}_{tree.depth}_{tree.tokens}"
                with torch.no_grad():
                    grown = dec.grow(last, h, lg, pos, upto)  # a tree to verify, made once
                    parts = res["parts_ms"]
                    parts[f"grow_{sfx}"] = graph_ms(lambda: dec.grow(last, h, lg, pos, upto), dev)
                    parts[f"verify_{sfx}"] = graph_ms(lambda: dec._verify_tree(grown, pos, upto), dev)
                    # the verify in one call under the ancestor mask (FastLM.tree_paths off), for its cost
                    laid, FastLM.tree_paths = FastLM.tree_paths, False
                    try:
                        parts[f"verify_{sfx}_one_call"] = graph_ms(lambda: dec._verify_tree(grown, pos, upto), dev)
                    finally:
                        FastLM.tree_paths = laid
                    parts[f"round_{sfx}"] = graph_ms(lambda: dec._tree_round_fwd(last, h, lg, pos, upto), dev)
                print(f"parts {sfx}: { {k: v for k, v in parts.items() if sfx in k} }", flush=True)
            dec.close()
        if "plain_step_eager" in res and "verify_k3_eager" in res:
            res["verify_k3_vs_step_ops"] = op_diff(res["plain_step_eager"]["by_op"], res["verify_k3_eager"]["by_op"])
            print("aten ops of the 4-token verify against the one-token step [op, calls, calls, device ms, device ms]:")
            for row in res["verify_k3_vs_step_ops"]:
                print(f"  {row}", flush=True)
    from bench_decode import target_variants

    sets = {flag: s for flag, s, _ in target_variants(FastLM, Decoder)}  # the attributes each flag's value sets
    variants = [(int(g), int(n), int(o)) for o in a.overlap.split(",") for g in a.gqa.split(",")
                for n in a.norm.split(",")]
    saved = {key: getattr(*key) for flag in ("gqa", "norm", "overlap") for key in sets[flag](1)}
    for g, n, o in variants:
        for flag, v in (("gqa", g), ("norm", n), ("overlap", o)):
            for (cls, name), value in sets[flag](v).items():
                setattr(cls, name, value)
        # the first listed gets every variant; another gets the default drafter only, its figures under the
        # settings that differ from the first's (res["gqa_<g>"], res["norm_<n>"], res["overlap_<o>"] or joined)
        first = variants[0]
        differ = ([f"gqa_{g}"] * (g != first[0]) + [f"norm_{n}"] * (n != first[1])
                  + [f"overlap_{o}"] * (o != first[2]))
        sub = res.setdefault("_".join(differ), {}) if differ else res
        print(f"== FastLM.gqa_steps = {bool(g)}, norm {n}, overlap {o}", flush=True)
        measure(sub, (True, False) if sub is res else (True,))
    for (cls, name), value in saved.items():
        setattr(cls, name, value)
    for r in [res] + [v for k, v in res.items() if k.startswith(("gqa_", "norm_", "overlap_"))]:
        for key in ("plain_step_eager", "draft_step_eager", "draft_step_eager_unfused", "verify_k3_eager"):
            if key in r:
                print(f"{key}: { {k: v for k, v in r[key].items() if k != 'by_op'} }", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
