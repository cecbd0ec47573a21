"""Drafter ablations: held-out per-step accuracy and simulated tau after the same training budget, one
variant per process (several can share a GPU).

    PYTHONPATH=. python3 bench/ablate_drafter.py --variant base --out results.jsonl
    for v in base lr1e-3 zero_aux ...; do PYTHONPATH=. python3 bench/ablate_drafter.py --variant $v & done

Data: the first --convs ShareGPT conversations with their original answers (labels are the target's
own distribution, as in training), tokenized with the target's template and cut to --max-len tokens;
a tenth held out. Training is eyas' TTT unroll (eyas.ttt) with AdamW and a cosine schedule, in a loop
small enough to change one thing at a time. `--list` prints the variants.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.config import TargetConfig  # noqa: E402
from eyas.data.readers import read_dataset  # noqa: E402
from eyas.data.tokenize import tokenize_conversation  # noqa: E402
from eyas.draft import build_drafter  # noqa: E402
from eyas.features import Sample, compute_features  # noqa: E402
from eyas.target import load_target  # noqa: E402
from eyas.train import autocast, aux_layer_rms  # noqa: E402
from eyas.ttt import (acceptance_length, chain_acceptance, decoder_rounds, pack_samples, step_targets,  # noqa: E402
                      target_labels, ttt_unroll)


def aux_scales(samples, H: int, per_dim: bool = False) -> torch.Tensor:
    """RMS of each aux layer, repeated over its H dimensions (eyas.train.aux_layer_rms, the scale
    train.fc_init=scaled uses), or of each aux dimension; over the first 200 samples, the first token
    of each sequence (an attention sink, bench/aux_stats.py) left out."""
    n = samples[0].aux.shape[-1] // H
    if per_dim:
        aux = torch.cat([s.aux[1:].float() for s in samples[:200]])
        return aux.pow(2).mean(0).sqrt().clamp_min(1e-3)
    rms = aux_layer_rms([pack_samples(samples[:200])], n, H).float()
    return rms.repeat_interleave(H)


VARIANTS = {
    # name: keyword arguments of train_variant
    "base": {},
    "lr1e-3": {"lr": 1e-3},
    "lr3e-3": {"lr": 3e-3},
    "lr1e-4": {"lr": 1e-4},
    "noclip": {"clip": 0.0},
    "clip5": {"clip": 5.0},
    "fcscale": {"fcscale": True},
    "fcscale_lr1e-3": {"fcscale": True, "lr": 1e-3},
    "zero_aux": {"zero_aux": True},
    "init_head": {"init_head": True},
    "long": {"steps_mult": 3},
    "long_lr1e-3": {"steps_mult": 3, "lr": 1e-3},
    "ttt1": {"ttt": 1},
    "auxnorm": {"auxnorm": "layer"},
    "auxnorm_lr1e-3": {"auxnorm": "layer", "lr": 1e-3},
    "auxnorm_dim": {"auxnorm": "dim"},
    "fcscale_dim": {"fcscale": "dim"},
    "last3": {"aux_layers": "last3"},
    "noise": {"noise": 0.05},
    "wide_fcscale_lr1e-3": {"fcscale": True, "lr": 1e-3, "mlp_mult": 4},
    "fcscale_lr1e-3_lt0.5": {"fcscale": True, "lr": 1e-3, "label_temp": 0.5},
    "fcscale_lr1e-3_lt0.25": {"fcscale": True, "lr": 1e-3, "label_temp": 0.25},
    "fcscale_lr1e-3_lt0.05": {"fcscale": True, "lr": 1e-3, "label_temp": 0.05},
    "fcscale_lr1e-3_decay0.8": {"fcscale": True, "lr": 1e-3, "decay": 0.8},
    "fcscale_lr5e-4_decay0.8": {"fcscale": True, "lr": 5e-4, "decay": 0.8},
    "fcscale_lr2e-3_decay0.8": {"fcscale": True, "lr": 2e-3, "decay": 0.8},
    "fcscale_lr3e-3_decay0.8": {"fcscale": True, "lr": 3e-3, "decay": 0.8},
    "fcscale_lr1e-3_decay0.6": {"fcscale": True, "lr": 1e-3, "decay": 0.6},
    # Gaussian noise on the aux states (absolute, as `--noise-std` in eyas train; SmolLM2's layers 2 / 15 / 27 have RMS
    # about 3 / 6.6 / 22.6), on top of the default decay
    "fcscale_lr1e-3_decay0.8_noise0.2": {"fcscale": True, "lr": 1e-3, "decay": 0.8, "noise": 0.2},
    "fcscale_lr1e-3_decay0.8_noise1": {"fcscale": True, "lr": 1e-3, "decay": 0.8, "noise": 1.0},
    # the loss on every position of the training sequences (the user turns and the template's tokens too), not only
    # on the answers; the labels are the target's own distribution wherever the text came from. Validation stays
    # on the answers
    "fcscale_lr1e-3_decay0.8_allpos": {"fcscale": True, "lr": 1e-3, "decay": 0.8, "all_positions": True},
    # steps 1.. train only where the data's fed tokens are the target's top tokens (greedy), and also only where the
    # drafter's earlier steps drafted them (chain): eyas train's `train.loss_path`
    "fcscale_lr1e-3_decay0.8_pathgreedy": {"fcscale": True, "lr": 1e-3, "decay": 0.8, "loss_path": "greedy"},
    "fcscale_lr1e-3_decay0.8_pathchain": {"fcscale": True, "lr": 1e-3, "decay": 0.8, "loss_path": "chain"},
    # a drafter of two decoder layers, the second a plain Llama layer (eyas train's `train.draft_layers`)
    "fcscale_lr1e-3_decay0.8_layers2": {"fcscale": True, "lr": 1e-3, "decay": 0.8, "layers": 2},
    "fcscale_lr1e-3_decay0.8_layers3": {"fcscale": True, "lr": 1e-3, "decay": 0.8, "layers": 3},
}


def load_samples(t, convs: int, max_len: int) -> list[Sample]:
    recs, _ = read_dataset("sharegpt", limit=convs)
    seqs = []
    for c in recs:
        try:
            tk = tokenize_conversation(t.tokenizer, c, max_seq_len=max_len)
        except Exception:  # noqa: BLE001 - a record the template cannot render is skipped
            continue
        if sum(tk.loss_mask) > 8:
            seqs.append((torch.tensor(tk.input_ids), torch.tensor(tk.loss_mask, dtype=torch.bool)))
    seqs.sort(key=lambda s: len(s[0]))
    out = featurize(t, seqs)
    random.Random(0).shuffle(out)
    return out


def featurize(t, seqs) -> list[Sample]:
    """(input ids, loss mask) pairs with the target's features, 16 sequences to a forward."""
    out = []
    for i in range(0, len(seqs), 16):
        chunk = seqs[i:i + 16]
        for (ids, m), (a, f, top) in zip(chunk, compute_features(t, [s[0] for s in chunk])):
            out.append(Sample(ids.to(a.device), m.to(a.device), a, f, top))
    return out


