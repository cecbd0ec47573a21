"""Target hidden-state features: the tensors the drafter trains on.

A feature sample for one tokenized sequence holds
    input_ids [T] (long), loss_mask [T] (bool),
    aux [T, 3·H_t]  the residual streams entering the aux layers, concatenated,
    final [T, H_t]  the target's last normed hidden state (lm_head(final) = target logits).
`OnlineFeatures` computes them from a target held in the process; offline shards (written by
`eyas extract`) yield the same tensors for the same sequences.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .data.prepare import TokenSet


@dataclass
class Sample:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor


@torch.no_grad()
def compute_features(target, seqs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One right-padded batch forward over `seqs` (1-D token tensors). With causal attention,
    padding on the right never changes the states of the real tokens, so no mask is needed."""
    if not seqs:
        return []
    dev = target.device
    T = max(len(s) for s in seqs)
    batch = torch.zeros(len(seqs), T, dtype=torch.long, device=dev)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s.to(dev)
    aux, final = target.capture(batch)
    return [(aux[i, : len(s)], final[i, : len(s)]) for i, s in enumerate(seqs)]


class OnlineFeatures:
    """Features computed on the fly from the target, for sequence indices of a TokenSet."""

    def __init__(self, target, tokens: TokenSet, max_batch_tokens: int = 16384):
        self.target = target
        self.tokens = tokens
        self.max_batch_tokens = max_batch_tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def get(self, indices: list[int]) -> list[Sample]:
        pairs = [self.tokens[i] for i in indices]
        out: list[Sample] = []
        # group into forward passes of at most max_batch_tokens (padded) tokens, in order
        group: list[int] = []
        for j in range(len(pairs) + 1):
            if j < len(pairs):
                longest = max([len(pairs[k][0]) for k in group] + [len(pairs[j][0])])
                if not group or longest * (len(group) + 1) <= self.max_batch_tokens:
                    group.append(j)
                    continue
            feats = compute_features(self.target, [pairs[k][0] for k in group])
            for k, (aux, final) in zip(group, feats):
                ids, mask = pairs[k]
                out.append(Sample(ids.to(aux.device), mask.to(aux.device), aux, final))
            group = [j] if j < len(pairs) else []
        return out
