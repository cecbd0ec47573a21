"""Validation: per-position accuracy, simulated acceptance length and the greedy chain's acceptance on a split,
all processes together."""
from __future__ import annotations

import torch

from .batches import Data
from .dist import Dist
from .steps import autocast
from .ttt import acceptance_length, chain_acceptance, decoder_rounds, target_labels, ttt_unroll


@torch.no_grad()
def evaluate(module, drafter, data: Data, lm_head, steps: int, d: Dist, multiple: int, precision: str = "auto",
             sharded: bool = False, rounds: bool = False) -> dict:
    """Per-position accuracy, simulated acceptance length and loss on a split, all ranks together. sharded:
    `module` is the FSDP root, whose forward gathers the weights, a collective: every process then runs as
    many forwards as the busiest one (the extra ones are not counted). rounds: the split is the target's greedy
    text, so also the decoder's rounds on it (`decoder_rounds`): round_accept, round_tau and rounds."""
    module.eval()
    every = data.bins(0)
    bins = every[d.rank::d.world]
    n = -(-len(every) // d.world) if sharded else len(bins)
    loss = torch.zeros(steps, dtype=torch.float64, device=d.device)
    cnt, cor, alive, hit, r_alive, r_hit = (torch.zeros_like(loss) for _ in range(6))
    for i in range(n):
        batch = data.batch(bins[i] if i < len(bins) else every[0], d.device, multiple)
        with autocast(d.device, precision):
            labels = target_labels(batch.final, lm_head, drafter.draft_ids, top=batch.top)
            st = (module(batch, labels, steps, 0.0, None, chain=True) if sharded
                  else ttt_unroll(drafter, batch, labels, steps, chain=True, **module.compile))
        if i >= len(bins):
            continue
        loss += torch.stack(st.loss_sum).double()
        cnt += torch.stack(st.count).double()
        cor += torch.stack(st.correct).double()
        alive += torch.stack([m.sum() for m in st.alive]).double()
        hit += torch.stack([m.sum() for m in st.hits]).double()
        if rounds:
            ra, rh = decoder_rounds(batch, st.hits)
            r_alive += torch.tensor(ra, dtype=torch.float64, device=d.device)
            r_hit += torch.tensor(rh, dtype=torch.float64, device=d.device)
    t = d.all_sum(torch.stack([loss, cnt, cor, alive, hit, r_alive, r_hit]))
    module.train()
    acc = (t[2] / t[1].clamp(min=1)).tolist()
    accept = chain_acceptance(t[3].tolist(), t[4].tolist())
    out = {"val_loss": float((t[0] / t[1].clamp(min=1)).sum()), "val_acc": acc, "val_al": acceptance_length(acc),
           "val_positions": int(t[1][0]), "val_accept": accept, "val_tau": 1 + acceptance_length(accept),
           "val_chain_positions": [int(x) for x in t[3].tolist()]}
    if rounds:
        r_accept = chain_acceptance(t[5].tolist(), t[6].tolist())
        out.update({"round_accept": r_accept, "round_tau": 1 + acceptance_length(r_accept), "rounds": int(t[5][0])})
    return out
