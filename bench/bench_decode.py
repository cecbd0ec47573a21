"""Decoding benchmark, batch 1, greedy: eyas speculative decoding vs plain decoding on the same engine
vs transformers `generate` (dynamic cache, static cache, prompt-lookup decoding), in one run.

    PYTHONPATH=. python3 bench/bench_decode.py --draft DIR --prompts sharegpt|humaneval \
        --limit 80 --k 3 --out results.json

Each method gets a warm-up and a time box (--budget seconds); tokens/s = new tokens / device-synced
wall time over the prompts it finished. A faster method finishes more prompts in its box, so each speculative
method also gets its speedup on the prompts both it and its plain baseline finished
(speedup_vs_plain_same_prompts, from each prompt's seconds). On a GPU, each method's entry also says what the card's SM clock,
temperature and power did while it ran ("gpu", bench/gpu_watch.py): a card still hot from a training run
slows a method down, which that record shows. ShareGPT prompts are the first user turn of held-out
(test-split) conversations.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time

# the tail of a variant flag's help: the values a run can time side by side
BOTH = "or 0,1 to time both (the 0 methods, their plain baseline included, get the suffix {})"


def target_variants(FastLM, Decoder) -> list[tuple]:
    """The variants of the target's forward and the decoding loop that one run can time side by side: (flag, the
    class attributes a value sets, as {(class, name): value}, the suffix of a value's method names ("" for the
    default)). Timed over every combination of the flags' values, the first flag outermost."""
    return [
        ("norm", lambda v: {(FastLM, "fused_norm"): v >= 1, (FastLM, "norm_one_kernel"): v >= 2},
         lambda v: "" if v >= 2 else f"_norm{v}"),
        # 0: off, 1: the default bound (FastLM.GQA_MAX_T), T > 1: enable_gqa for calls of up to T tokens
        ("gqa", lambda v: {(FastLM, "gqa_steps"): bool(v), (FastLM, "GQA_MAX_T"): v if v > 1 else FastLM.GQA_MAX_T},
         lambda v: "" if v == 1 else f"_gqa{v}"),
        ("rowwise", lambda v: {(FastLM, "rowwise_verify"): bool(v)}, lambda v: "_rw1" if v else ""),
        ("tree_paths", lambda v: {(FastLM, "tree_paths"): bool(v)}, lambda v: "" if v else "_tp0"),
        ("overlap", lambda v: {(Decoder, "overlap"): bool(v)}, lambda v: "" if v else "_ovl0"),
        ("ew", lambda v: {(Decoder, "compile_elementwise"): bool(v)}, lambda v: "" if v else "_ew0"),
        ("norms", lambda v: {(Decoder, "settle_norms"): bool(v)}, lambda v: "" if v else "_sn0"),
        # 1: where CUDA graphs are on (the default), 0: never
        ("prefill", lambda v: {(Decoder, "graph_prefill"): None if v else False}, lambda v: "" if v else "_pf0"),
        # 1: on a GPU (the default), 0: never
        ("draft_compile", lambda v: {(Decoder, "compile_drafter"): None if v else False},
         lambda v: "" if v else "_dc0"),
    ]


# flags that change only how a tree is verified: a value of theirs other than the default times the trees alone,
# against the plain decoding of the variant that differs from it only in them (timed once, in the same run)
TREES_ONLY = {"tree_paths"}


def shared_plain(variants, values) -> str:
    """The method-name suffix of the variant whose plain decoding (and chains) a combination of flag values shares:
    its own, unless a tree-only flag is off its default, then the same values with the tree-only flags at theirs."""
    return "".join("" if flag in TREES_ONLY else suffix(v) for (flag, _, suffix), v in zip(variants, values))


# --random-target shapes: (model type, config fields); the vocabulary is the tokenizer's
RANDOM_SHAPES = {
    # SmolLM2-135M's shape: the default target's kernels without its weights
    "smollm2": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                              num_key_value_heads=3, rms_norm_eps=1e-5, tie_word_embeddings=True,
                              max_position_embeddings=8192, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 100000.0})),
    # Qwen2.5-Coder-0.5B's and -1.5B's shapes (q/k/v with biases; the 1.5B: head size 128, untied head), the presets
    # qwen-coder-0.5b and qwen-coder-1.5b without their weights
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True, max_position_embeddings=32768,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False, max_position_embeddings=32768,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Qwen3-0.6B's shape: q/k norm, head size 128 (not hidden / heads), tied head
    "qwen3": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
                            max_position_embeddings=40960, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 1000000.0})),
}


