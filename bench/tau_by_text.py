"""Where acceptance comes from, by kind of text: from a bench_decode.py results file, each prompt's tau at each K
against how much the target's own answer repeats itself (the share of its n-grams that already occurred earlier in
the same answer; greedy SmolLM2 often loops). Prints tau over the prompts in each repetition band, and over all.

    python3 bench/tau_by_text.py results.json [--n 6] [--bands 0,0.1,0.5,1.01]

Uses each speculative method's per-prompt counts (new tokens, rounds, accepted drafts) and the plain method's
outputs of the same variant (the text every method of that variant wrote, since all are lossless).
"""
from __future__ import annotations

import argparse
import json


def repetition(tokens: list[int], n: int) -> float:
    """Share of the n-grams of `tokens` that occurred earlier in it (0: no repeats; near 1: a loop)."""
    seen, rep, total = set(), 0, 0
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i:i + n])
        total += 1
        rep += g in seen
        seen.add(g)
    return rep / total if total else 0.0


def tau(rows: list[list[int]]) -> float | None:
    """Tokens per target forward over prompts' [new tokens, rounds, accepted drafts] (accepted + rounds, as
    Generation.acceptance_length)."""
    rounds = sum(r[1] for r in rows)
    return (sum(r[2] for r in rows) + rounds) / rounds if rounds else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a bench/bench_decode.py --out file")
    ap.add_argument("--n", type=int, default=6, help="n-gram length for the repetition share")
    ap.add_argument("--bands", default="0,0.1,0.5,1.01", help="band edges of the repetition share")
    a = ap.parse_args()
    methods = json.load(open(a.results))["methods"]
    edges = [float(x) for x in a.bands.split(",")]
    for name, m in methods.items():
        if not name.startswith("eyas_spec_k") or "per_prompt" not in m:
            continue
        plain = methods.get("eyas_plain" + m.get("variant", ""), {})
        outs = plain.get("outputs")
        if not outs or len(outs) < len(m["per_prompt"]):
            continue
        reps = [repetition(o, a.n) for o in outs[:len(m["per_prompt"])]]
        parts = []
        for lo, hi in zip(edges, edges[1:]):
            rows = [r for r, x in zip(m["per_prompt"], reps) if lo <= x < hi]
            t = tau(rows)
            parts.append(f"[{lo:g},{hi:g}): {len(rows):2d} prompts, {sum(r[0] for r in rows):5d} tokens, tau "
                         + (f"{t:.3f}" if t else "-"))
        print(f"{name:26s} all {tau(m['per_prompt']):.3f} | " + " | ".join(parts))


if __name__ == "__main__":
    main()
