"""What the target costs a training epoch when its features do not all fit: train.feature_cache_keep=longest
against shortest, at the same budget, on the same epoch's batches.

    PYTHONPATH=. python3 bench/feature_keep.py --out keep.json [--fraction 0.6] [--conversations 1500]

Tokenizes N ShareGPT conversations (as bench/bench_train.py does; EYAS_STAGE_DIR or the PyPI packages), packs one
epoch's micro-batches of --batch-tokens as the training does (eyas.train.pack_indices), then for each policy
builds the online features with a cache of --fraction of all their bytes (on the target's device, no host tier),
warms it as the training does (timed apart) and times the features of every micro-batch of the epoch, the device
synchronised after each: the time the training step waits for them. Reports per policy the epoch's feature
seconds, the tokens computed again, the micro-batches that needed a forward, and the warm-up. The policies run in
turn, --repeat times, each on a fresh cache; the target stays loaded.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="feature_keep.json", help="results file (JSON)")
    p.add_argument("--conversations", type=int, default=1500, help="ShareGPT conversations to tokenize")
    p.add_argument("--batch-tokens", type=int, default=8192, help="train.batch_tokens: tokens per micro-batch")
    p.add_argument("--max-seq-len", type=int, default=2048, help="data.max_seq_len and train.max_seq_len")
    p.add_argument("--fraction", type=float, default=0.6,
                   help="the cache's budget as a share of all the sequences' feature bytes (0 < f < 1)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of both policies, in turn")
    p.add_argument("--order", default="longest,shortest", choices=("longest,shortest", "shortest,longest"),
                   help="which policy runs first in each round")
    p.add_argument("--device", default="auto", help="target.device: auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="target.dtype (auto: bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--seed", type=int, default=0, help="the epoch's packing seed")
    p.add_argument("--workdir", default="", help="folder for the tokenized data, reused when there (default: a "
                                                 "temporary one)")
    p.add_argument("--data", default="", help="data set (default: sharegpt, which eyas reads from $EYAS_STAGE_DIR/"
                                              "sharegpt.json.gz when there, else from the PyPI package)")
    a = p.parse_args(argv)
    if not 0 < a.fraction < 1:
        p.error(f"--fraction {a.fraction}: between 0 and 1, so that some sequences fit and some do not")

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from eyas.config import resolve
    from eyas.data.prepare import load_tokens, run_tokenize, tokens_dir
    from eyas.features import OnlineFeatures
    from eyas.target import load_target
    from eyas.train import pack_indices

    run = a.workdir or tempfile.mkdtemp(prefix="eyas-bench-keep-")
    cfg = resolve(preset_name="smollm2", overrides={
        "out": run, "data.source": a.data or "sharegpt", "data.limit": a.conversations, "data.max_seq_len": a.max_seq_len,
        "train.max_seq_len": a.max_seq_len, "train.batch_tokens": a.batch_tokens, "target.device": a.device,
        **({"target.dtype": a.dtype} if a.dtype != "auto" else {})})
    target = load_target(cfg.target)
    if not (tokens_dir(Path(run)) / "meta.json").exists():
        run_tokenize(cfg, target)
    tokens = load_tokens(run, "train")
    dev = torch.device(target.device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    lengths = [min(int(x), a.max_seq_len) for x in tokens.lengths()]
    bins = pack_indices(lengths, a.batch_tokens, a.seed)
    fwd_tokens = max(cfg.features.batch_tokens, a.batch_tokens)
    probe = OnlineFeatures(target, tokens, max_batch_tokens=fwd_tokens)
    i0 = min(range(len(tokens)), key=lambda i: lengths[i])
    s0 = probe.get([i0])[0]
    per_token = sum(t.numel() * t.element_size() for t in (s0.aux, s0.final, s0.top)) / lengths[i0]
    total = per_token * sum(lengths)
    budget = int(total * a.fraction)
    print(f"{len(tokens)} sequences, {sum(lengths):,} tokens, {len(bins)} micro-batches of <= {a.batch_tokens}; "
          f"features {per_token:,.0f} B/token, {total / 1e9:.2f} GB; cache {budget / 1e9:.2f} GB "
          f"({a.fraction:.0%}); {dev}", flush=True)

    rounds = []
    for r in range(a.repeat):
        for keep in a.order.split(","):
            feats = OnlineFeatures(target, tokens, max_batch_tokens=fwd_tokens, cache_bytes=budget)
            sync()
            t = time.perf_counter()
            kept = feats.warm(list(range(len(tokens))), cfg.features.batch_tokens, keep=keep)
            sync()
            warm_s = time.perf_counter() - t
            m0 = feats.misses
            recomputed = with_forward = 0
            t = time.perf_counter()
            for b in bins:
                missing = [i for i in b if i not in feats.cache]
                feats.get(b)
                sync()
                if missing:
                    with_forward += 1
                    recomputed += sum(lengths[i] for i in missing)
            epoch_s = time.perf_counter() - t
            row = {"round": r, "keep": keep, "kept": kept, "of": len(tokens), "warm_s": round(warm_s, 3),
                   "warm_tokens": feats.warm_tokens, "epoch_feature_s": round(epoch_s, 3),
                   "micro_batches_with_forward": with_forward, "micro_batches": len(bins),
                   "tokens_recomputed": recomputed, "sequences_recomputed": feats.misses - m0,
                   "cached_bytes": feats.cached_bytes}
            rounds.append(row)
            print(json.dumps(row), flush=True)
            del feats
    out = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda"
           else "cpu", "torch": torch.__version__, "sequences": len(tokens), "tokens": sum(lengths),
           "micro_batches": len(bins), "bytes_per_token": per_token, "cache_bytes": budget, "rounds": rounds}
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
