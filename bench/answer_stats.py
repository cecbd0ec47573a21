"""What the training answers look like, by turn: regenerated shards against the data set's original answers.

    python3 bench/answer_stats.py REGEN_DIR [REGEN_DIR ...] [--original sharegpt] [--ngram 6] [--loop 0.5]
                                  [--limit 0] [--target smollm2]

For each source (each regen folder, and the original answers of the same conversations when --original names a
data set), and for the first, second, third and later answers of a conversation: how many answers, their mean
length in target tokens, the share that hit the regen cap (`finish_reason` "length"; regen records only), the mean
share of repeated n-grams (the measure of `bench/tau_by_text.py`), and the share of answer tokens that sit in
answers whose repeated share is at least --loop ("looping" answers). The fifteenth GPU session trained one drafter
on every turn regenerated and one on the first answer regenerated plus the original later turns: this says how the
later turns of the two differ.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eyas.util import repeated_share  # noqa: E402  (the repo root is on sys.path above)

BUCKETS = ("1", "2", "3", "4+")


def bucket(i: int) -> str:
    return BUCKETS[min(i, 3)]


def regen_answers(d: Path, limit: int = 0):
    """(conversation id, answer index, text, hit the cap) for every answer of every record in d's shards."""
    n = 0
    for shard in sorted(d.glob("shard-*.jsonl")):
        with open(shard, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line of a killed run: the regen stage skips it too
                turns = rec.get("meta", {}).get("turns", [])
                answers = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
                for i, text in enumerate(answers):
                    capped = i < len(turns) and turns[i].get("finish_reason") == "length"
                    yield rec["id"], i, text, capped
                n += 1
                if limit and n >= limit:
                    return


def original_answers(source: str, ids: set[str]):
    from eyas.data.readers import read_dataset

    convs, _ = read_dataset(source)
    for c in convs:
        if c.id in ids:
            for i, t in enumerate(t for t in c.turns if t.role == "assistant"):
                yield c.id, i, t.content, None


def stats(rows, tok, ngram: int, loop: float) -> dict:
    acc = {b: {"answers": 0, "tokens": 0, "capped": 0, "capped_known": 0, "share_sum": 0.0, "loop_tokens": 0}
           for b in BUCKETS}
    for _, i, text, capped in rows:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        s = repeated_share(ids, ngram)
        a = acc[bucket(i)]
        a["answers"] += 1
        a["tokens"] += len(ids)
        a["share_sum"] += s
        a["loop_tokens"] += len(ids) if s >= loop else 0
        if capped is not None:
            a["capped_known"] += 1
            a["capped"] += bool(capped)
    out = {}
    for b, a in acc.items():
        if not a["answers"]:
            continue
        out[b] = {"answers": a["answers"], "mean_tokens": round(a["tokens"] / a["answers"], 1),
                  "capped": round(a["capped"] / a["capped_known"], 3) if a["capped_known"] else None,
                  "mean_repeated_share": round(a["share_sum"] / a["answers"], 3),
                  "tokens_in_looping_answers": round(a["loop_tokens"] / a["tokens"], 3) if a["tokens"] else None}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("regen", nargs="+", help="regen folders (RUN/data/regen) holding shard-*.jsonl")
    ap.add_argument("--original", default="", help="also the original answers of the first folder's conversations "
                                                    "from this data set (e.g. sharegpt)")
    ap.add_argument("--ngram", type=int, default=6, help="n of the repeated n-grams")
    ap.add_argument("--loop", type=float, default=0.5, help="repeated share at which an answer counts as looping")
    ap.add_argument("--limit", type=int, default=0, help="read at most this many records per folder (0 = all)")
    ap.add_argument("--target", default="smollm2", help="preset whose tokenizer counts the tokens")
    args = ap.parse_args(argv)

    from eyas.config import TargetConfig
    from eyas.target import load_tokenizer

    tok = load_tokenizer(TargetConfig(name=args.target))
    report = {}
    ids: set[str] = set()
    for k, d in enumerate(args.regen):
        d = Path(d)
        if not any(d.glob("shard-*.jsonl")):
            raise SystemExit(f"{d}: no regen shards (shard-*.jsonl) there")
        rows = list(regen_answers(d, args.limit))
        if k == 0:
            ids = {r[0] for r in rows}
        report[str(d)] = stats(rows, tok, args.ngram, args.loop)
    if args.original:
        report[f"original ({args.original})"] = stats(original_answers(args.original, ids), tok, args.ngram,
                                                      args.loop)
    for src, by in report.items():
        print(src)
        for b, s in by.items():
            print(f"  answer {b:3s} {s['answers']:7d} answers  {s['mean_tokens']:7.1f} tokens  capped "
                  f"{'-' if s['capped'] is None else s['capped']:>6}  repeated {s['mean_repeated_share']:.3f}  "
                  f"in looping answers {s['tokens_in_looping_answers']}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
