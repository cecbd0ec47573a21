"""Where a drafter's guesses fail, by how sure the target was: the greedy chain's acceptance at each drafting step
on the target's own greedy answers, binned by the target's probability of its top token at the predicted position,
and split by how much each answer repeats itself.

    PYTHONPATH=. python3 bench/accept_by_confidence.py --report decode.json --draft DIR [--prompts sharegpt]
        [--limit 80] [--steps 3] [--bins 0,0.3,0.5,0.7,0.9,1.01] [--device cpu] [--dtype float32] [--out FILE]

The report is a bench/bench_decode.py JSON report made with the same --prompts and --limit: its plain method's
outputs are the target's greedy answers. Each is teacher-forced here: one target forward over prompt + answer gives
the aux states, the final states and the target's distribution at every answer position; the drafter then unrolls
--steps steps over them as training's validation does (`eyas.ttt.ttt_unroll(..., chain=True)`): step j counts at a
position only where steps before it were accepted there, and is accepted where its argmax is the target's top
token. Where this device's target picks another top token than the report's text (near ties, another dtype), the
chain is cut there, not counted. If the drafter does well where the target is sure and badly where it hesitates,
the misses sit in the text's own uncertainty rather than in the drafter's reading of the target's states.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def bin_of(x: float, edges: list[float]) -> int:
    for b, (lo, hi) in enumerate(zip(edges, edges[1:])):
        if lo <= x < hi:
            return b
    return len(edges) - 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", required=True, help="a bench/bench_decode.py JSON report (its eyas_plain outputs)")
    ap.add_argument("--draft", required=True, help="the drafter folder (eyas, SGLang or vLLM format)")
    ap.add_argument("--target", default="smollm2", help="the target the report decoded with")
    ap.add_argument("--method", default="eyas_plain", help="the report's method whose outputs are the answers")
    ap.add_argument("--prompts", default="sharegpt", help="the report's --prompts")
    ap.add_argument("--limit", type=int, default=80, help="the report's --limit")
    ap.add_argument("--steps", type=int, default=3, help="drafting steps to unroll (K)")
    ap.add_argument("--bins", default="0,0.3,0.5,0.7,0.9,1.01",
                    help="edges of the bins of the target's top-token probability")
    ap.add_argument("--device", default="cpu", help="where the target and drafter run")
    ap.add_argument("--dtype", default="float32", help="the target's dtype here")
    ap.add_argument("--out", default="", help="write the figures as JSON here too")
    a = ap.parse_args(argv)
    edges = [float(x) for x in a.bins.split(",")]

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_decode import bench_drafter, load_prompts

    from eyas.config import TargetConfig
    from eyas.evaluate import REPEAT_BUCKETS, repeat_bucket  # answers split as eyas eval's by_repetition
    from eyas.features import Sample, compute_features
    from eyas.target import load_target
    from eyas.ttt import pack_samples, target_labels, ttt_unroll

    rep = json.load(open(a.report))
    outputs = rep["methods"][a.method]["outputs"]
    target = load_target(TargetConfig(name=a.target, dtype=a.dtype, device=a.device))
    drafter = bench_drafter(a.draft, target).to(target.device).float().eval()
    lm_head = target.model.get_output_embeddings()
    prompts = load_prompts(a.prompts, a.limit, target.tokenizer)[: len(outputs)]
    stop = set(target.eot_token_ids)
    nb = len(edges) - 1
    # per answer kind and step: positions in the chain and accepted ones, per bin
    alive = {}
    hits = {}
    answers = {}
    for p, out in zip(prompts, outputs):
        out = [x for x in out if x not in stop]
        kind = repeat_bucket(out)
        answers[kind] = answers.get(kind, 0) + 1
        ids = torch.tensor(p + out)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(p):] = True
        with torch.no_grad():
            aux, final, top = compute_features(target, [ids])[0]
            s = Sample(ids.to(target.device), mask.to(target.device), aux.float(), final.float(), top)
            batch = pack_samples([s])
            labels = target_labels(batch.final, lm_head, drafter.draft_ids, top=batch.top)
            st = ttt_unroll(drafter, batch, labels, a.steps, chain=True)
            conf = torch.softmax(lm_head(batch.final.to(lm_head.weight.dtype)).float(), -1).amax(-1)  # [n]
        n = len(ids)
        rows = torch.arange(n, device=conf.device)
        al = alive.setdefault(kind, [[0] * nb for _ in range(a.steps)])
        hi = hits.setdefault(kind, [[0] * nb for _ in range(a.steps)])
        for j in range(a.steps):
            c = conf[(rows + j + 1).clamp(max=n - 1)]  # the target's distribution over the token step j drafts
            for t in st.alive[j].nonzero().flatten().tolist():
                b = bin_of(float(c[t]), edges)
                al[j][b] += 1
                hi[j][b] += int(st.hits[j][t])
    result = {"report": a.report, "draft": a.draft, "device": a.device, "dtype": a.dtype, "bins": edges,
              "answers": answers, "by_kind": {}}
    names = [f"[{lo:g},{hi:g})" for lo, hi in zip(edges, edges[1:])]
    for kind in sorted(alive, key=REPEAT_BUCKETS.index):
        rows = {}
        print(f"answers repeating {kind} ({answers[kind]} answers)")
        for j in range(a.steps):
            al, hi = alive[kind][j], hits[kind][j]
            tot = sum(al)
            acc = sum(hi) / tot if tot else 0.0
            rows[str(j)] = {"positions": tot, "acceptance": acc,
                            "bins": {names[b]: {"share": al[b] / tot if tot else 0.0,
                                                "acceptance": hi[b] / al[b] if al[b] else None} for b in range(nb)}}
            print(f"  step {j}: {tot:6d} positions, acceptance {acc:.3f}; by the target's top probability: " +
                  ", ".join(f"{names[b]} {al[b] / tot if tot else 0:.0%} of them at "
                            + (f"{hi[b] / al[b]:.2f}" if al[b] else "-") for b in range(nb)))
        result["by_kind"][kind] = rows
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
