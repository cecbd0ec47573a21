"""Greedy validation answers: the forecast of the decoder's τ, on the text the decoder meets.

The validation split's answers were sampled (regen's temperature), and the decoder verifies greedy text, which a
drafter predicts differently: a setting can raise the validation's forecast (`val_tau`) while lowering the
decoder's τ. So the training can also score its drafter on the target's
greedy answers to the validation split's first prompts (`train.greedy_val` of them), generated once here at the
start of training and kept in `<run>/train/greedy_val.safetensors`. On that text the validation's simulated greedy
chain is what eyas' decoder accepts round by round (`test_ttt_chain_simulates_the_decoders_acceptance`), and walking
the decoder's rounds over it (`eyas.train.ttt.decoder_rounds`) gives `greedy_tau`, the decoder's τ on first answers, from a
few hundred of them at every evaluation.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import RegenConfig
from ..data.prepare import TokenSet
from ..engine.generate import StaticEngine
from ..data.tokenize import Tokenized
from ..engine.fastlm import fast_engine_runs
from ..util import EyasError, atomic_write_json, log, progress, read_json, stable_hash


def first_prompts(seqs, n: int, max_prompt: int) -> list[tuple[int, list[int]]]:
    """(index, the tokens before its first trained token) of the first `n` of `seqs` ((input ids, loss mask) pairs, a
    TokenSet for one) whose prompt is at most `max_prompt` tokens long, each prompt once (samples of one answer share
    it)."""
    out, seen = [], set()
    for i in range(len(seqs)):
        ids, mask = seqs[i]
        on = mask.nonzero()
        if not len(on):
            continue
        p = ids[:int(on[0])].tolist()
        if not p or len(p) > max_prompt or tuple(p) in seen:
            continue
        seen.add(tuple(p))
        out.append((i, p))
        if len(out) >= n:
            break
    return out


@torch.no_grad()
def greedy_answers(target, prompts: list[list[int]], max_new_tokens: int, batch_tokens: int,
                   engine: str = "auto") -> list[list[int]]:
    """The target's greedy answer to each prompt, up to `max_new_tokens` tokens and through the first token that ends
    a turn (kept, as the decoder keeps it). engine: "static", regen's static-cache decode loop on eyas' own forward
    (all prompts in its rows at once); "generate", transformers' generate on prompts left-padded in batches of about
    `batch_tokens` tokens; "auto", static wherever eyas' forward runs the target, since generate is far slower."""
    if engine == "static" or (engine == "auto" and fast_engine_runs(target.model, "greedy validation")):
        return _static_answers(target, prompts, max_new_tokens)
    # imported here: transformers takes about 2 s to import, which a training on stored features and the target's
    # head alone (eyas.target_head) would otherwise pay for nothing
    from transformers import GenerationConfig

    stop = [int(s) for s in target.eot_token_ids]
    pad = target.tokenizer.pad_token_id
    pad = int(pad if pad is not None else (stop[0] if stop else 0))
    gc = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop or None,
                          pad_token_id=pad, num_beams=1)
    model, dev = target.model, target.device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    bar = progress(total=len(prompts), desc="greedy val", unit="answer")
    k = 0
    while k < len(order):
        j = k + 1  # sorted by length: the batch's last prompt is its longest
        while j < len(order) and (j + 1 - k) * (len(prompts[order[j]]) + max_new_tokens) <= batch_tokens:
            j += 1
        idx = order[k:j]
        longest = len(prompts[idx[-1]])
        ids = torch.full((len(idx), longest), pad, dtype=torch.long)
        att = torch.zeros((len(idx), longest), dtype=torch.long)
        for r, i in enumerate(idx):
            p = prompts[i]
            ids[r, longest - len(p):] = torch.tensor(p)
            att[r, longest - len(p):] = 1
        out = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), generation_config=gc)
        for r, i in enumerate(idx):
            new = out[r, longest:].tolist()
            end = next((e for e, t in enumerate(new) if t in stop), None)
            answers[i] = new[:end + 1] if end is not None else new
        k += len(idx)
        bar.update(len(idx))
    bar.close()
    return answers


