"""Where the static regeneration engine's time goes (GPU): one decode step by attended span, one prefill
chunk, and a whole `eyas regen` run with its decode steps and prefill tokens counted.

    EYAS_STAGE_DIR=... PYTHONPATH=. python3 bench/profile_regen.py --prompts 1024 --out profile.json

Parts, each timed with CUDA events after a warm-up:
- `step_ms[span]`: one decode step of all B rows (a CUDA graph replay) attending to `span` cache slots,
  greedy and with temperature/top-p sampling;
- `prefill_ms`: one right-padded prefill of about 16,384 tokens at a few widths, with the kernels regen
  uses for prefills (`one_off`), the same shape repeated;
- `run`: `eyas regen` (static engine, greedy) over the prompts, with the number of decode steps, the
  spans they attended to, the prefill tokens, and the time those would take at the rates above
  (`modelled_s`) against the measured wall time; the gap is host work and waiting.
A torch.profiler table of a second, smaller run (2 x batch prompts) (top kernels by GPU time) is written next to --out.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(fn, n: int = 20) -> float:
    """Mean milliseconds of fn() over n calls after 3 warm-ups (CUDA events)."""
    import torch

    for _ in range(3):
        fn()
    if not torch.cuda.is_available():  # a smoke run on the CPU
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) * 1000 / n
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--out", default="profile.json")
    a = p.parse_args(argv)

    import torch

    from bench_regen import load, prompts, regen_config
    from eyas.data import regen as R
    from eyas.fastlm import DecodeGraph, FastLM

    a.random_init = False
    target = load(a)
    users = prompts(target, a.prompts, a.max_prompt_tokens)
    B = a.batch_size
    max_len = a.max_prompt_tokens + 64 + a.max_new_tokens
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "target": target.name, "batch": B, "max_len": max_len,
           "command": " ".join([os.path.basename(sys.executable), *sys.argv])}

    # one decode step by span, greedy and sampled
    from eyas.decode import probs_from_logits

    lm = FastLM(target.model, B, max_len)

    def sampled(logits):
        probs = probs_from_logits(logits, 0.8, 0.95)
        return (probs / torch.empty_like(probs).exponential_().clamp_min_(1e-30)).argmax(-1)

    res["step_ms"] = {}
    for name, pick in (("greedy", lambda lg: lg.argmax(-1)), ("top_p", sampled)):
        g = DecodeGraph(lm, pick)
        g.pos.fill_(10)
        row = {}
        for span in sorted({s for s in (256, 512, 1024) if s < max_len} | {max_len}):
            g.pos.fill_(span - 1)
            row[str(span)] = round(timed(lambda g=g, span=span: g(upto=span)), 3)
        res["step_ms"][name] = row
        del g
    logits = torch.randn(B, target.config.vocab_size, device=lm.device, dtype=lm.dtype)
    res["pick_ms"] = {"greedy": round(timed(lambda: logits.argmax(-1)), 3), "top_p": round(timed(lambda: sampled(logits)), 3)}
    res["prefill_ms"] = {}
    for width in [w for w in (128, 512, 1024) if w <= max_len]:
        rows = max(1, min(B, 16384 // width))
        ids = torch.randint(0, 1000, (rows, width), device=lm.device)
        zero = torch.zeros(rows, dtype=torch.long, device=lm.device)
        r = torch.arange(rows, device=lm.device)
        last = torch.full((rows,), width - 1, device=lm.device)
        res["prefill_ms"][f"{rows}x{width}"] = round(timed(
            lambda lm=lm, ids=ids, zero=zero, r=r, width=width, last=last:
            lm.forward(ids, zero, rows=r, upto=width, last_idx=last, one_off=True), n=5), 3)
    del lm
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    print(json.dumps({k: res[k] for k in ("step_ms", "pick_ms", "prefill_ms")}, indent=1), file=sys.stderr)

    # a whole regen run, counting what it did
    spans: collections.Counter = collections.Counter()
    prefill = {"calls": 0, "tokens": 0, "padded_tokens": 0}
    orig_call, orig_prefill = DecodeGraph.__call__, R.StaticEngine._prefill

    def call(self, upto=None, rows=None):
        spans[self.slots(upto)] += 1
        return orig_call(self, upto, rows)

    def pre(self, rows, items):
        prefill["calls"] += 1
        prefill["tokens"] += sum(len(p) for _, p, _ in items)
        prefill["padded_tokens"] += len(items) * max(len(p) for _, p, _ in items)
        return orig_prefill(self, rows, items)

    DecodeGraph.__call__, R.StaticEngine._prefill = call, pre

    def regen(us):
        return R.run_regen(regen_config(us, a, "static"), target=target)

    sync()
    t0 = time.perf_counter()
    rep = regen(users)
    sync()
    wall = time.perf_counter() - t0
    DecodeGraph.__call__, R.StaticEngine._prefill = orig_call, orig_prefill
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * gpu) as prof:  # a smaller run
        regen(users[: 2 * B])
    steps = sum(spans.values())
    greedy = res["step_ms"]["greedy"]

    def step_cost(span):  # nearest measured span at or above (row groups: the longest group's, an upper bound)
        span = max(span) if isinstance(span, tuple) else span
        keys = sorted(int(k) for k in greedy)
        return greedy[str(next((k for k in keys if k >= span), keys[-1]))]

    decode_s = sum(n * step_cost(s) for s, n in spans.items()) / 1000
    pre_rate = min(v / int(k.split("x")[0]) / int(k.split("x")[1]) for k, v in res["prefill_ms"].items())  # ms per token at the best width
    prefill_s = prefill["padded_tokens"] * pre_rate / 1000
    gen = rep["completion_tokens"].get("total", 0) + (rep["assistant_turns"] - rep["truncated_turns"])
    res["run"] = {"prompts": len(users), "wall_s": round(wall, 2), "generated_tokens": gen,
                  "tok_s": round(gen / wall, 1), "decode_steps": steps,
                  "steps_by_span": {str(k): v for k, v in sorted(spans.items())},
                  "row_utilisation": round(gen / max(steps * B, 1), 3), "prefill": prefill,
                  "modelled_s": {"decode": round(decode_s, 2), "prefill": round(prefill_s, 2)}}
    table = prof.key_averages().table(sort_by="cuda_time_total" if gpu else "cpu_time_total", row_limit=25)
    Path(a.out).with_suffix(".txt").write_text(table + "\n")
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res["run"], indent=1))
    print(table[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
