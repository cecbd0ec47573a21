"""A training step replayed as one CUDA graph (`train.cuda_graph`).

On an H200 a two-layer training step launches about 660 kernels holding 22.6 ms of GPU work, while the host took
about 33 ms a step to launch them (BENCHMARKS.md, thirty-third session): the step waits on the host. Captured once
as a graph (the labels, the TTT unroll, the loss, the backward, gradient clipping and AdamW), a step is one launch:
on an H200 the pipeline's one-sample recipe then trained the same drafter (the same validation figures to the last
digit) at 472.4k against 358.7k tokens a second (thirty-ninth session, BENCHMARKS.md).

What a graph needs, and how the step gives it:
- fixed addresses: every batch is copied into one set of buffers (`StaticBatch`) of the budget's shape, which the
  training already pads to on a GPU; the host's numbers of a step (the loss denominators, the real tokens, the
  learning rate) live in device tensors the graph reads, filled before each replay;
- no host synchronisation inside the step: the unroll never waits for the device once warmed up (checked by
  `tests/test_ttt.py -k never_waits` on a GPU);
- AdamW with `capturable=True` and its learning rate as a tensor; gradients are set to None before the capture, so
  the captured backward writes them afresh at every replay (nothing may zero them between replays);
- everything compiled and checked before the capture: the first `WARMUP` steps run eagerly, on a side stream as
  PyTorch's whole-network capture does.

If the capture fails, the reason is logged once and the steps run eagerly from then on (`state` says so): a
compiler or driver problem costs speed, not the run. On a CPU (tests) `capture=False` runs the same body with the
same buffers eagerly, so the plumbing is checked against the plain training loop."""
from __future__ import annotations

from dataclasses import fields

import torch

from .ttt import PackedBatch
from .util import compile_failure, log

WARMUP = 3  # eager steps before the capture (PyTorch's whole-network capture example warms up 3)


class StaticBatch:
    """One PackedBatch's tensors at fixed addresses, with `n_real` as a 0-d device tensor, and the step's loss
    denominators (`denom`, float32 [ttt_steps]); `load` copies a new batch of the same shapes in."""

    def __init__(self, first: PackedBatch, steps: int):
        dev = first.input_ids.device
        kw = {f.name: getattr(first, f.name) for f in fields(PackedBatch)}
        kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        kw["n_real"] = torch.tensor(first.n_real, dtype=torch.long, device=dev)
        self.batch = PackedBatch(**kw)
        self.denom = torch.ones(steps, dtype=torch.float32, device=dev)

    def load(self, b: PackedBatch, denom: list[int]) -> None:
        s = self.batch
        for f in fields(PackedBatch):
            v = getattr(b, f.name)
            if f.name == "n_real":
                s.n_real.fill_(v)
            else:
                mine = getattr(s, f.name)
                if mine is None and v is None:
                    continue
                if mine is None or v is None or mine.shape != v.shape or mine.dtype != v.dtype:
                    raise ValueError(f"batch field {f.name}: {_desc(v)}, the graph's buffer is {_desc(mine)}")
                mine.copy_(v, non_blocking=True)
        for j, c in enumerate(denom):
            self.denom[j].fill_(c)


def _desc(t) -> str:
    return "none" if t is None else f"{tuple(t.shape)} {t.dtype}"


def graph_unfit(device: torch.device, world: int, grad_accum: int, noise_std: float, compiled: bool,
                sharded: bool) -> str:
    """Why the training step cannot run as a graph (one line), or "" when it can."""
    if device.type != "cuda":
        return "not on a GPU"
    if world > 1 or grad_accum > 1 or sharded:
        return "more than one micro-batch a step (processes or grad_accum): the step is not captured across them"
    if noise_std > 0:
        return "train.noise_std draws fresh noise from a seeded generator each step"
    if not compiled:
        return "the drafter's step is not compiled (a graph keeps every shape fixed, which the compiled step pads to)"
    return ""


class StepGraph:
    """`body(static_batch, denom) -> stats tensor` (forward, backward, clip and optimizer step; the gradients
    are None when it starts) run eagerly for the first `WARMUP` calls, then captured and replayed. `opt`: its
    gradients are set to None before each eager call and before the capture."""

    def __init__(self, body, opt: torch.optim.Optimizer, first: PackedBatch, steps: int, capture: bool = True):
        self.body, self.opt, self.capture = body, opt, capture
        self.static = StaticBatch(first, steps)
        self.graph = None
        self.out = None
        self.calls = 0
        self.state = "warming up" if capture else "eager (no capture)"

    def _eager(self):
        self.opt.zero_grad(set_to_none=True)
        return self.body(self.static.batch, self.static.denom)

    def __call__(self, batch: PackedBatch, denom: list[int]) -> torch.Tensor:
        self.static.load(batch, denom)
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return self.out
        if not self.capture:
            return self._eager()
        if self.calls <= WARMUP:
            side, main = torch.cuda.Stream(), torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                out = self._eager()
            main.wait_stream(side)
            out.record_stream(main)
            return out
        try:
            self.opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the warm-up's blocks back to the driver, for the graph's own pool
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                out = self.body(self.static.batch, self.static.denom)
        except Exception as e:  # noqa: BLE001 - a capture problem costs speed, not the run
            self.capture, self.state = False, f"eager: capture failed ({compile_failure(e)})"
            log(f"train: the training step runs without a CUDA graph from now on: {self.state}")
            torch.cuda.synchronize()
            return self._eager()
        self.graph, self.out, self.state = g, out, "graph"
        g.replay()  # the capture recorded the step without running it
        return out