def batches(data, budget: int, seed: int):
    r = random.Random(seed)
    idx = list(range(len(data)))
    r.shuffle(idx)
    out, cur, n = [], [], 0
    for i in idx:
        L = len(data[i].input_ids)
        if n + L > budget and cur:
            out.append(cur)
            cur, n = [], 0
        cur.append(data[i])
        n += L
    if cur:
        out.append(cur)
    return out


def train_variant(t, tr, val, draft_ids, dv, steps, budget, lr=3e-4, clip=0.5, ttt=3, zero_aux=False,
                  fcscale=False, init_head=False, noise=0.0, steps_mult=1, aux_layers=None, auxnorm="", mlp_mult=1,
                  label_temp=1.0, decay=1.0, all_positions=False, loss_path="all", layers=1, seed=0, gval=None):
    from eyas.train import init_head_from_target

    dev = t.device
    torch.manual_seed(seed)  # the drafter's initial weights (and any noise); seed 0 gives the earlier runs' figures
    inter = t.model.config.intermediate_size * mlp_mult if mlp_mult != 1 else 0
    d = build_drafter(t, dv, draft_ids.cpu(), intermediate_size=inter, num_layers=layers).to(dev)
    H = d.config.target_hidden_size
    if fcscale:
        with torch.no_grad():
            d.fc.weight /= aux_scales(tr, H, per_dim=fcscale == "dim").to(d.fc.weight)
    # auxnorm: the aux states divided by a fixed per-layer (or per-dimension) scale before fc, a
    # reparametrisation (fc sees unit-scale inputs; exported, the scale would fold into fc's columns)
    inv = (1.0 / aux_scales(tr, H, per_dim=auxnorm == "dim")).to(dev) if auxnorm else None
    if init_head:
        init_head_from_target(d, t)
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95))
    lm_head = t.model.get_output_embeddings()
    steps *= steps_mult
    ep = 0
    tb = []
    s = 0
    t0 = time.time()
    tokens = 0
    while s < steps:
        if not tb:
            tb = batches(tr, budget, ep + 1000 * seed)  # each epoch's order
            ep += 1
        b = pack_samples(tb.pop())
        if zero_aux:
            b.aux = torch.zeros_like(b.aux)
        if inv is not None:
            b.aux = b.aux * inv.to(b.aux.dtype)
        if all_positions:
            b.loss_mask = torch.ones_like(b.loss_mask)
        f = min(1.0, (s + 1) / max(1, steps // 50)) * 0.5 * (1 + math.cos(math.pi * s / steps))
        for g in opt.param_groups:
            g["lr"] = lr * f
        with autocast(dev):
            lab = target_labels(b.final, lm_head, d.draft_ids, top=b.top, temperature=label_temp)
            st = ttt_unroll(d, b, lab, ttt, noise_std=noise, loss_path=loss_path)
            # each step's loss over its valid positions, as eyas train divides it (a loss_path drops positions from
            # the sum, not from the count, so each kept position weighs what it weighs with every position kept)
            den = [step_targets(b, j)[1].sum().clamp(min=1) for j in range(ttt)]
            loss = sum(decay ** j * ls / c for j, (ls, c) in enumerate(zip(st.loss_sum, den)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        tokens += b.n_real
        s += 1
    train_s = time.time() - t0
    d.eval()

    def held_out(data):
        """Per-step accuracy, the simulated greedy chain's acceptance by position (as eyas train's validation) and
        the decoder's rounds (`decoder_rounds`: meaningful on greedy text only)."""
        cor, cnt, alive, hit, r_alive, r_hit = ([0.0] * 3 for _ in range(6))
        with torch.no_grad():
            for vb in batches(data, budget, 0):
                b = pack_samples(vb)
                if zero_aux:
                    b.aux = torch.zeros_like(b.aux)
                if inv is not None:
                    b.aux = b.aux * inv.to(b.aux.dtype)
                with autocast(dev):
                    lab = target_labels(b.final, lm_head, d.draft_ids, top=b.top)
                    st = ttt_unroll(d, b, lab, 3, chain=True)
                for j in range(3):
                    cor[j] += float(st.correct[j])
                    cnt[j] += float(st.count[j])
                    alive[j] += float(st.alive[j].sum())
                    hit[j] += float(st.hits[j].sum())
                ra, rh = decoder_rounds(b, st.hits)
                r_alive = [x + y for x, y in zip(r_alive, ra)]
                r_hit = [x + y for x, y in zip(r_hit, rh)]
        return ([c / max(n, 1) for c, n in zip(cor, cnt)], chain_acceptance(alive, hit),
                chain_acceptance(r_alive, r_hit))

    acc, _, _ = held_out(val)
    out = {"acc": [round(a, 4) for a in acc], "sim_tau": round(1 + acceptance_length(acc), 3)}
    if gval:  # the chain on the target's greedy answers: what the decoder would accept there
        _, every, accept = held_out(gval)
        out.update({"greedy_accept": [round(a, 4) for a in accept],
                    "greedy_tau": round(1 + acceptance_length(accept), 3),
                    "greedy_tau_all": round(1 + acceptance_length(every), 3)})
    return {**out, "steps": steps, "epochs": round(ep - len(tb) / max(1, len(batches(tr, budget, 0))), 2),
            "train_tokens": tokens, "train_s": round(train_s, 1), "final_loss": round(loss.item(), 3)}


def greedy_samples(t, val, n: int, new: int, max_len: int, cache: str) -> list[Sample]:
    """The target's greedy answers (eyas.greedyval, as `train.greedy_val`) to the first prompts of the first `n`
    held-out conversations, with their features, kept in `cache` when given."""
    from eyas.greedyval import first_prompts, greedy_answers

    if cache and Path(cache).exists():
        return [Sample(*(x.to(t.device) for x in s)) for s in torch.load(cache, weights_only=True)]
    held = [(s.input_ids, s.loss_mask) for s in val[:n]]
    prompts = [p for _, p in first_prompts(held, len(held), max_len - new)]
    answers = greedy_answers(t, prompts, new, 16384)
    out = featurize(t, [(torch.tensor(p + a), torch.tensor([False] * len(p) + [True] * len(a)))
                        for p, a in zip(prompts, answers) if a])
    if cache:
        torch.save([tuple(x.cpu().clone() for x in (s.input_ids, s.loss_mask, s.aux, s.final, s.top)) for s in out],
                   cache)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="base", help="one of --list")
    ap.add_argument("--list", action="store_true", help="print the variants and exit")
    ap.add_argument("--convs", type=int, default=2000, help="ShareGPT conversations read")
    ap.add_argument("--max-len", type=int, default=1024, help="tokens per conversation")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps (variants may multiply)")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--draft-vocab-size", type=int, default=32000)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--ttt-steps", type=int, default=3, help="TTT steps trained (validation always reports 3)")
    ap.add_argument("--cache", default="", help="keep the tokenized features in this .pt file and reuse them")
    ap.add_argument("--out", default="ablate.jsonl", help="results appended as JSON lines")
    ap.add_argument("--drafter-compile", type=int, default=0, choices=(0, 1),
                    help="the drafter's TTT step compiled (eyas.ttt.DRAFTER_COMPILE); off by default: the batches are "
                         "not padded to one length, so each new length would compile again")
    ap.add_argument("--seed", type=int, default=0, help="seeds the drafter's initial weights and the batches' "
                    "order (0: the figures of the runs before it existed); a few seeds measure the spread")
    ap.add_argument("--aux-layers", default="", help="comma list of aux layer ids (the residual stream entering "
                    "those decoder layers) instead of the target's default [2, N//2, N-3]; a variant's own wins")
    ap.add_argument("--greedy-val", type=int, default=0, help="also score the drafter on the target's greedy answers "
                    "to the first prompts of this many held-out conversations (greedy_tau: the simulated chain on the "
                    "text a decoder verifies; the held-out answers are ShareGPT's own)")
    ap.add_argument("--greedy-new", type=int, default=128, help="tokens per greedy answer (--greedy-val)")
    a = ap.parse_args()
    if a.list:
        print("\n".join(f"{k}: {v}" for k, v in VARIANTS.items()))
        return 0
    from eyas import ttt

    ttt.DRAFTER_COMPILE = bool(a.drafter_compile)
    kw = {"ttt": a.ttt_steps, **VARIANTS[a.variant]}
    aux = [int(x) for x in a.aux_layers.split(",")] if a.aux_layers else None
    if kw.pop("aux_layers", None) == "last3":
        aux = [27, 28, 29]
    t = load_target(TargetConfig(name="smollm2", device=a.device, **({"aux_layers": aux} if aux else {})))
    t0 = time.time()
    if a.cache and Path(a.cache).exists():
        samples = [Sample(*(x.to(t.device) if x is not None else None for x in s))
                   for s in torch.load(a.cache, weights_only=True)]
    else:
        samples = load_samples(t, a.convs, a.max_len)
        if a.cache:
            # clone: the samples are views into their batch's tensors, which torch.save would store whole
            torch.save([tuple(x.cpu().clone() for x in (s.input_ids, s.loss_mask, s.aux, s.final, s.top))
                        for s in samples], a.cache)
    nval = max(1, len(samples) // 10)
    val, tr = samples[:nval], samples[nval:]
    cnt = torch.zeros(t.vocab_size, device=t.device)
    for s in tr:
        cnt += torch.bincount(s.input_ids[s.loss_mask], minlength=t.vocab_size).float()
    dv = min(a.draft_vocab_size, t.vocab_size)
    draft_ids = cnt.topk(dv).indices.sort().values
    gval = None
    if a.greedy_val:
        gcache = f"{a.cache}.greedy{a.greedy_val}_{a.greedy_new}.pt" if a.cache else ""
        gval = greedy_samples(t, val, a.greedy_val, a.greedy_new, a.max_len, gcache)
    prep = time.time() - t0
    res = train_variant(t, tr, val, draft_ids, dv, a.steps, a.batch_tokens, seed=a.seed, gval=gval, **kw)
    res = {"variant": a.variant, "seed": a.seed, "aux_layers": t.aux_layers, "drafter_compile": a.drafter_compile, **res,
           "prep_s": round(prep, 1), "train_seqs": len(tr), "val_seqs": len(val),
           **({"greedy_seqs": len(gval), "greedy_tokens": int(sum(int(s.loss_mask.sum()) for s in gval))} if gval else {}),
           "device": torch.cuda.get_device_name() if t.device.type == "cuda" else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv)}
    print(json.dumps(res), flush=True)
    with open(a.out, "a") as fh:
        fh.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
