"""The processes a training runs on: torchrun's environment, one code path for 1 and N processes (gloo on the CPU,
NCCL on the GPU)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def barrier(self):
        if self.world > 1:
            dist.barrier()


def dist_setup(device: str = "auto") -> Dist:
    """Read torchrun's environment; start the process group when there is more than one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = (device == "auto" and torch.cuda.is_available()) or device.startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(local if world > 1 else torch.device(device if device != "auto" else "cuda").index or 0)
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, local, dev)
