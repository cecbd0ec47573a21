"""Acceptance length by the kind of text the target wrote, from a `bench/bench_decode.py` report.

    python3 bench/tau_by_text.py decode_sharegpt.json [--ngram 8 --repeated 0.3] [--bands 0,0.1,0.5,1.01]
                                 [--positions 0,16,64,256]

bench_decode keeps plain decoding's tokens per prompt ("outputs" of eyas_plain) and, for each speculative
method, each prompt's new tokens, verify rounds and drafted tokens accepted ("per_prompt"). This splits every
speculative method's tau (tokens per target forward, as bench_decode counts it) two ways: prompts whose answer
ran to --max-new-tokens against those that stopped, and answers that repeat themselves (a share of repeated
n-grams above --repeated) against the rest; with --bands, also by bands of that share. Greedy decoding of a small
target loops often; a drafter that only predicts loops well shows it here. Each method is read against the plain
method of its own variant (`eyas_plain_norm1` for `_norm1` methods), whose text it wrote. With --positions (reports
since the fourteenth GPU session keep each round's accepted count, "accepted_by_prompt"), also by where in the
answer a round starts: the answer's first token comes from the prefill, the first round starts at token 1, and a
round that accepts a drafts starts the next one a + 1 tokens later.
"""
from __future__ import annotations

import argparse
import json
import sys

from eyas.util import repeated_share  # the share of an answer's n-grams seen earlier in it


def tau(rows: list[tuple]) -> dict:
    rounds = sum(r[1] for r in rows)
    acc = sum(r[2] for r in rows)
    return {"prompts": len(rows), "new_tokens": sum(r[0] for r in rows),
            "tau": (acc + rounds) / rounds if rounds else None}


def by_position(accepted_by_prompt: list[list[int]], edges: list[float]) -> dict:
    """tau of the rounds that start at answer tokens [lo, hi), for each pair of consecutive edges."""
    bins = [[0, 0] for _ in edges[1:]]  # rounds, accepted drafts
    for rounds in accepted_by_prompt:
        at = 1  # token 0 comes from the prefill
        for a in rounds:
            for b, (lo, hi) in enumerate(zip(edges, edges[1:])):
                if lo <= at < hi:
                    bins[b][0] += 1
                    bins[b][1] += a
            at += a + 1
    return {f"tokens [{lo:g},{hi:g})": {"rounds": r, "tau": (a + r) / r if r else None}
            for (lo, hi), (r, a) in zip(zip(edges, edges[1:]), bins)}


def split(report: dict, ngram: int, repeated: float, bands: list[float] = (), positions: list[float] = ()) -> dict:
    methods = report["methods"]
    first = next((m for n, m in methods.items() if n.startswith("eyas_plain") and "outputs" in m), None)
    if first is None:
        raise SystemExit("the report has no plain decoding tokens (eyas_plain.outputs): rerun bench_decode.py, "
                         "which keeps them since the eleventh GPU session")
    cap = report["max_new_tokens"]
    out = {}
    for name, m in methods.items():
        if "per_prompt" not in m:
            continue
        plain = methods.get("eyas_plain" + m.get("variant", ""), first)  # the text this method wrote
        rows = [(n, r, a, len(o) >= cap, repeated_share(o, ngram))
                for o, (n, r, a) in zip(plain.get("outputs", first["outputs"]), m["per_prompt"])]
        out[name] = {"all": tau(rows),
                     "ran_to_cap": tau([x for x in rows if x[3]]), "stopped": tau([x for x in rows if not x[3]]),
                     "repetitive": tau([x for x in rows if x[4] > repeated]),
                     "not_repetitive": tau([x for x in rows if x[4] <= repeated]),
                     **{f"share [{lo:g},{hi:g})": tau([x for x in rows if lo <= x[4] < hi])
                        for lo, hi in zip(bands, bands[1:])}}
        if positions and "accepted_by_prompt" in m:
            out[name].update(by_position(m["accepted_by_prompt"], positions))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", help="a bench_decode.py JSON report")
    ap.add_argument("--ngram", type=int, default=8, help="n-gram length for the repetition share")
    ap.add_argument("--repeated", type=float, default=0.3,
                    help="an answer is repetitive when more than this share of its n-grams came earlier in it")
    ap.add_argument("--bands", default="",
                    help="also split by bands of the repeated share, at these comma-separated edges (0,0.1,0.5,1.01)")
    ap.add_argument("--positions", default="",
                    help="also split each method's rounds by the answer token they start at, at these comma-separated "
                         "edges (0,16,64,256); needs a report with accepted_by_prompt")
    a = ap.parse_args(argv)
    try:
        report = json.load(open(a.report))
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{a.report}: {e}")
    edges = [[float(x) for x in v.split(",")] if v else [] for v in (a.bands, a.positions)]
    res = split(report, a.ngram, a.repeated, *edges)
    if a.positions and not any("accepted_by_prompt" in m for m in report["methods"].values()):
        print(f"{a.report}: no accepted_by_prompt (a report from before the fourteenth GPU session): no --positions "
              "split", file=sys.stderr)
    for name, parts in res.items():
        print(name)
        for part, r in parts.items():
            t = "-" if r["tau"] is None else f"{r['tau']:.3f}"
            n = f"{r['rounds']:6d} rounds" if "rounds" in r else f"{r['prompts']:3d} prompts  {r['new_tokens']:6d} tokens"
            print(f"  {part:17s} tau {t:>6s}  {n}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
