"""Time the tokenize stage's work (`eyas.data.prepare.tokenize_all`, then the join into flat tensors:
`TokenSet.from_tokenized`) with several worker counts, on the same conversations, and check that every count gives
the same tokens and masks.

    PYTHONPATH=. python3 bench/bench_tokenize.py --limit 4000 --workers 1,2 [--run RUN] [--out FILE]

Conversations: the training conversations of an eyas run folder (`--run`: its eyas.toml and its regenerated
answers, as the stage reads them), or else the first `--limit` records of the ShareGPT package's training split
(their original answers, every turn). The target's tokenizer comes from the run's config or the SmolLM2 preset."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path


def digest(items) -> str:
    h = hashlib.sha256()
    for t in items:
        h.update(t.id.encode())
        h.update(json.dumps([list(t.input_ids), list(t.loss_mask)]).encode())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="", help="an eyas run folder whose training conversations to tokenize")
    p.add_argument("--limit", type=int, default=4000, help="without --run: this many ShareGPT training records")
    p.add_argument("--workers", default="1,2", help="comma list of data.tokenize_workers values to time")
    p.add_argument("--out", default="", help="write the results as JSON here")
    a = p.parse_args(argv)

    from eyas import config as C
    from eyas.data.prepare import TokenSet, tokenize_all, training_conversations
    from eyas.data.readers import read_dataset, select_split
    from eyas.target import find_eot_ids, load_tokenizer

    if a.run:
        cfg = C.resolve(str(Path(a.run) / "eyas.toml"))
        convs, source = training_conversations(cfg)
    else:
        cfg = C.resolve(None, "smollm2", {})
        convs, _ = read_dataset("sharegpt", limit=0)
        convs = select_split(convs, "train", cfg.data.val_ratio, cfg.data.test_ratio)[:a.limit]
        source = f"sharegpt train split, first {len(convs)} records"
    tok = load_tokenizer(cfg.target)
    eot = find_eot_ids(tok)  # the template's and the tokenizer's (the stage adds the generation config's EOS)
    res = {"bench": "tokenize", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "source": source,
           "conversations": len(convs), "cores": len(os.sched_getaffinity(0)), "runs": [],
           "command": " ".join([sys.executable, *sys.argv])}
    for w in [int(x) for x in a.workers.split(",")]:
        t0 = time.perf_counter()
        items, stats = tokenize_all(convs, tok, cfg, eot, workers=w)
        dt = time.perf_counter() - t0
        TokenSet.from_tokenized(items)  # the stage then joins them into its flat tensors
        join = time.perf_counter() - t0 - dt
        r = {"workers": w, "seconds": round(dt, 2), "join_seconds": round(join, 2), "conv_per_s": round(len(convs) / dt, 1),
             "tokens": sum(len(t.input_ids) for t in items), "digest": digest(items), **stats}
        res["runs"].append(r)
        print(json.dumps(r), flush=True)
    res["same_result"] = len({r["digest"] for r in res["runs"]}) == 1
    print(f"same tokens and masks for every worker count: {res['same_result']}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0 if res["same_result"] else 1


if __name__ == "__main__":
    sys.exit(main())
