"""Benchmark `eyas regen` (embedded backend, each engine in --engine) against plain transformers
`generate`, same batch size, same prompts, same machine, same run.

    EYAS_STAGE_DIR=/path/with/smollm2-135m-instruct.gguf+sharegpt.json.gz \
        PYTHONPATH=. python3 bench/bench_regen.py --prompts 1000 --engine static,generate --out results.json

Prompts are the first user turns of ShareGPT conversations (at most --max-prompt-tokens tokens),
answered greedily with up to --max-new-tokens tokens each. eyas regen runs the whole stage (prompt
rendering, generation, shard writing) over all prompts, once per engine, with data.max_seq_len set just
above --max-prompt-tokens (the static engine sizes its KV cache from it); the baseline runs `model.generate` on
batches of the same prompts in their given order, left-padded, for --baseline-batches batches (it is
slow: time-boxed). Both count generated tokens up to and including the end-of-turn token. Both are warmed
up first, untimed: generate with one batch, eyas regen with 2 x batch prompts on the first engine.
--random-init uses SmolLM2's architecture with random weights (no GGUF needed; answers never end
early, so it measures full-length batches only).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def load(args):
    from eyas.config import TargetConfig
    from eyas.target import load_target

    if not args.random_init:
        return load_target(TargetConfig(name=args.target))
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = args.target  # an HF folder holding config.json and the tokenizer
    conf = AutoConfig.from_pretrained(src)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(conf)
    out = Path(tempfile.mkdtemp(prefix="eyas-bench-model-"))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return load_target(TargetConfig(name=str(out)))


def prompts(target, n: int, max_tokens: int) -> list[str]:
    from eyas.data import read_dataset

    convs, _ = read_dataset("sharegpt", limit=n * 4)
    out = []
    for c in convs:
        user = next((t.content for t in c.turns if t.role == "user"), "")
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                   add_generation_prompt=True)
        if user.strip() and len(target.tokenizer(ids, add_special_tokens=False).input_ids) <= max_tokens:
            out.append(user)
        if len(out) == n:
            break
    if len(out) < n:
        print(f"note: only {len(out)} prompts of at most {max_tokens} tokens found", file=sys.stderr)
    return out


def regen_config(users: list[str], args, engine: str, batch_size: int | None = None):
    """A fresh run directory whose data set is `users` (one user turn each), and the config that
    regenerates them greedily with `engine` (its name, without settings) at the sizes in `args`, `batch_size` rows
    (default --batch-size) decoded together."""
    from eyas.config import Config

    tmp = Path(tempfile.mkdtemp(prefix="eyas-bench-regen-"))
    src = tmp / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": u}]}) + "\n"
                           for i, u in enumerate(users)))
    cfg = Config(out=str(tmp / "run"))
    cfg.data.source = str(src)
    cfg.data.max_seq_len = args.max_prompt_tokens + 64  # room for rendering differences; none is refused
    r = cfg.regen
    r.split, r.turns, r.max_new_tokens, r.temperature = "all", 1, args.max_new_tokens, 0.0
    r.batch_size, r.shard_size, r.engine = batch_size or args.batch_size, 256, engine
    return cfg


VARIANT_KEYS = {"bs": None, "groups": "row_groups", "check": "check_every", "long": "long_prompt", "fuse": "fuse",
                "overlap": "overlap", "norm": "fused_norm", "norm1k": "norm_one_kernel", "flex": "flex_decode"}


def bench_eyas(target, users: list[str], args, engine: str) -> dict:
    """One engine, optionally with StaticEngine settings changed for this run: `static:groups=0:check=16`
    (row groups off, a host check every 16 decode steps; `bs=N` decodes N rows together instead of --batch-size,
    `long=N` sets the long-prompt threshold, `fuse=0`
    runs q/k/v and gate/up as separate products, `overlap=0` waits for each check before queueing the next steps,
    `norm=0` runs the model's own RMSNorm modules instead of torch's fused kernel, `norm1k=0` the fused kernel
    with HF's rounding steps instead of one kernel in the model's dtype, `flex=1` decode steps through flex attention
    bounded by each row's own position)."""
    from eyas.data.regen import run_regen
    from eyas.engine.generate import StaticEngine
    from eyas.engine.fastlm import FastLM

    name, *opts = engine.split(":")
    saved = {}
    bs = args.batch_size
    for o in opts:
        k, _, v = o.partition("=")
        attr = VARIANT_KEYS[k]
        if attr is None:  # bs: rows decoded together, a regen setting rather than an engine attribute
            bs = int(v)
            continue
        cls = FastLM if hasattr(FastLM, attr) else StaticEngine
        saved[(cls, attr)] = getattr(cls, attr)
        setattr(cls, attr, bool(int(v)) if isinstance(saved[(cls, attr)], bool) else int(v))
    cfg = regen_config(users, args, name, bs)
    sync()
    t0 = time.perf_counter()
    try:
        rep = run_regen(cfg, target=target)
    finally:
        for (cls, attr), v in saved.items():
            setattr(cls, attr, v)
    sync()
    dt = time.perf_counter() - t0
    gen = rep["completion_tokens"].get("total", 0) + (rep["assistant_turns"] - rep["truncated_turns"])  # + eot
    return {"prompts": len(users), "batch_size": cfg.regen.batch_size, "records": rep["records"],
            "errors": rep["errors"], "seconds": round(dt, 2),
            "generated_tokens": gen, "tokens_per_s": round(gen / dt, 1), "engine": engine,
            "truncated_turns": rep["truncated_turns"]}


def bench_generate(target, users: list[str], args, static: bool = False) -> dict:
    import torch

    tok, model = target.tokenizer, target.model
    eot = target.eot_token_ids
    pad = eot[0]
    texts = [tok.apply_chat_template([{"role": "user", "content": u}], tokenize=False, add_generation_prompt=True)
             for u in users]
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eot, pad_token_id=pad)
    if static:
        kw["cache_implementation"] = "static"
    total_tok, total_s, batches = 0, 0.0, 0
    bs = args.batch_size
    for b in range(args.baseline_batches + 1):  # batch 0 is a warm-up
        chunk = texts[(b * bs) % len(texts):][:bs]
        if len(chunk) < bs:
            chunk = (chunk + texts)[:bs]
        enc = [tok(t, add_special_tokens=False).input_ids for t in chunk]
        width = max(map(len, enc))
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc], device=target.device)
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc], device=target.device)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **kw)
        sync()
        dt = time.perf_counter() - t0
        n = 0
        for row in out[:, width:].tolist():
            k = next((i for i, x in enumerate(row) if x in eot), None)
            n += len(row) if k is None else k + 1
        if b > 0:
            total_tok, total_s, batches = total_tok + n, total_s + dt, batches + 1
        if b > 0 and total_s > args.baseline_seconds:
            break
    return {"batches": batches, "batch_size": bs, "seconds": round(total_s, 2), "generated_tokens": total_tok,
            "tokens_per_s": round(total_tok / max(total_s, 1e-9), 1),
            "cache": "static" if static else "dynamic"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--baseline-batches", type=int, default=2,
                   help="timed generate batches (after one warm-up); 0 = no baseline (comparing eyas settings only)")
    p.add_argument("--baseline-seconds", type=float, default=120, help="stop the baseline after this long")
    p.add_argument("--static-baseline", action="store_true", help="also time generate with a static cache")
    p.add_argument("--engine", default="static,generate",
                   help="eyas regen engines to time, comma-separated (auto, static, continuous, generate); static "
                        "variants change engine settings for one run: static:groups=0, static:check=16, "
                        "static:long=512, static:fuse=0, static:overlap=1, static:norm=1, static:flex=1 (combine with more "
                        "colons)")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--random-init", action="store_true", help="random weights with --target's architecture")
    p.add_argument("--out", default="results.json")
    args = p.parse_args(argv)
    engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    bad = [e for e in engines if e.split(":")[0] not in ("auto", "static", "continuous", "generate")
           or any(o.partition("=")[0] not in VARIANT_KEYS or not o.partition("=")[2].isdigit() for o in e.split(":")[1:])]
    if not engines or bad:
        p.error(f"--engine: {bad or args.engine!r}: not a comma-separated list of auto, static, continuous, generate "
                f"(static may add :bs=N, :groups=0|1, :check=N, :long=N, :fuse=0|1, :overlap=0|1, :norm=0|1, "
                f":flex=0|1)")

    import torch
    import transformers

    t0 = time.perf_counter()
    target = load(args)
    users = prompts(target, args.prompts, args.max_prompt_tokens)
    print(f"loaded {target.name} ({target.dtype}, {target.device}) and {len(users)} prompts in "
          f"{time.perf_counter() - t0:.0f}s", file=sys.stderr)
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if torch.cuda.is_available()
           else platform.processor() or "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
           "target": target.name, "random_init": args.random_init, "dtype": str(target.dtype),
           "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "temperature": 0.0,
           "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    # untimed: the first regen of a process pays one-off costs (CUDA and cuBLAS set-up, graph captures), which
    # would inflate the first engine's time (generate's warm-up is its batch 0)
    warm = bench_eyas(target, users[: 2 * args.batch_size], args, engines[0])
    res["warm_up"] = {"engine": engines[0], "prompts": warm["prompts"], "seconds": warm["seconds"]}
    res["eyas_regen"] = {}
    for e in engines:
        key = e if e not in res["eyas_regen"] else f"{e}#{sum(k.split('#')[0] == e for k in res['eyas_regen']) + 1}"
        res["eyas_regen"][key] = bench_eyas(target, users, args, e)
        print(f"eyas regen ({key}): {res['eyas_regen'][key]}", file=sys.stderr)
    if args.baseline_batches > 0:
        res["hf_generate"] = bench_generate(target, users, args)
        print(f"hf generate: {res['hf_generate']}", file=sys.stderr)
        base = res["hf_generate"]["tokens_per_s"]
    else:  # the first engine is the baseline
        base = next(iter(res["eyas_regen"].values()))["tokens_per_s"]
    if args.static_baseline:
        res["hf_generate_static"] = bench_generate(target, users, args, static=True)
        base = max(base, res["hf_generate_static"]["tokens_per_s"])
    res["speedup"] = {e: round(r["tokens_per_s"] / max(base, 1e-9), 2) for e, r in res["eyas_regen"].items()}
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    rows = [(f"eyas regen ({e})", r) for e, r in res["eyas_regen"].items()]
    if "hf_generate" in res:
        rows.append(("transformers generate", res["hf_generate"]))
    if args.static_baseline:
        rows.append(("transformers generate, static cache", res["hf_generate_static"]))
    print(f"\n{res['device']}, {target.name}, batch {args.batch_size}, greedy, max {args.max_new_tokens} new tokens")
    print(f"{'what':<40} {'tokens':>10} {'seconds':>9} {'tok/s':>10}")
    for name, r in rows:
        print(f"{name:<40} {r['generated_tokens']:>10} {r['seconds']:>9} {r['tokens_per_s']:>10}")
    head = "speedup over the strongest baseline: " if "hf_generate" in res else f"over {engines[0]}: "
    print(head + ", ".join(f"{e} {x}x" for e, x in res["speedup"].items()) + f"  (written to {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
