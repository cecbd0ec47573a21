"""Acceptance length by the kind of text the target wrote, from a `bench/bench_decode.py` report.

    python3 bench/tau_by_text.py decode_sharegpt.json [--ngram 8 --repeated 0.3] [--bands 0,0.1,0.5,1.01]

bench_decode keeps plain decoding's tokens per prompt ("outputs" of eyas_plain) and, for each speculative
method, each prompt's new tokens, verify rounds and drafted tokens accepted ("per_prompt"). This splits every
speculative method's tau (tokens per target forward, as bench_decode counts it) two ways: prompts whose answer
ran to --max-new-tokens against those that stopped, and answers that repeat themselves (a share of repeated
n-grams above --repeated) against the rest; with --bands, also by bands of that share. Greedy decoding of a small
target loops often; a drafter that only predicts loops well shows it here. Each method is read against the plain
method of its own variant (`eyas_plain_norm1` for `_norm1` methods), whose text it wrote.
"""
from __future__ import annotations

import argparse
import json
import sys


def repeated_share(tokens: list[int], n: int) -> float:
    """Share of the answer's n-grams that occurred earlier in it."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def tau(rows: list[tuple]) -> dict:
    rounds = sum(r[1] for r in rows)
    acc = sum(r[2] for r in rows)
    return {"prompts": len(rows), "new_tokens": sum(r[0] for r in rows),
            "tau": (acc + rounds) / rounds if rounds else None}


def split(report: dict, ngram: int, repeated: float, bands: list[float] = ()) -> dict:
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
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", help="a bench_decode.py JSON report")
    ap.add_argument("--ngram", type=int, default=8, help="n-gram length for the repetition share")
    ap.add_argument("--repeated", type=float, default=0.3,
                    help="an answer is repetitive when more than this share of its n-grams came earlier in it")
    ap.add_argument("--bands", default="",
                    help="also split by bands of the repeated share, at these comma-separated edges (0,0.1,0.5,1.01)")
    a = ap.parse_args(argv)
    try:
        report = json.load(open(a.report))
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{a.report}: {e}")
    res = split(report, a.ngram, a.repeated, [float(x) for x in a.bands.split(",")] if a.bands else [])
    for name, parts in res.items():
        print(name)
        for part, r in parts.items():
            t = "-" if r["tau"] is None else f"{r['tau']:.3f}"
            print(f"  {part:15s} tau {t:>6s}  {r['prompts']:3d} prompts  {r['new_tokens']:6d} tokens")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
