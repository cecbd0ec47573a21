"""bf16 against fp32 on the CPU, for the two stages that `AUTO_CPU_BF16` switches: the target's
capture forward (regen and extraction run the same model) and the drafter's training step.

    PYTHONPATH=. python bench/cpu_bf16.py --run RUN

RUN is a finished CPU run directory with stored features (e.g. `eyas run --out RUN` on a CPU). The
capture times 2 passes over 4 random 384-token sequences after a warm-up; the training step times
10 micro-batches of 1,024 tokens after 2 warm-up batches, under bf16 autocast or none.
"""
from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="CPU run directory with data/, vocab/ and features/")
    a = ap.parse_args()

    from eyas.config import TargetConfig, resolve
    from eyas.data.prepare import load_tokens
    from eyas.target import load_target
    from eyas.train import Data, initial_drafter, make_features
    from eyas.ttt import target_labels, ttt_unroll
    from eyas.vocab import load_vocab

    x = torch.randint(0, 40000, (4, 384))
    for dt in ("float32", "bfloat16"):
        t = load_target(TargetConfig(name="smollm2", dtype=dt, device="cpu"))
        with torch.no_grad():
            t.capture(x[:1, :64])
            t0 = time.perf_counter()
            for _ in range(2):
                t.capture(x)
        print(f"capture {dt}: {2 * x.numel() / (time.perf_counter() - t0):.0f} tok/s")

    run = Path(a.run)
    cfg = resolve(preset_name="smollm2", overrides={"out": str(run), "train.online": False,
                                                    "train.batch_tokens": 1024, "train.max_seq_len": 384})
    t = load_target(cfg.target)
    ids = load_vocab(run, t)
    tokens = load_tokens(run, "train")
    data = Data(tokens, make_features(cfg, t, tokens, "train"), 384, 1024)
    bins = data.bins(0)[:12]
    lm_head = t.model.get_output_embeddings()
    for mode in ("fp32", "bf16"):
        torch.manual_seed(0)
        d = initial_drafter(cfg, t, ids).float()
        opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-3)
        ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode == "bf16" else contextlib.nullcontext
        tok = 0
        for i, b in enumerate(bins):
            if i == 2:
                t0, tok = time.perf_counter(), 0
            batch = data.batch(b, "cpu", 1)
            with ctx():
                lab = target_labels(batch.final, lm_head, d.draft_ids, top=batch.top)
                st = ttt_unroll(d, batch, lab, 3)
                loss = sum(ls / c.clamp(min=1) for ls, c in zip(st.loss_sum, st.count))
            loss.backward()
            opt.step()
            opt.zero_grad()
            tok += batch.n_real
        print(f"train step {mode}: {tok / (time.perf_counter() - t0):.0f} tok/s")


if __name__ == "__main__":
    main()
