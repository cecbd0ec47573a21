"""The pieces of a training step: the learning rate's schedule, autocast, the noise's generator, and the drafter
with the TTT unroll as one module."""
from __future__ import annotations

import contextlib
import math

import torch

from ..draft import Eagle3Drafter
from ..util import stable_hash
from .ttt import ttt_unroll


def lr_factor(step: int, total: int, scheduler: str, warmup_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based) of `total`."""
    warm = int(round(warmup_ratio * total))
    if warm and step < warm:
        return (step + 1) / warm
    if scheduler == "constant":
        return 1.0
    frac = (step - warm) / max(1, total - warm)
    if scheduler == "linear":
        return max(0.0, 1.0 - frac)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))


class TTTModule(torch.nn.Module):
    """The drafter plus the TTT unroll in one forward, so that DDP sees one forward per backward."""

    def __init__(self, drafter: Eagle3Drafter, compile_loss: str = "auto", compile_drafter: str = "auto"):
        super().__init__()
        self.drafter = drafter
        self.compile = {"compile_loss": compile_loss, "compile_drafter": compile_drafter}  # train.compile_*

    def forward(self, batch, labels, steps, noise_std, generator, chain=False, loss_path="all"):
        return ttt_unroll(self.drafter, batch, labels, steps, noise_std, generator, chain=chain, loss_path=loss_path,
                          **self.compile)


def autocast(device: torch.device, precision: str = "auto", cache: bool = True):
    """bf16 autocast for precision bf16, or auto on CUDA; none otherwise (fp32). cache=False for a step captured
    as a CUDA graph: the weights' bf16 copies are made inside the graph, not kept from outside it."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


def step_generator(seed: int, step: int, micro: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(stable_hash(f"noise:{seed}:{step}:{micro}") % (1 << 62))
    return g