def random_target(spec: str, tokenizer_from: str, dtype: str = "auto", device: str = "auto"):
    """A target of random weights (seed 0) for timing an architecture without its checkpoint: `spec` a name in
    RANDOM_SHAPES or a transformers config.json (any model type; its vocab_size is replaced by the tokenizer's), the
    tokenizer (chat template, turn ends) that of the target `tokenizer_from` (a preset or an HF folder). Its greedy
    text is noise, but the same noise on every engine, so tokens/s and token-for-token agreement compare."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from eyas.config import TargetConfig
    from eyas.target import Target, _pick_device, _pick_dtype, default_aux_layers, find_eot_ids, load_tokenizer

    if spec in RANDOM_SHAPES:
        model_type, fields = RANDOM_SHAPES[spec]
    else:
        from pathlib import Path

        path = Path(spec)
        if not path.is_file():
            raise SystemExit(f"--random-target {spec}: neither a shape ({', '.join(RANDOM_SHAPES)}) "
                             f"nor a config.json file")
        fields = json.loads(path.read_text())
        model_type = fields.pop("model_type", None)
        if not model_type:
            raise SystemExit(f"--random-target {spec}: the config has no model_type")
    cfg = TargetConfig(name=tokenizer_from, dtype=dtype, device=device)
    tok = load_tokenizer(cfg)
    dev = _pick_device(device)
    conf = AutoConfig.for_model(model_type, **{**fields, "vocab_size": len(tok)})
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(conf, dtype=_pick_dtype(dtype, dev))
    model.eval().requires_grad_(False)
    n = conf.num_hidden_layers
    return Target(model=model, tokenizer=tok, name=f"random:{spec}", source="random (seed 0)", sha256="",
                  aux_layers=default_aux_layers(n), eot_token_ids=find_eot_ids(tok, None))


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_drafter(spec: str, target):
    """The drafter a benchmark times: a drafter folder (eyas, or SGLang/vLLM via eyas.export), or "untrained" (or
    empty): SmolLM2's GPU shape (MLP 6,144, 32,000-token head) with seed-0 random weights, whose rounds emit about
    one token, for timing rounds and the lossless check; "untrained:N" the same with N decoder layers
    (train.draft_layers)."""
    import torch

    from eyas.draft import build_drafter
    from eyas.evaluate import drafter_aux_layers, load_eval_drafter

    if spec in ("", "untrained") or spec.startswith("untrained:"):
        layers = spec.partition(":")[2]
        if layers and not (layers.isdigit() and int(layers) >= 1):
            raise SystemExit(f"--draft {spec}: the layer count after 'untrained:' must be a whole number >= 1")
        torch.manual_seed(0)
        return build_drafter(target, 32000, intermediate_size=6144, num_layers=int(layers or 1))
    target.aux_layers = drafter_aux_layers(target, spec)  # this benchmark's own target captures them
    return load_eval_drafter(spec, target)


def load_prompts(name: str, limit: int, tokenizer) -> list[list[int]]:
    from eyas.config import DataConfig
    from eyas.data import read_dataset, select_split
    from eyas.evaluate import prompt_ids

    if name == "sharegpt":
        dc = DataConfig()
        convs, _ = read_dataset("sharegpt")
        convs = select_split(convs, "test", dc.val_ratio, dc.test_ratio)
    else:
        convs, _ = read_dataset(name)
    out = []
    for c in convs:
        user = next((t for t in c.turns if t.role == "user"), None)
        if user is None:
            continue
        ids = prompt_ids(tokenizer, [{"role": "user", "content": user.content}])
        if len(ids) <= 1536:
            out.append(ids)
        if len(out) >= limit:
            break
    return out


def verify_shaped_agreement(target, prompts, outputs, reference, k, max_len, compile_, engine, max_new, stop,
                            tree=None):
    """Of the prompts whose speculative answer parts from plain decoding's, how many equal plain decoding with its
    steps shaped as this chain's verify (Decoder.plain_like_verify), or this tree's (TreeDecoder.generate_like_verify),
    untimed: those part only where a kernel rounds by the call's shape; the others hold a wrong token. None where no
    answer parts."""
    from eyas.decode import Decoder
    from eyas.tree_decode import TreeDecoder

    apart = [i for i, (o, r) in enumerate(zip(outputs, reference)) if o != r]
    if not apart:
        return None
    dec = TreeDecoder(target, None, tree, max_len=max_len, compile=compile_, engine=engine) if tree else \
        Decoder(target, None, k=k, max_len=max_len, compile=compile_, engine=engine)
    same = sum(dec.generate_like_verify(prompts[i], max_new, stop).tokens == outputs[i] for i in apart)
    dec.close()
    return f"{same}/{len(apart)}"


def run_engine(dec, prompts, max_new, stop, speculative, budget, reference=None):
    """Decode the prompts in order until the time box ends. reference: plain decoding's tokens per prompt
    (from this function's "outputs"); a speculative method then reports how many of its prompts gave the
    same tokens (lossless greedy decoding gives all of them)."""
    toks = secs = 0.0
    outputs, per_prompt, accepted, seconds_by_prompt = [], [], [], []
    acc, draft_s, verify_s, prefill_s, steps, done = [], 0.0, 0.0, 0.0, 0, 0
    t_end = time.perf_counter() + budget
    for ids in prompts:
        g = dec.generate(ids, max_new, stop, speculative=speculative)
        toks += len(g.tokens)
        secs += g.seconds
        acc += g.accepted
        draft_s += g.draft_seconds
        verify_s += g.verify_seconds
        prefill_s += g.prefill_seconds
        steps += g.target_forwards
        outputs.append(list(g.tokens))
        seconds_by_prompt.append(round(g.seconds, 6))
        if speculative:  # per prompt: new tokens, rounds, tokens accepted from the drafter
            per_prompt.append([len(g.tokens), len(g.accepted), int(sum(g.accepted))])
            accepted.append([int(a) for a in g.accepted])  # each round's accepted drafts, in order
        done += 1
        if time.perf_counter() > t_end:
            break
    # where the wall time went: the prompts' prefills, and the rest (decode steps or rounds with the host's share)
    # per target forward
    res = {"prompts": done, "new_tokens": int(toks), "seconds": secs, "tokens_per_s": toks / secs if secs else 0.0,
           "prefill_s": prefill_s, "target_forwards": steps,
           "ms_per_forward_after_prefill": 1e3 * (secs - prefill_s) / steps if steps else None}
    if speculative:
        from eyas.eval_stats import round_sums, tau_interval

        k = dec.k
        hist = [acc.count(i) for i in range(k + 1)]
        res.update(acceptance_length=(sum(acc) + len(acc)) / max(1, len(acc)),
                   acceptance_length_ci95=tau_interval([round_sums(a) for a in accepted]),  # over the prompts
                   accepted_length_histogram=hist,
                   per_position_acceptance=[sum(hist[i:]) / max(1, sum(hist[i - 1:])) for i in range(1, k + 1)],
                   draft_s=draft_s, verify_s=verify_s, per_prompt=per_prompt, accepted_by_prompt=accepted)
    if reference is not None:
        both = min(len(outputs), len(reference))
        res["same_as_plain"] = f"{sum(o == r for o, r in zip(outputs, reference))}/{both}"
    res["outputs"] = outputs
    res["seconds_by_prompt"] = seconds_by_prompt
    return res


def sweep_compile_limit(limit: int = 64) -> None:
    """Let torch compile each function for more shapes than its default 8: one process here times many chains and
    trees, each with drafter calls of its own shapes, where an eval decodes with one; past the limit the compiled
    drafter would fall back to eager for the methods timed last."""
    from eyas.engine.fastlm import raise_recompile_limit

    raise_recompile_limit(limit)


def divergences(model, prompts, outputs, reference) -> dict:
    """Where a speculative method's tokens leave plain decoding's: for each prompt that differs, the first differing
    position and, from an independent forward of the target (transformers' own, over the prompt and plain decoding's
    tokens before it), the logit gap between plain decoding's token and the method's there, also in units of the
    dtype's spacing at that logit. A gap of a spacing or two is a near-tie that rounding decides; a large gap would
    be a method that does not give the target's greedy choice."""
    import torch

    rows = []
    dev = next(model.parameters()).device
    for i, (ids, out, ref) in enumerate(zip(prompts, outputs, reference)):
        at = next((j for j, (o, r) in enumerate(zip(out, ref)) if o != r), None)
        if at is None:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([list(ids) + ref[:at]], device=dev)).logits[0, -1]
        top, want, got = float(logits.max()), float(logits[ref[at]]), float(logits[out[at]])
        spacing = float(torch.finfo(logits.dtype).eps) * 2.0 ** math.floor(math.log2(max(abs(top), 1e-30)))
        rows.append({"prompt": i, "at": at, "plain": ref[at], "method": out[at], "top": round(top, 4),
                     "gap": round(want - got, 4), "gap_spacings": round((want - got) / spacing, 2)})
    gaps = [r["gap_spacings"] for r in rows]
    return {"divergences": rows, "divergence_gap_spacings_max": max(gaps, key=abs) if gaps else None}


