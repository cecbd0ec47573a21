"""Token choice: the temperature / top-p distribution of logits (probs_from_logits), a draw from it (sample), and
draws reproducible per request (seeded_pick, SeededSampling).

Seeded draws: each token drawn with noise that is a hash of (the request's seed, the token's
place in the answer, the vocabulary index), instead of draws from one random stream shared by every request in
flight. A conversation's answers then depend on its own seed alone (regen seeds each answer from the conversation's
id, its sample and the answer's number), not on which conversations were decoded beside it or before it, so a regen
killed and resumed writes what an uninterrupted one writes. Graph-safe: no random state, no host sync."""
from __future__ import annotations

import torch
from transformers import LogitsProcessor

def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Softmax at `temperature`, then nucleus filtering (the smallest set of most likely tokens whose
    mass reaches top_p is kept and renormalised). Works over the last dimension."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        drop = (sp.cumsum(-1) - sp) >= top_p  # mass before this token already reaches top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


_M = 0xFFFFFFFF


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32) (xor-shift-multiply rounds; the multipliers are below 2^31,
    so no product leaves int64)."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M
    h = h ^ (h >> 15)
    h = (h * 0x6C8E9CF5) & _M
    return h ^ (h >> 16)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [n, vocab] for requests with seeds [n] drawing their token number steps [n]."""
    key = _mix(_mix(seeds.long() & _M) ^ (steps.long() & _M))
    v = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    h = _mix((key[:, None] + v * 0x9E3779B1) & _M)
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in float32, never 0 or 1
    return -torch.log(u)


def seeded_pick(logits: torch.Tensor, temperature: float, top_p: float, seeds: torch.Tensor,
                steps: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [n, V] from the temperature / top-p distribution: argmax(p / Exp(1)), a draw
    from p, with each row's noise from its seed and step."""
    probs = probs_from_logits(logits, temperature, top_p)
    return (probs / exponential_noise(seeds, steps, probs.shape[-1])).argmax(-1)


class SeededSampling(LogitsProcessor):
    """A transformers logits processor for `generate` run greedily: scores whose argmax is the seeded draw of
    seeded_pick, for the batch's rows (seeds [n]) whose prompts end at column `width`."""

    def __init__(self, temperature: float, top_p: float, seeds: torch.Tensor, width: int):
        self.temperature, self.top_p, self.seeds, self.width = temperature, top_p, seeds, width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        steps = torch.full_like(self.seeds, input_ids.shape[1] - self.width)
        probs = probs_from_logits(scores, self.temperature, self.top_p)
        return probs / exponential_noise(self.seeds, steps, probs.shape[-1])
