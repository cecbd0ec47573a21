"""Whether a verify pass rounds as one-token steps do: greedy speculative decoding reproduces plain decoding token for
token only where the target's forward over T tokens gives, at each of them, the logits a one-token step gives (and a
tree's verify, at each node, what steps over the node's own path give). In bf16 that depends on the kernels, so this
measures, on one device:

- the projections alone: whether `F.linear` of M rows gives each row bit for bit as a product of that row alone
  does, with the target's weights (q, k, o, gate, down of its first layer, lm_head), for M up to 64;
- the target's forward (eyas' FastLM, batch 1): a forward of T tokens after a 100-token prefill against T one-token
  steps over the same tokens, bit for bit and in its largest difference, and a tree verify whose ancestor mask is
  the chain's (the tree path over the same tokens) against the plain T-token forward, and a branching tree's verify
  against one-token steps over each node's own path, in both of FastLM's tree layouts (the ancestors at their
  scattered tree slots, equal only where that attention rounds as over the consecutive slots plain decoding gives
  them; and FastLM.tree_paths, each node's path copied to those slots); for each SDPA backend that
  runs (the default choice, math, efficient, cuDNN, flash), with the query heads folded (FastLM.GQA_MAX_T = 1), through
  enable_gqa, and token by token (FastLM.rowwise_verify); and, under the default backend, with the decoder's compiled
  elementwise kernels, every norm compiled (`_ew`) and as the decoder settles them (`_ew_settled`: compiled only
  where they round each row of a call as a one-row call does, FastLM.settle_norms).

    PYTHONPATH=. python3 bench/verify_rounding.py [--target smollm2 | --random smollm2] [--out rounding.json]

--random SHAPE builds a random model of bench_decode.py's --random-target shapes (weights do not change which
kernels run, and near-ties are what flips a greedy pick, so random weights answer the rounding question).
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F

BACKENDS = ("default", "math", "efficient", "cudnn", "flash")
LENGTHS = (2, 4, 8, 9, 12, 16, 24, 32)


def linear_rows(model, dev, rows=(1, 2, 4, 5, 8, 9, 12, 16, 24, 32, 64), head_vocab: int = 0) -> dict:
    """For each of the target's projections (its own weights and biases, as its forward applies them; the first
    layer's): the row counts M whose product gives every row bit for bit as that row's 1-row product does (a kernel
    may tile the rows, and round the rows of a last, partial tile otherwise; a bias may take another kernel).
    head_vocab: also a random head of that many rows (a random model's head has its tokenizer's size, which may pick
    other kernels than the real target's)."""
    layer = model.get_decoder().layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    head = model.get_output_embeddings()
    mods = {"q": attn.q_proj, "k": attn.k_proj, "o": attn.o_proj, "gate": mlp.gate_proj, "down": mlp.down_proj,
            "lm_head": head}
    weights = {name: (m.weight, getattr(m, "bias", None)) for name, m in mods.items()}
    g = torch.Generator(device=dev).manual_seed(0)
    if head_vocab and head_vocab != head.weight.shape[0]:
        weights[f"lm_head_{head_vocab}"] = (torch.randn(head_vocab, head.weight.shape[1], device=dev,
                                                        dtype=head.weight.dtype, generator=g) * 0.02, None)
    out = {}
    for name, (w, b) in weights.items():
        x = torch.randn(max(rows), w.shape[1], device=dev, dtype=w.dtype, generator=g)
        ones = torch.cat([F.linear(x[i:i + 1], w, b) for i in range(max(rows))])
        out[name] = {m: bool(torch.equal(F.linear(x[:m], w, b), ones[:m])) for m in rows}
    return out


def backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "default":
        return contextlib.nullcontext()
    return sdpa_kernel([{"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                         "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[name]])


@torch.no_grad()
def forwards(model, dev, gqa_max_t: int, name: str, rowwise: bool = False, lengths=LENGTHS, ew=False) -> dict:
    """FastLM forwards of T tokens against T one-token steps (see the module docstring), under one SDPA backend;
    `ew` is FastLM.compile_elementwise (as the decoder runs on a GPU): True with every norm compiled, "settled" as
    the decoder settles it (FastLM.settle_norms for these lengths: the norms eager where compiled ones round a row
    otherwise at some length)."""
    from eyas.engine.fastlm import FastLM

    lm = FastLM(model, 1, 512)
    lm.GQA_MAX_T, lm.rowwise_verify, lm.compile_elementwise = gqa_max_t, rowwise, bool(ew)
    if ew == "settled":
        lm.exact_rows = tuple(lengths)
        print(f"settled norms for {list(lengths)} rows: {'compiled' if lm.settle_norms() else 'eager'}", flush=True)
    lm.tree_paths = False  # the chain-shaped tree below against the plain forward; branching() runs both layouts
    g = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 100 + max(lengths)), device=dev, generator=g)
    res = {}
    with backend(name):
        lm.forward(ids[:, :100], torch.zeros(1, dtype=torch.long, device=dev))
        steps = torch.stack([lm.forward(ids[:, 100 + i:101 + i], torch.tensor([100 + i], device=dev),
                                        last_only=True)[0][0, -1] for i in range(max(lengths))]).float()
        for T in lengths:
            pos = torch.tensor([100], device=dev)
            many = lm.forward(ids[:, 100:100 + T], pos)[0][0].float()
            chain = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
            tree = lm.forward(ids[:, 100:100 + T], pos, tree=(torch.arange(100, 100 + T, device=dev), chain))[0][0]
            res[T] = {"equal": bool(torch.equal(many, steps[:T])),
                      "max_diff": float((many - steps[:T]).abs().max()),
                      "argmax_equal": float((many.argmax(-1) == steps[:T].argmax(-1)).float().mean()),
                      "tree_equals_forward": bool(torch.equal(tree.float(), many)),
                      **branching(lm, ids, T, dev)}
    return res