def same_prompts_speedup(spec: dict, plain: dict) -> float | None:
    """plain's seconds over spec's on the prompts both finished (each method's time box can end after a different
    number of prompts, and a prompt's cost per token grows with its context, so tok/s over different prompts is
    not a like-for-like ratio; greedy lossless decoding writes the same tokens, so this is the tok/s ratio on them)."""
    a, b = spec.get("seconds_by_prompt"), plain.get("seconds_by_prompt")
    if not a or not b:
        return None
    n = min(len(a), len(b))
    return sum(b[:n]) / sum(a[:n]) if sum(a[:n]) else None


def run_hf(model, prompts, max_new, stop, budget, device, **gen_kw):
    import torch

    toks, secs, done = 0, 0.0, 0
    t_end = time.perf_counter() + budget
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=list(stop), pad_token_id=stop[0], **gen_kw)
        _sync(device)
        secs += time.perf_counter() - t0
        toks += out.shape[1] - x.shape[1]
        done += 1
        if time.perf_counter() > t_end:
            break
    return {"prompts": done, "new_tokens": toks, "seconds": secs, "tokens_per_s": toks / secs if secs else 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True,
                    help="drafter folder (eyas, or SGLang/vLLM via eyas.export), or `untrained` (SmolLM2's GPU shape, "
                         "random: rounds of about one token, for timing and the lossless check; `untrained:N` with N "
                         "decoder layers)")
    ap.add_argument("--target", default="smollm2",
                    help="the target: a preset, an HF folder, a .gguf file (with --random-target: whose tokenizer it takes)")
    ap.add_argument("--random-target", default="",
                    help="time a target of random weights (seed 0) instead: a shape (" + ", ".join(RANDOM_SHAPES) + ": "
                         "Qwen3-0.6B's) or a transformers config.json of any model type, with --target's tokenizer "
                         "(e.g. --random-target qwen3 --engine fast,hf: the fast engine against transformers' fallback)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                    help="the target's dtype: auto (bf16 on a GPU, fp32 on a CPU)")
    ap.add_argument("--prompts", default="sharegpt",
                    help="sharegpt | humaneval | a .jsonl/.txt file | greedy:RUN (the validation prompts a training in "
                         "RUN answered greedily for greedy_tau, train.greedy_val: their τ here is what greedy_tau "
                         "forecasts; plain decoding's entry says how many answers equal the stored ones)")
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--k", default="3", help="draft length, or a comma list (3,7)")
    ap.add_argument("--tree", nargs="*", default=[], metavar="TOPK,DEPTH,TOKENS",
                    help="also time EAGLE-2 dynamic trees, one method each (eyas_tree_TOPK_DEPTH_TOKENS), e.g. --tree "
                         "4,4,16 8,6,32: SGLang's speculative-eagle-topk, speculative-num-steps and "
                         "speculative-num-draft-tokens (the root included); each reports τ, per-level acceptance, "
                         "tok/s and its speedup over the plain baseline of the same run")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per method (time box)")
    ap.add_argument("--hf-budget", type=float, default=0.0,
                    help="seconds per transformers baseline (default: --budget); they are 10x slower, so a shorter "
                         "box still measures them while eyas' methods finish every prompt")
    ap.add_argument("--no-compile", action="store_true", help="no CUDA graphs (eager steps) on GPU")
    ap.add_argument("--engine", default="auto",
                    help="target forward: auto (fast where FastLM runs the target), eyas' static-cache forward "
                         "(fast), transformers' StaticCache (hf, the fallback's engine), or a comma list timing each "
                         "(fast,hf): the methods of every engine after the first get its name as a suffix "
                         "(eyas_plain_hf), and their plain entries say how many prompts gave the first engine's "
                         "tokens (same_as_first_engine)")
    ap.add_argument("--round", default="fused", choices=("fused", "stepwise", "both"),
                    help="speculative round: fused (the default, as eval.round=auto on a GPU: drafts, verify and rebuild as one "
                         "step, one CUDA graph per round), stepwise (each part its own step; methods named "
                         "eyas_spec_kK) or both")
    ap.add_argument("--skip-hf", action="store_true", help="skip transformers generate baselines")
    ap.add_argument("--norm", default="2",
                    help="target RMSNorm: 2 (the default) torch's fused kernel in the model's dtype, one kernel "
                         "(FastLM.norm_one_kernel); 1 the fused kernel with HF's rounding steps (FastLM.fused_norm "
                         "alone, ~4 kernels); 0 the model's own norm modules; a comma list times several (methods of "
                         "1 and 0 get a _norm1 / _norm0 suffix)")
    ap.add_argument("--draft-fuse", default="1",
                    help="the drafter's q/k/v and gate/up as one product each and rope from a table (Decoder's "
                         "fuse_drafter, the default): 1, 0, or 0,1 to time both (the 0 methods get a _dfuse0 suffix)")
    ap.add_argument("--gqa", default="1",
                    help="the target's multi-token calls (the verify) through SDPA's enable_gqa (FastLM.gqa_steps, the "
                         "default): 1 (calls of up to FastLM.GQA_MAX_T tokens), T > 1 (calls of up to T tokens, for a "
                         "tree's verify), 0 (query heads folded, as a one-token step); a comma list times each (the "
                         "methods of a value other than 1 get the suffix _gqaT)")
    ap.add_argument("--rowwise", default="0",
                    help="FastLM.rowwise_verify: 0 (the default: a verify's tokens attend together), 1 (token by token, "
                         "each shaped as a one-token step, so the attention rounds as plain decoding's), or 0,1 to "
                         "time both (the 1 methods get the suffix _rw1)")
    ap.add_argument("--tree-paths", default="1",
                    help="FastLM.tree_paths: 1 (the default: each tree node attends over its own path laid at plain "
                         "decoding's slots, as a one-token step), 0 (the tree's nodes in one call under the ancestor "
                         "mask), or 0,1 to time both (the 0 trees get the suffix _tp0 and are compared with the run's plain decoding "
                         "of the same other settings, which, like the chains, is timed once)")
    ap.add_argument("--overlap", default="1",
                    help="Decoder.overlap: 1 (the GPU default: the next plain step or fused round queued before the "
                         "last one's tokens are read), 0 (each read first), " + BOTH.format("_ovl0"))
    ap.add_argument("--ew", default="1",
                    help="Decoder.compile_elementwise: 1 (the GPU default: the target's "
                         "rope, residual add + norm and silu * up as torch.compile'd kernels in its steps and verify "
                         "passes), 0 (eager), " + BOTH.format("_ew0"))
    ap.add_argument("--norms", default="1",
                    help="Decoder.settle_norms: 1 (the default: with compiled elementwise kernels, the norms compiled "
                         "only where they round each of a verify's rows as a one-token step does, else eager), 0 "
                         "(compiled regardless), " + BOTH.format("_sn0"))
    ap.add_argument("--prefill", default="1",
                    help="Decoder.graph_prefill: 1 (the default where CUDA graphs are on: "
                         "each prompt right-padded to a multiple of 128 tokens and prefilled as one CUDA graph per "
                         "padded length), 0 (the eager prefill of the prompt's own length), " + BOTH.format("_pf0"))
    ap.add_argument("--draft-compile", default="1",
                    help="Decoder.compile_drafter: 1 (the default on a GPU: each drafter "
                         "step's two parts around the attention as torch.compile'd kernels), 0 (the steps eager, in "
                         "their CUDA graphs), " + BOTH.format("_dc0"))
    ap.add_argument("--no-warm-up", action="store_true",
                    help="skip Decoder.warm_up before each method (without it "
                         "a method then builds its graphs and per-shape kernels for each longer span of the cache "
                         "inside its timed prompts, and the first method to use a shape pays for it)")
    ap.add_argument("--out", default="results.json")
    a = ap.parse_args(argv)
    hf_budget = a.hf_budget or a.budget
    from eyas.tree import TreeSpec
    from eyas.util import EyasError

    try:
        trees = [TreeSpec.parse(t, "--tree") for t in a.tree]
    except EyasError as e:
        ap.error(str(e))
    engines = a.engine.split(",")
    if any(e not in ("auto", "fast", "hf") for e in engines) or len(set(engines)) != len(engines):
        ap.error(f"--engine {a.engine}: give auto, fast or hf, or a comma list of them without repeats")

    import torch

    from eyas.config import TargetConfig
    from eyas.decode import Decoder
    from eyas.evaluate import _device_name
    from eyas.tree_decode import TreeDecoder
    from eyas.util import atomic_write_json
    from gpu_watch import GpuWatch

    from eyas.target import load_target

    sweep_compile_limit()
    if a.random_target:
        target = random_target(a.random_target, a.target, a.dtype)
    else:
        target = load_target(TargetConfig(name=a.target, dtype=a.dtype))
    dev = target.device
    drafter = bench_drafter(a.draft, target)
    stored = None  # greedy:RUN: the target's greedy answers the training scored greedy_tau on
    if a.prompts.startswith("greedy:"):
        from eyas.train.greedyval import read_greedy_val

        pairs = read_greedy_val(a.prompts[len("greedy:"):])[:a.limit]
        prompts, stored = [p for p, _ in pairs], [x for _, x in pairs]
    else:
        prompts = load_prompts(a.prompts, a.limit, target.tokenizer)
    stop = target.eot_token_ids
    max_len = max(len(p) for p in prompts) + max(a.max_new_tokens, 32) + max(
        [int(k) for k in a.k.split(",")] + [max(t.tokens, t.depth + 1) for t in trees]) + 2
    ks = [int(k) for k in a.k.split(",")]
    warm = prompts[:2]
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": _device_name(dev), "target": target.name,
               "dtype": str(target.dtype), "prompts": {"set": a.prompts, "count": len(prompts)},
               "max_new_tokens": a.max_new_tokens, "budget_s": a.budget, "hf_budget_s": hf_budget,
               "command": " ".join(sys.argv),
               "torch": torch.__version__, "methods": {}}
    import transformers

    results["transformers"] = transformers.__version__
    compile_ = not a.no_compile and dev.type == "cuda"

    def record(name, res):
        results["methods"][name] = res
        g = res.get("gpu") or {}
        print(f"{name:28s} {res['tokens_per_s']:9.1f} tok/s  ({res['prompts']} prompts"
              + (f", tau {res['acceptance_length']:.2f}" if "acceptance_length" in res else "")
              + (f", SM {g['sm_mhz_median']:.0f} MHz, {g.get('temp_c_max', 0):.0f} C" if "sm_mhz_median" in g else "")
              + (f", same as plain {res['same_as_plain']}" if "same_as_plain" in res else "")
              + (f", largest gap where it differs {res['divergence_gap_spacings_max']} spacings"
                 if res.get("divergence_gap_spacings_max") is not None else "")
              + (f", of those the same with the verify's shapes {res['same_with_verify_shapes']}"
                 if res.get("same_with_verify_shapes") else "")
              + (f", same as {engines[0]} {res['same_as_first_engine']}" if "same_as_first_engine" in res else "")
              + ")", flush=True)
        atomic_write_json(a.out, results)

    def watched(fn, *args, **kw) -> dict:
        """fn's result with what the GPU's clocks, temperature and power did meanwhile (bench/gpu_watch.py), under
        "gpu": a method timed slower because the card ran hot or clocked down shows it there."""
        w = GpuWatch(dev).start()
        try:
            res = fn(*args, **kw)
        finally:
            state = w.stop()
        return {**res, "gpu": state} if state else res

    def warm_up(dec, speculative: bool) -> float:
        """Decoder.warm_up before a method is timed (unless --no-warm-up): every graph and per-shape kernel its
        generations need, built here rather than in the first prompt that reaches a longer span of the cache.
        -> its seconds."""
        if a.no_warm_up:
            return 0.0
        t0 = time.perf_counter()
        dec.warm_up(plain=not speculative, speculative=speculative)
        return round(time.perf_counter() - t0, 3)

    def engine_facts(dec) -> dict:
        return {"engine": dec.engine, "cuda_graphs": bool(dec.graphs.enabled and dec.graphs.replays),
                "overlap": dec.overlapped, "compiled_elementwise": dec.elementwise_compiled,
                "compiled_drafter": dec.drafter_compiled, "padded_prefill": dec.prefill_padded}

    from eyas.engine.fastlm import FastLM

    def time_trees(engine, reference, sfx, plain_sfx):  # every --tree, against `reference`, plain's tokens
        for tree in trees:
            dec = TreeDecoder(target, drafter, tree, max_len=max_len, compile=compile_, engine=engine)
            warm_s = warm_up(dec, True)
            run_engine(dec, warm, 32, stop, True, 1e9)
            res = watched(run_engine, dec, prompts, a.max_new_tokens, stop, True, a.budget, reference)
            outs = res.pop("outputs")
            res.update(divergences(target.model, prompts, outs, reference))
            res["same_with_verify_shapes"] = verify_shaped_agreement(
                target, prompts, outs, reference, tree.depth, max_len, compile_, engine, a.max_new_tokens, stop, tree)
            # per_position_acceptance is per level of the tree
            record(f"eyas_tree_{tree.topk}_{tree.depth}_{tree.tokens}" + sfx,
                   {**res, **engine_facts(dec), "tree": tree.as_dict(), "variant": sfx, "plain_variant": plain_sfx,
                    "warm_up_s": warm_s})
            dec.close()

    variants = target_variants(FastLM, Decoder)
    references = {}  # variant suffix -> its plain decoding's tokens
    saved = {key: getattr(*key) for _, sets, _ in variants for key in sets(1)}
    first_engine_outputs = {}  # variant suffix -> the first engine's plain tokens
    values_of = [[int(v) for v in getattr(a, flag).split(",")] for flag, _, _ in variants]
    for engine, values in itertools.product(engines, itertools.product(*values_of)):
        sfx = ""
        for (_, sets, suffix), v in zip(variants, values):
            for (cls, name), value in sets(v).items():
                setattr(cls, name, value)
            sfx += suffix(v)
        esfx = "" if engine == engines[0] else f"_{engine}"
        vsfx, sfx = sfx, sfx + esfx
        shared = shared_plain(variants, values) + esfx
        if shared != sfx and shared in references:  # plain decoding and the chains are those of the shared variant
            time_trees(engine, references[shared], sfx, shared)
            continue
        plain = Decoder(target, None, k=1, max_len=max_len, compile=compile_, engine=engine)
        warm_s = warm_up(plain, False)
        run_engine(plain, warm, 32, stop, False, 1e9)
        plain_res = watched(run_engine, plain, prompts, a.max_new_tokens, stop, False, a.budget)
        reference = plain_res["outputs"]  # kept in the report: what the target wrote, to study tau by kind of text
        if stored is not None:  # the training's greedy text (eyas.train.greedyval, made in a batch) against the decoder's
            plain_res["same_as_greedy_val"] = f"{sum(o == r for o, r in zip(reference, stored))}/{len(reference)}"
        first = first_engine_outputs.setdefault(vsfx, reference)
        if engine != engines[0]:  # the engines' greedy tokens, prompt for prompt (on the prompts both finished)
            both = min(len(first), len(reference))
            plain_res["same_as_first_engine"] = f"{sum(o == r for o, r in zip(reference, first))}/{both}"
        references[sfx] = reference
        record("eyas_plain" + sfx, {**plain_res, **engine_facts(plain), "variant": sfx, "warm_up_s": warm_s})
        plain.close()
        for k in ks:
            for fused in {"fused": (True,), "stepwise": (False,), "both": (False, True)}[a.round]:
                for dfuse in [int(x) for x in a.draft_fuse.split(",")]:
                    dec = Decoder(target, drafter, k=k, max_len=max_len, compile=compile_, engine=engine, fused=fused,
                                  fuse_drafter=bool(dfuse))
                    warm_s = warm_up(dec, True)
                    run_engine(dec, warm, 32, stop, True, 1e9)
                    res = watched(run_engine, dec, prompts, a.max_new_tokens, stop, True, a.budget, reference)
                    outs = res.pop("outputs")
                    res.update(divergences(target.model, prompts, outs, reference))
                    res["same_with_verify_shapes"] = verify_shaped_agreement(
                        target, prompts, outs, reference, k, max_len, compile_, engine, a.max_new_tokens, stop)
                    record(f"eyas_spec_k{k}" + ("_fused" if fused else "") + ("" if dfuse else "_dfuse0") + sfx,
                           {**res, **engine_facts(dec), "k": k, "fused_round": fused, "fused_drafter": bool(dfuse),
                            "variant": sfx, "warm_up_s": warm_s})
                    dec.close()
        time_trees(engine, reference, sfx, sfx)
    for (cls, name), value in saved.items():
        setattr(cls, name, value)
    if not a.skip_hf:
        m = target.model
        for name, kw in [("hf_generate", {}), ("hf_generate_static", {"cache_implementation": "static"}),
                         ("hf_prompt_lookup", {"prompt_lookup_num_tokens": 10})]:
            try:
                run_hf(m, warm, 16, stop, 1e9, dev, **kw)
                record(name, watched(run_hf, m, prompts, a.max_new_tokens, stop, hf_budget, dev, **kw))
            except Exception as e:  # a baseline that does not run here is reported, not fatal
                results["methods"][name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{name}: failed ({e})", flush=True)
    plains = {n: r for n, r in results["methods"].items() if n.startswith("eyas_plain")}
    plain_of = {n: r["tokens_per_s"] for n, r in plains.items()}
    hf_best = max([r.get("tokens_per_s", 0) for n, r in results["methods"].items() if n.startswith("hf_")] or [0])
    for e in engines[1:]:  # an engine's plain tok/s over the first engine's, per variant
        for name, r in plains.items():
            first = plains.get(name.removesuffix(f"_{e}")) if name.endswith(f"_{e}") else None
            if first and first.get("tokens_per_s"):
                r["tokens_per_s_vs_first_engine"] = r["tokens_per_s"] / first["tokens_per_s"]
    for name in [n for n in results["methods"] if n.startswith(("eyas_spec_k", "eyas_tree_"))]:
        r = results["methods"][name]
        plain_name = "eyas_plain" + r.get("plain_variant", r.get("variant", ""))  # the same target forward
        base = plain_of.get(plain_name)
        r["speedup_vs_plain"] = r["tokens_per_s"] / base if base else None
        if plain_name in plains:  # the same ratio on the prompts both finished
            r["speedup_vs_plain_same_prompts"] = same_prompts_speedup(r, plains[plain_name])
        # against the fastest plain method of the run, whichever norm and cache layout it used
        r["speedup_vs_fastest_plain"] = r["tokens_per_s"] / max(plain_of.values()) if plain_of else None
        r["speedup_vs_best_hf"] = r["tokens_per_s"] / hf_best if hf_best else None
    results["best"] = best_setting(results["methods"])
    atomic_write_json(a.out, results)
    print(json.dumps({n: {k: v for k, v in r.items() if k in ("tokens_per_s", "acceptance_length", "speedup_vs_plain",
                                                              "speedup_vs_plain_same_prompts",
                                                              "speedup_vs_fastest_plain", "speedup_vs_best_hf", "same_as_plain",
                                                              "same_as_first_engine", "tokens_per_s_vs_first_engine")}
                      for n, r in results["methods"].items()}, indent=1))
    b = results["best"]
    if b:
        print(f"best: {b['method']} at {b['tokens_per_s']:.1f} tok/s"
              + (f", {b['speedup_vs_plain']:.2f}x plain" if b.get("speedup_vs_plain") else "")
              + (", the same as plain up to kernel rounding" if b["lossless_up_to_rounding"] else "")
              + ("" if b["lossless"] else ", NOT the same as plain on every prompt (no method was)")
              + f"; evaluate with: eyas run --set {b['set']}", flush=True)
    return 0


def best_setting(methods: dict) -> dict | None:
    """The fastest speculative method of the default variants (no suffix) that gave plain decoding's tokens on every
    prompt, or whose answers that part from them all equal plain decoding with the verify's shapes (they part only
    by kernel rounding), else the fastest of them all, with the eyas setting that decodes as it does (eval.k or
    eval.tree)."""
    cands = []
    for name, r in methods.items():
        if r.get("variant") or "error" in r or not name.startswith(("eyas_spec_k", "eyas_tree_")):
            continue
        if "tree" in r:
            t = r["tree"]
            setting = f"eval.tree={t['topk']},{t['depth']},{t['tokens']}"
        elif r.get("fused_round") and r.get("fused_drafter"):  # as eyas run decodes a chain on a GPU
            setting = f"eval.k={r['k']}"
        else:
            continue
        same, of = (int(x) for x in r.get("same_as_plain", "0/1").split("/"))
        rounding = of > same and r.get("same_with_verify_shapes") == f"{of - same}/{of - same}"
        cands.append((of > 0 and (same == of or rounding), r["tokens_per_s"], name, setting, r, rounding))
    if not cands:
        return None
    lossless, tps, name, setting, r, rounding = max(cands, key=lambda c: (c[0], c[1]))
    return {"method": name, "set": setting, "tokens_per_s": tps, "lossless": lossless,
            "lossless_up_to_rounding": rounding,
            "speedup_vs_plain": r.get("speedup_vs_plain"), "acceptance_length": r.get("acceptance_length")}


if __name__ == "__main__":
    sys.exit(main())