def _static_answers(target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """greedy_answers on regen's StaticEngine: the prompts' tokens straight into its queue, its rows decoding at
    temperature 0, each answer's tokens kept as generated (through the turn's end)."""
    class Tokens(StaticEngine):
        def result(self, rid, prompt_len, tokens):
            return rid, list(tokens)

    rc = RegenConfig(temperature=0.0, max_new_tokens=max_new_tokens, batch_size=min(len(prompts), 512))
    eng = Tokens(target, rc, "keep", max(len(p) for p in prompts) + 1)
    try:
        for i, p in enumerate(prompts):
            eng.pending.append((str(i), list(p), max_new_tokens))
        answers: list[list[int]] = [[] for _ in prompts]
        bar = progress(total=len(prompts), desc="greedy val", unit="answer")
        left = len(prompts)
        while left:
            got = eng.poll(0)
            if not got and not eng.pending and all(s is None for s in eng.slot):
                raise RuntimeError(f"the static engine stopped with {left} answers missing")
            for rid, toks in got:
                answers[int(rid)] = toks
                left -= 1
                bar.update(1)
        bar.close()
        return answers
    finally:
        eng.close()


def greedy_val_set(run: Path, target, val: TokenSet, n: int, max_new_tokens: int, max_len: int,
                   batch_tokens: int) -> TokenSet | None:
    """The greedy validation sequences (prompt, then the target's greedy answer, the answer trained-on), made once
    per run and target and read back after that (a resumed run scores the same text)."""
    prompts = [(val.ids[i], p) for i, p in first_prompts(val, n, max_len - max_new_tokens)]
    if not prompts:
        return None
    path, meta_path = run / "train" / "greedy_val.safetensors", run / "train" / "greedy_val.json"
    key = stable_hash(str([target.identity(), max_new_tokens, prompts]))
    meta = read_json(meta_path) if meta_path.exists() else {}
    if path.exists() and meta.get("key") == key:
        return TokenSet.load(path, meta["ids"])
    t0 = time.perf_counter()
    answers = greedy_answers(target, [p for _, p in prompts], max_new_tokens, batch_tokens)
    if target.device.type == "cuda":  # the generation's cache back to the device before the feature cache fills it
        torch.cuda.empty_cache()
    ts = TokenSet.from_tokenized([Tokenized(rid, p + a, [0] * len(p) + [1] * len(a))
                                  for (rid, p), a in zip(prompts, answers) if a])
    path.parent.mkdir(parents=True, exist_ok=True)
    ts.save(path)
    dt = time.perf_counter() - t0
    n_new = int(ts.loss_mask.sum())
    atomic_write_json(meta_path, {"key": key, "ids": ts.ids, "answers": len(ts), "answer_tokens": n_new,
                                  "max_new_tokens": max_new_tokens, "seconds": round(dt, 2)})
    log(f"train: the target answered {len(ts)} validation prompts greedily ({n_new:,} tokens, {dt:.1f} s) for the "
        f"decoder's τ forecast")
    return ts


def read_greedy_val(run: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt, the target's greedy answer) of each sequence `greedy_val_set` kept in `run` (bench/bench_decode.py
    decodes the same prompts, to set the decoder's τ beside the training's greedy_tau)."""
    run = Path(run)
    path, meta_path = run / "train" / "greedy_val.safetensors", run / "train" / "greedy_val.json"
    if not path.exists() or not meta_path.exists():
        raise EyasError(f"{run}: no greedy validation answers (train/greedy_val.safetensors and .json); a training "
                        f"with train.greedy_val > 0 makes them")
    ts = TokenSet.load(path, read_json(meta_path)["ids"])  # one sequence per prompt, as greedy_val_set kept them
    return [(p, ts[i][0][len(p):].tolist()) for i, p in first_prompts(ts, len(ts), len(ts.input_ids))]
