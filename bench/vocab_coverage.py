"""How much of other text a run's draft vocabulary covers: a target token outside it is a rejected draft wherever
the target would emit it, so coverage bounds each draft position's acceptance.

    PYTHONPATH=. python3 bench/vocab_coverage.py RUN [--show 20]

Text sets: HumanEval's canonical solutions (code as the benchmark expects it; the decoder's HumanEval prompts ask
for such a completion) and the original answers of the held-out ShareGPT test conversations (`eval.prompts`'
split). Prints, per set, the tokens, the share inside the vocabulary, and the most frequent tokens outside it.
"""
import argparse
import gzip
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.config import resolve  # noqa: E402
from eyas.data import read_dataset, select_split  # noqa: E402
from eyas.data.readers import humaneval_path  # noqa: E402
from eyas.target import load_tokenizer  # noqa: E402
from eyas.vocab import load_vocab  # noqa: E402


def coverage(ids: list[int], inside: set[int]) -> tuple[int, float, Counter]:
    missed = Counter(t for t in ids if t not in inside)
    return len(ids), 1 - sum(missed.values()) / max(1, len(ids)), missed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a run directory with vocab/vocab.safetensors")
    ap.add_argument("--show", type=int, default=20, help="most frequent tokens outside the vocabulary to print")
    ap.add_argument("--limit", type=int, default=400, help="held-out ShareGPT conversations to read")
    a = ap.parse_args()
    cfg = resolve(None, "smollm2", {})
    tok = load_tokenizer(cfg.target)
    inside = set(load_vocab(a.run).tolist())
    sets = {}
    with gzip.open(humaneval_path(), "rt") as f:
        probs = [json.loads(x) for x in f if x.strip()]
    sets["humaneval canonical solutions"] = [t for p in probs for t in tok.encode(p["canonical_solution"],
                                                                                  add_special_tokens=False)]
    sets["humaneval prompts + solutions"] = [t for p in probs for t in tok.encode(
        p["prompt"] + p["canonical_solution"], add_special_tokens=False)]
    convs = select_split(read_dataset("sharegpt", strict=False)[0], "test", cfg.data.val_ratio, cfg.data.test_ratio)
    sets["sharegpt test answers"] = [t for c in convs[: a.limit] for x in c.turns if x.role == "assistant"
                                     for t in tok.encode(x.content, add_special_tokens=False)]
    out = {}
    for name, ids in sets.items():
        n, cov, missed = coverage(ids, inside)
        out[name] = {"tokens": n, "coverage": cov, "missed": [[tok.decode([t]), c] for t, c in missed.most_common(a.show)]}
        print(f"{name}: {n:,} tokens, {100 * cov:.2f}% inside the draft vocabulary ({len(inside):,} ids)")
        print("   outside, most frequent: " + ", ".join(f"{s!r} {c}" for s, c in out[name]["missed"]))
    print(json.dumps({k: {"tokens": v["tokens"], "coverage": v["coverage"]} for k, v in out.items()}))


if __name__ == "__main__":
    main()
