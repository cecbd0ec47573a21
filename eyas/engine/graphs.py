"""CUDA graphs of fixed-shape steps: the capture of one call (capture_cuda_graph), the batched decode step of the
static regen engine (DecodeGraph) and the decoder's steps, each checked against eager runs (StepGraphs)."""
from __future__ import annotations

import torch

from ..util import compile_failure, log
from .fastlm import SPAN, FastLM, attended_slots


def capture_cuda_graph(fn, device: torch.device, warmup: int = 1, pool=None):
    """Run `fn()` `warmup` times on a side stream (cuBLAS handles, allocator), then capture one call
    as a CUDA graph. Returns (graph, what the captured call returned: tensors a replay rewrites)."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g, failed = torch.cuda.CUDAGraph(), None
        try:
            with torch.cuda.graph(g, pool=pool):
                try:
                    out = fn()
                except Exception as e:
                    failed = e
                    raise
        except Exception as e:
            # an error inside the capture invalidates it, and ending the capture then raises "operation failed due
            # to a previous error during capture": the first error is the one that says what broke it
            raise (failed or e) from None
    return g, out


class DecodeGraph:
    """One decode step for all B rows of `lm`: tok = pick(logits of ids [B, 1] at positions pos [B]).
    `ids`, `pos` and `tok` are static buffers owned here: write ids/pos in place, call, read tok [B].

    A call names `upto`, a bound on the positions it covers (one per row group when `lm` has groups, set
    before this is built); the step attends to that bound rounded up to a multiple of `span` slots (all
    max_len slots when None), so a short context does not pay for the whole cache. On CUDA each span (or
    tuple of spans) is captured once as a CUDA graph on first use (after a warm-up on a side stream,
    which runs the step on the current buffers: it rewrites the cache slots at `pos` with what the
    replay writes again) and a call is one replay; `pick` must then be sync-free and use the default RNG.
    Elsewhere, or when a capture fails (logged), each call runs the same step eagerly."""

    def __init__(self, lm: FastLM, pick, warmup: int = 2, span: int = SPAN):
        self.lm, self.pick, self.warmup, self.span = lm, pick, warmup, span
        B = lm.batch_size
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=lm.device)
        self.pos = torch.zeros(B, dtype=torch.long, device=lm.device)
        self.tok = torch.zeros(B, dtype=torch.long, device=lm.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.use_graphs = lm.device.type == "cuda"
        self._graph(self.slots(None))  # the full-cache shape now, so a stack that cannot capture says so at once

    @property
    def graph(self):
        """The graph of the full-cache step (None when steps run eagerly)."""
        return self.graphs.get(self.slots(None))

    def slots(self, upto):
        """Cache slots a step bounded by `upto` attends to (a tuple, one per row group, with groups). With the
        lm's flex_decode, always the whole cache: one graph, whose block mask bounds each row by its position."""
        if self.lm.flex_decode and not self.lm.groups:
            return self.lm.max_len
        if isinstance(upto, (tuple, list)):
            return tuple(attended_slots(u, self.lm.max_len, self.span) for u in upto)
        if upto is None:
            return (self.lm.max_len,) * len(self.lm.groups) if self.lm.groups else self.lm.max_len
        return attended_slots(upto, self.lm.max_len, self.span)

    def _graph(self, slots):
        g = self.graphs.get(slots)
        if g is None and self.use_graphs:
            try:
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                g, _ = capture_cuda_graph(lambda: self._step(slots), self.lm.device, self.warmup, self.pool)
                self.graphs[slots] = g
            except Exception as e:  # noqa: BLE001 - depends on the GPU stack; eager is always correct
                log(f"CUDA graph capture of the decode step failed ({compile_failure(e, where=True)}); decoding eagerly")
                self.use_graphs = False
                self.graphs.clear()
                g = None
        return g

    def _step(self, upto, rows: slice | None = None) -> None:
        if rows is None:
            logits, _ = self.lm.forward(self.ids, self.pos, last_only=True, upto=upto)
            self.tok.copy_(self.pick(logits[:, -1]))
        else:
            logits, _ = self.lm.forward(self.ids[rows], self.pos[rows], rows=rows, last_only=True, upto=upto)
            self.tok[rows] = self.pick(logits[:, -1])

    def __call__(self, upto=None, rows: slice | None = None) -> torch.Tensor:
        """One step; `rows` (a slice, eager steps only) advances just those rows: the rows outside it keep
        their last token in `tok`, and their cache is left alone. A graph replays every row."""
        slots = self.slots(upto)
        g = self._graph(slots)
        if g is not None:
            g.replay()
        else:
            self._step(slots, None if isinstance(slots, tuple) else rows)
        return self.tok


class StepGraphs:
    """CUDA graphs of fixed-shape steps, one per (step name, input shapes), captured on first use.
    A replay copies the inputs into the graph's static tensors and returns clones of its outputs.
    The first `check` replays of each graph are compared with an eager run of the same step (which
    writes the same cache entries again, so it changes nothing); a mismatch or any error turns
    graphs off for good and the step runs eagerly."""

    def __init__(self, device: torch.device, enabled: bool, check: int = 3):
        self.enabled = enabled and device.type == "cuda"
        self.device = device
        self.check = check
        self.graphs: dict[tuple, list] = {}
        self.pool = None
        self.replays = 0

    def _capture(self, fn, args):
        static = [a.clone() for a in args]
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g, out = capture_cuda_graph(lambda: fn(*static), self.device, pool=self.pool)
        return [g, static, out, 0]

    def off(self, why: str) -> None:
        if self.enabled:
            log(f"decode: CUDA graphs off ({why}); running eagerly")
        self.enabled = False
        self.graphs.clear()

    def run(self, name: str, fn, *args):
        if not self.enabled:
            return fn(*args)
        key = (name,) + tuple(tuple(a.shape) for a in args)
        try:
            entry = self.graphs.get(key)
            if entry is None:
                entry = self.graphs[key] = self._capture(fn, args)
            g, static, out, checked = entry
            for dst, src in zip(static, args):
                dst.copy_(src)
            g.replay()
            self.replays += 1
            res = tuple(o.clone() for o in out)
        except Exception as e:  # noqa: BLE001 - depends on the GPU stack; eager is always correct
            self.off(f"{name}: {compile_failure(e, where=True)}")
            return fn(*args)
        if checked < self.check:
            entry[3] += 1
            ref = fn(*args)
            same = all(a.shape == b.shape and (torch.equal(a, b) if not a.is_floating_point()
                                               else torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2))
                       for a, b in zip(res, ref))
            if not same:
                self.off(f"the graph of {name} {list(key[1:])} differs from the eager step")
                return ref
        return res