def branching(lm, ids, T: int, dev) -> dict:
    """A branching tree's verify of T nodes (a binary tree in breadth-first order, node i's parent (i-1)//2, so a
    node's ancestors sit at scattered slots among its cousins) after the same 100-token prefill, against one-token
    steps over each node's own path (the slots plain decoding would give it): the share of nodes whose logits are
    equal bit for bit, and whose argmax is, with the ancestors at their tree slots (branching_*) and with
    FastLM.tree_paths (paths_*)."""
    par = [0] + [(i - 1) // 2 for i in range(1, T)]
    paths = [[0]]
    for i in range(1, T):
        paths.append(paths[par[i]] + [i])
    anc = torch.zeros(T, T, dtype=torch.bool, device=dev)
    for i, p in enumerate(paths):
        anc[i, p] = True
    depth = torch.tensor([len(p) - 1 for p in paths], device=dev)
    toks = ids[:, 100:100 + T]
    trees, was = {}, lm.tree_paths
    for laid in (False, True):  # the ancestors at their tree slots; each node's path at plain decoding's slots
        lm.tree_paths = laid
        trees[laid] = lm.forward(toks, torch.tensor([100], device=dev), tree=(100 + depth, anc))[0][0].float()
    lm.tree_paths = was
    equal = {False: 0, True: 0}
    argmax = dict(equal)
    stack = [0]
    while stack:  # depth first: a node's step finds its ancestors' steps in the slots before its own
        i = stack.pop()
        d = len(paths[i]) - 1
        out = lm.forward(toks[:, i:i + 1], torch.tensor([100 + d], device=dev), last_only=True)[0][0, -1].float()
        for laid, tree in trees.items():
            equal[laid] += bool(torch.equal(tree[i], out))
            argmax[laid] += int(tree[i].argmax() == out.argmax())
        stack += [c for c in range(T - 1, 0, -1) if par[c] == i]
    return {"branching_equal": equal[False] / T, "branching_argmax_equal": argmax[False] / T,
            "paths_equal": equal[True] / T, "paths_argmax_equal": argmax[True] / T}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2", help="a preset, an HF folder or a .gguf file")
    ap.add_argument("--random", default="", help="a random target of this bench_decode.py --random-target shape "
                                                 "instead (e.g. smollm2, qwen3), with --target's tokenizer")
    ap.add_argument("--dtype", default="auto", help="the target's dtype (auto: bf16 on a GPU, fp32 on a CPU)")
    ap.add_argument("--lengths", default="",
                    help="comma list of the verify lengths T to check (default: "
                         + ",".join(map(str, LENGTHS)) + "; with the compiled kernels 4,8,9,16,32, one compile each)")
    ap.add_argument("--head-vocab", type=int, default=0,
                    help="also check a random head of this many rows (e.g. 151936 with --random qwen2.5-1.5b, whose "
                         "head has --target's tokenizer's size)")
    ap.add_argument("--out", default="rounding.json")
    a = ap.parse_args(argv)
    try:
        given = tuple(int(t) for t in a.lengths.split(",")) if a.lengths.strip() else ()
    except ValueError:
        ap.error(f"--lengths {a.lengths!r}: give whole numbers separated by commas, e.g. 4,9,16")
    if any(t < 2 for t in given):
        ap.error(f"--lengths {a.lengths!r}: a verify checks 2 tokens or more")

    from eyas.config import TargetConfig
    from eyas.target import load_target

    if a.random:
        from bench_decode import random_target

        target = random_target(a.random, a.target, a.dtype)
    else:
        target = load_target(TargetConfig(name=a.target, dtype=a.dtype))
    model, dev = target.model, target.device
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "target": a.random or a.target, "dtype": str(model.dtype),
           "linear_rows": linear_rows(model, dev, head_vocab=a.head_vocab), "forwards": {}}
    for name, eq in res["linear_rows"].items():
        print(f"linear {name}: rows equal to a 1-row product: {[m for m, ok in eq.items() if ok]}; not: "
              f"{[m for m, ok in eq.items() if not ok]}", flush=True)
    # (enable_gqa bound, token by token, compiled elementwise kernels, the backends): every backend for the attention
    # paths; the default one for the decoder's compiled kernels (static shapes: one compile per length, so fewer)
    from bench_decode import sweep_compile_limit

    sweep_compile_limit()
    combos = [(16, False, False, BACKENDS), (1, False, False, BACKENDS), (16, True, False, BACKENDS),
              (16, False, True, ("default",)), (16, True, True, ("default",)), (16, False, "settled", ("default",))]
    for gqa, rowwise, ew, backends in combos:
        for name in backends:
            key = f"{name}_" + ("rowwise" if rowwise else f"gqa{gqa}") + {False: "", True: "_ew"}.get(ew, f"_ew_{ew}")
            lengths = given or ((4, 8, 9, 16, 32) if ew else LENGTHS)
            try:
                r = res["forwards"][key] = forwards(model, dev, gqa, name, rowwise, lengths, ew)
            except RuntimeError as e:  # a backend this device, dtype or mask cannot run
                res["forwards"][key] = {"error": str(e).splitlines()[0][:200]}
                print(f"{key}: {res['forwards'][key]['error']}", flush=True)
                continue
            print(f"{key}: " + " ".join(f"T{T}:{'=' if v['equal'] else 'D%.3g' % v['max_diff']}"
                                        f"{'' if v['tree_equals_forward'] else '/tree-differs'}"
                                        f"/branching:{v['branching_equal']:.0%}/paths:{v['paths_equal']:.0%}"
                                        for T, v in r.items()), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
