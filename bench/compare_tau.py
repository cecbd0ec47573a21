"""Two drafters' τ on the same prompts, and whether they differ: a paired bootstrap over the prompts.

    python3 bench/compare_tau.py A.json B.json [--method eyas_spec_k3_fused] [--out diff.json]

A and B are `bench/bench_decode.py` reports (each prompt's accepted drafts per round, "accepted_by_prompt") or
`eyas eval` reports (each conversation's rounds, "rounds_by_conversation", since the thirty-eighth session) of the
same prompts. Greedy decoding writes the target's own text whatever the drafter, so prompt i of A and prompt i of B
differ only in how many rounds that text took, and the difference A - B is drawn with the same prompts on both
sides (`eyas.evaluate.tau_difference`): the prompts' own ease cancels, which the two τ's separate intervals do not
do. bench_decode's time box may end the two methods after different numbers of prompts: the first prompts both
reached are compared. Where both reports keep the texts (the method's "outputs", else plain decoding's, which
bench_decode checks the method against in "same_as_plain"), the count of prompts with the same text is printed; at temperature 0 every one should be the same, and a pair that is not (another engine or dtype) still
pairs by prompt, which the count lets the reader weigh.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eyas.evaluate import round_sums, tau_difference


def groups(path: str, method: str | None) -> tuple[list[tuple[int, int]], list | None, str]:
    """The report's groups (Σ (accepted + 1), rounds) in prompt order, its texts where kept, and what was read."""
    try:
        rep = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"{path}: cannot read a JSON report ({e})")
    if "rounds_by_conversation" in rep:
        return [tuple(g) for g in rep["rounds_by_conversation"]], None, "eval conversations"
    methods = rep.get("methods")
    if not isinstance(methods, dict):
        sys.exit(f"{path}: neither an eyas eval report with rounds_by_conversation (eyas 0.1 since the thirty-eighth "
                 f"session) nor a bench_decode report with methods")
    spec = [m for m, v in methods.items() if "accepted_by_prompt" in v]
    if method is None:
        if not spec:
            sys.exit(f"{path}: no speculative method with accepted_by_prompt")
        method = spec[0]
    if method not in spec:
        sys.exit(f"{path}: no method {method!r} with accepted_by_prompt (there: {', '.join(spec) or 'none'})")
    m = methods[method]
    # bench_decode keeps plain decoding's texts and, for a speculative method, whether each equals plain's
    # ("same_as_plain"): the plain texts of the two reports then stand for the methods'
    texts = m.get("outputs") or methods.get("eyas_plain", {}).get("outputs")
    what = method + (f" (same as plain: {m['same_as_plain']})" if "same_as_plain" in m else "")
    return [round_sums(a) for a in m["accepted_by_prompt"]], texts, what


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="report A (bench_decode JSON or eval report.json)")
    p.add_argument("b", help="report B, of the same prompts")
    p.add_argument("--method", default=None,
                   help="bench_decode method in both reports (default: each report's first speculative one)")
    p.add_argument("--level", type=float, default=0.95, help="the interval's level (default 0.95)")
    p.add_argument("--out", default="", help="also write the result here as JSON")
    a = p.parse_args(argv)
    ga, ta, ra = groups(a.a, a.method)
    gb, tb, rb = groups(a.b, a.method)
    n = min(len(ga), len(gb))
    res = tau_difference(ga[:n], gb[:n], level=a.level)
    if res is None:
        sys.exit(f"fewer than two prompts with rounds in both reports ({len(ga)} and {len(gb)} prompts)")
    res = {"a": a.a, "b": a.b, "read": [ra, rb], "prompts_a": len(ga), "prompts_b": len(gb), **res}
    if ta is not None and tb is not None:  # over the compared prompts that have a text in both
        k = min(n, len(ta), len(tb))
        res["same_text"] = f"{sum(x == y for x, y in zip(ta[:k], tb[:k]))}/{k}"
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
