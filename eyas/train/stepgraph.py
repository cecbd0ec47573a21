"""A training step replayed as one CUDA graph (`train.cuda_graph`).

A small drafter's training step launches hundreds of kernels, and the host takes longer to launch them than the
GPU takes to run them: the step waits on the host. Captured once as a graph (the labels, the TTT unroll, the loss,
the backward, gradient clipping and AdamW), a step is one launch, and trains the same drafter faster (see
BENCHMARKS.md).

What a graph needs, and how the step gives it:
- fixed addresses: every batch is copied into one set of buffers (`StaticBatch`) of the budget's shape, which the
  training already pads to on a GPU; the host's numbers of a step (the loss denominators, the real tokens, the
  learning rate) live in device tensors the graph reads, filled before each replay;
- no host synchronisation inside the step: the unroll never waits for the device once warmed up (checked by
  `tests/test_ttt.py -k never_waits` on a GPU);
- AdamW with `capturable=True` and its learning rate as a tensor; for one micro-batch (`StepGraph`) gradients
  are set to None before the capture, so the captured backward writes them afresh at every replay (nothing may
  zero them between replays);
- everything compiled and checked before the capture: the first `WARMUP` steps run eagerly, on a side stream as
  PyTorch's whole-network capture does.

Several micro-batches a step (torchrun processes, `train.grad_accum`): `AccumGraph`, a graph for a micro-batch's
forward and backward replayed for each, the gradients summed across processes between it and the update's graph.

If the capture fails, the reason is logged once and the steps run eagerly from then on (`state` says so): a
compiler or driver problem costs speed, not the run. On a CPU (tests) `capture=False` runs the same body with the
same buffers eagerly, so the plumbing is checked against the plain training loop."""
from __future__ import annotations

from dataclasses import fields

import torch

from .ttt import PackedBatch
from ..util import compile_failure, log

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
    """Why the training step cannot run as a graph (one line), or "" when it can. `world` and `grad_accum` do not
    refuse it: several micro-batches a step run as `AccumGraph`."""
    if device.type != "cuda":
        return "not on a GPU"
    if sharded:
        return "the drafter is sharded (FSDP2): its gradients are reduce-scattered inside the backward"
    if noise_std > 0:
        return "train.noise_std draws fresh noise from a seeded generator each step"
    if not compiled:
        return "the drafter's step is not compiled (a graph keeps every shape fixed, which the compiled step pads to)"
    return ""


class _Part:
    """One piece of work, `fn() -> tensor`, run eagerly for its first `WARMUP` calls (on a side stream, as
    PyTorch's whole-network capture does), then captured once and replayed; `before()` runs ahead of every eager
    call and of the capture. If the capture fails, the reason is logged once and `fn` runs eagerly from then on.
    `capture=False` (a CPU) runs `fn` eagerly every time."""

    def __init__(self, fn, before=None, capture: bool = True, name: str = "the training step"):
        self.fn, self.before, self.capture, self.name = fn, before or (lambda: None), capture, name
        self.graph = None
        self.out = None
        self.calls = 0
        self.failed = ""

    def _eager(self):
        self.before()
        return self.fn()

    def __call__(self) -> torch.Tensor:
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
            self.before()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the warm-up's blocks back to the driver, for the graph's own pool
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                out = self.fn()
        except Exception as e:  # noqa: BLE001 - a capture problem costs speed, not the run
            self.capture, self.failed = False, f"capture failed ({compile_failure(e)})"
            log(f"train: {self.name} runs without a CUDA graph from now on: {self.failed}")
            torch.cuda.synchronize()
            return self._eager()
        self.graph, self.out = g, out
        g.replay()  # the capture recorded the work without running it
        return out

    @property
    def state(self) -> str:
        if self.graph is not None:
            return "graph"
        if self.failed:
            return f"eager: {self.failed}"
        return "warming up" if self.capture else "eager (no capture)"


class StepGraph:
    """`body(static_batch, denom) -> stats tensor` (forward, backward, clip and optimizer step; the gradients
    are None when it starts) run eagerly for the first `WARMUP` calls, then captured and replayed. `opt`: its
    gradients are set to None before each eager call and before the capture."""

    def __init__(self, body, opt: torch.optim.Optimizer, first: PackedBatch, steps: int, capture: bool = True):
        self.static = StaticBatch(first, steps)
        self.part = _Part(lambda: body(self.static.batch, self.static.denom),
                          before=lambda: opt.zero_grad(set_to_none=True), capture=capture)

    @property
    def state(self) -> str:
        return self.part.state

    def __call__(self, batch: PackedBatch, denom: list[int]) -> torch.Tensor:
        self.static.load(batch, denom)
        return self.part()


class AccumGraph:
    """A step over several micro-batches (processes x `train.grad_accum`) as two graphs, so that data parallelism
    keeps the one-process step's speed (a step of many kernels waits on the host, module docstring):

    - `grad_body(static_batch, denom) -> stats` (the micro-batch's forward and backward; its loss, right guesses
      per TTT step and real tokens, float64), replayed once per micro-batch. The gradients are views of one flat
      float32 buffer, zeroed at `begin`, into which every backward adds (autograd adds into a gradient that
      exists, in place), so the replays accumulate them;
    - between the two: the flat gradients and the summed statistics are added up across processes by `reduce`
      (one all-reduce each, outside the graphs, in place of DDP's hooks, which a capture cannot hold);
    - `update_body() -> gradient norm` (clipping and AdamW), captured apart, once per step.

    The processes' weights start equal (the caller broadcasts rank 0's) and stay so: each applies the same
    summed gradients. Nothing may set the gradients to None (the buffer would be left behind)."""

    def __init__(self, grad_body, update_body, params: list[torch.Tensor], first: PackedBatch, steps: int,
                 reduce, capture: bool = True):
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"the trained parameters mix dtypes {sorted(map(str, dtypes))}: one flat gradient "
                             f"buffer needs one")
        self.reduce = reduce
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        o = 0
        for p in params:
            p.grad = self.flat[o:o + p.numel()].view_as(p)
            o += p.numel()
        self.static = StaticBatch(first, steps)
        self.acc = None
        self.grad = _Part(lambda: grad_body(self.static.batch, self.static.denom), capture=capture,
                          name="the training step's forward and backward")
        self.update = _Part(update_body, capture=capture, name="the training step's update")

    @property
    def state(self) -> str:
        a, b = self.grad.state, self.update.state
        return a if a == b else f"forward and backward {a}; update {b}"

    def begin(self) -> None:
        """A new step: the gradients and statistics from zero."""
        self.flat.zero_()
        if self.acc is not None:
            self.acc.zero_()

    def add(self, batch: PackedBatch, denom: list[int]) -> None:
        """One micro-batch's forward and backward, its gradients added to the step's."""
        self.static.load(batch, denom)
        out = self.grad()
        if self.acc is None:
            self.acc = torch.zeros_like(out)
        self.acc += out

    def finish(self) -> torch.Tensor:
        """Sum across processes, clip and step: the step's statistics and the gradients' norm, in a new tensor."""
        self.reduce(self.flat)
        self.reduce(self.acc)
        gnorm = self.update()
        return torch.cat([self.acc, gnorm.detach().to(self.acc.dtype).reshape(1)])
