"""The embedded engines: the target in-process, answering chat prompts (`eyas regen`) or token prompts (greedy
validation, on the static engine).

`static` is eyas' own decode loop (eyas.engine.fastlm): a static KV cache of `batch` rows, a finished row refilled
with the next prompt within a few steps (a conversation's next turn joins as soon as its previous turn ends), one CUDA
graph per decode step on GPU; it runs the families FastLM supports, and greedy validation runs on it too.
`continuous` uses transformers' continuous batching (paged KV cache); `generate` is the fallback for any target:
padded batches of prompts grouped by length through `model.generate`. `auto` takes `static` where it can run, else
`generate`. Every engine has the server backend's interface: submit(rid, messages, seed), poll(timeout) ->
[TurnResult], close().
"""
from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections import deque

import torch
from transformers import GenerationConfig, LogitsProcessorList

from ..config import RegenConfig
from ..data.conversation import Turn, split_reasoning
from ..data.reasoning import history_messages
from ..data.tokenize import render
from ..device_map import layer_shares
from ..util import EyasError, human_bytes, log, mem_available, release_memory, to_device
from .fastlm import FastLM, fast_engine_runs, supported
from .graphs import DecodeGraph
from .memory import MIN_CHUNK, BatchPlan, ForwardCost, all_logits, free_bytes, plan_batch
from .sampling import SeededSampling, seeded_pick
from .turn import TurnResult


def _render_prompt(tokenizer, messages: list[dict], reasoning: str) -> list[int]:
    """Chat messages -> the token ids of the prompt that asks for the next answer (the chat template's generation
    prompt after them); `reasoning` as data.reasoning says how earlier answers' reasoning is rendered."""
    turns = [Turn(m["role"], m["content"], m.get("reasoning")) for m in messages]
    text = render(tokenizer, history_messages(turns, tokenizer, reasoning), add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


class EmbeddedEngine:
    """What every embedded engine shares: prompt rendering, context limits, decoding of answers."""

    gpu_batch = 256  # regen.batch_size=0 on a GPU (32 on a CPU)

    def reseed(self, seed: int) -> None:
        """Restart the sampling stream of an engine that draws from one (the continuous engine; the static and
        generate engines seed each request's draws from its own seed, sampling.py): regen.samples' later samples
        start from a seed of their own, so a sample regenerated in a later process than the first does not replay
        the first's draws over the same prompts."""
        torch.manual_seed(seed)

    def __init__(self, target, rc: RegenConfig, reasoning: str, ctx_limit: int):
        self.t, self.rc, self.reasoning = target, rc, reasoning
        self.tok = target.tokenizer
        self.eot = set(target.eot_token_ids)
        self.model_max = int(getattr(target.config, "max_position_embeddings", 0) or 1 << 30)
        self.ctx_limit = min(ctx_limit or self.model_max, self.model_max)
        self.batch = rc.batch_size or (self.gpu_batch if target.device.type == "cuda" else 32)
        self.ready: list[TurnResult] = []
        self.generated_tokens = 0

    @property
    def window(self) -> int:
        return 2 * self.batch

    def rows_together(self) -> int:
        """The most sequences this engine decoded together (its batch; the generate engine's largest batch)."""
        return self.batch

    def prepare(self, rid: str, messages: list[dict]) -> tuple[list[int], int] | None:
        ids = _render_prompt(self.tok, messages, self.reasoning)
        if len(ids) >= self.ctx_limit:
            self.ready.append(TurnResult(rid, finish_reason="context", prompt_tokens=len(ids)))
            return None
        return ids, max(1, min(self.rc.max_new_tokens, self.model_max - len(ids)))

    def result(self, rid: str, prompt_len: int, tokens: list[int]) -> TurnResult:
        tokens = list(tokens)
        finish = "length"
        for i, x in enumerate(tokens):
            if x in self.eot:
                tokens, finish = tokens[:i], "stop"
                break
        self.generated_tokens += len(tokens) + (finish == "stop")
        text = self.tok.decode(tokens, skip_special_tokens=True)
        answer, reasoning = split_reasoning(text)
        return TurnResult(rid, answer, reasoning, finish, prompt_len, len(tokens))

    def generation_config(self, sampled: bool = True):
        """`sampled=False`: greedy whatever regen.temperature, for an engine that samples through SeededSampling."""
        rc = self.rc
        kw = dict(max_new_tokens=rc.max_new_tokens, eos_token_id=sorted(self.eot), pad_token_id=sorted(self.eot)[0])
        if rc.temperature > 0 and sampled:
            kw.update(do_sample=True, temperature=rc.temperature, top_p=rc.top_p, top_k=0)
        else:
            kw.update(do_sample=False)
        return GenerationConfig(**kw)

    @classmethod
    def identity(cls, target) -> dict:
        return {"backend": "embedded", "engine": cls.name, "model": target.name, "target_sha256": target.sha256}

    def describe(self) -> dict:
        return self.identity(self.t)


class ContinuousEngine(EmbeddedEngine):
    """transformers continuous batching: a paged KV cache shared by up to `batch` running sequences."""
    name = "continuous"

    def __init__(self, target, rc, reasoning, ctx_limit):
        super().__init__(target, rc, reasoning, ctx_limit)
        self.lens: dict[str, int] = {}
        self._start(rc.seed)

    def _start(self, seed: int) -> None:
        # here, not at the top: a transformers without continuous batching runs the other engines (embedded_engine)
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        rc = self.rc
        if self.t.device.type == "cuda":  # let transformers size the cache from free memory; CUDA graphs as it decides
            cb = ContinuousBatchingConfig(max_requests_per_batch=self.batch, seed=seed)
        else:  # no memory probe on CPU: size the cache for the window of running sequences
            block = 32
            per_seq = min(self.ctx_limit, 1024) + rc.max_new_tokens
            cb = ContinuousBatchingConfig(block_size=block, num_blocks=max(64, math.ceil(self.batch * per_seq / block)),
                                          max_batch_tokens=512, max_requests_per_batch=self.batch, seed=seed,
                                          use_cuda_graph=False)
        self.manager = self.t.model.init_continuous_batching(generation_config=self.generation_config(),
                                                             continuous_batching_config=cb)
        self.manager.start()

    def reseed(self, seed: int) -> None:
        """The manager samples from a generator of its own, seeded when it starts: a new one (between samples,
        with no request in flight)."""
        self.close()
        self._start(seed)

    def submit(self, rid: str, messages: list[dict], seed: int) -> None:
        p = self.prepare(rid, messages)
        if p is None:
            return
        ids, max_new = p
        self.lens[rid] = len(ids)
        self.manager.add_request(ids, request_id=rid, max_new_tokens=max_new)

    def poll(self, timeout: float) -> list[TurnResult]:
        out, self.ready = self.ready, []
        if not self.lens:
            return out
        r = self.manager.get_result(timeout=0 if out else timeout)
        while r is not None:
            if r.is_finished() and r.request_id in self.lens:
                plen = self.lens.pop(r.request_id)
                if r.error is not None:
                    out.append(TurnResult(r.request_id, error="generation_error", message=str(r.error)[:300]))
                else:
                    out.append(self.result(r.request_id, plen, r.generated_tokens))
            r = self.manager.get_result(timeout=0)
        if not out and not self.manager.is_running():
            raise EyasError("the continuous-batching generation thread stopped unexpectedly "
                            "(try --engine generate); finished shards are kept")
        return out

    def close(self) -> None:
        try:
            self.manager.stop(block=True, timeout=10)
        finally:
            self.manager.destroy()


def oom_summary(message: str) -> str:
    """The parts of torch's out-of-memory message that tell an estimate too low from a fragmented allocator: what
    the failed allocation asked for, and what the allocator held reserved but unallocated."""
    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", message)
    idle = re.search(r"([\d.]+ [KMGT]?i?B) is reserved by PyTorch but unallocated", message)
    parts = ([f"it asked for {asked.group(1)}"] if asked else []) + (
        [f"{idle.group(1)} reserved but unallocated"] if idle else [])
    return ", ".join(parts)


def oom_detail(chunk: int | None, peak: int | None, why: str) -> str:
    """A parenthesis for the out-of-memory line: the call's plan and torch's account (either may be absent)."""
    parts = ([f"prefill chunk {chunk:,}"] if chunk else []) + (
        [f"estimated {human_bytes(peak)}"] if peak else []) + ([f"torch: {why}"] if why else [])
    return f" ({'; '.join(parts)})" if parts else ""


class GenerateEngine(EmbeddedEngine):
    """Padded batches through `model.generate`, prompts grouped by length (shortest first) so little
    of each batch is padding. Each batch is sized to the free memory (eyas.engine.memory): as many of the shortest
    waiting prompts as fit, up to `batch`, the prompts prefilled in chunks where a whole prefill would not fit. A batch
    that still runs out of memory is halved and retried (_smaller)."""
    name = "generate"
    budget_share = 0.9  # of the free memory: the allocator's fragmentation and what the estimate leaves out

    def __init__(self, target, rc, reasoning, ctx_limit):
        super().__init__(target, rc, reasoning, ctx_limit)
        self.pending: list[tuple[str, list[int], int, int]] = []
        self.gen = self.generation_config(sampled=False)  # sampling: each row from its request's seed (sampling.py)
        eager = getattr(target.config, "_attn_implementation", None) == "eager"
        self.cost = ForwardCost.from_config(target.config, target.dtype.itemsize, eager=eager,
                                            cpu=target.device.type == "cpu")
        self.all_logits = all_logits(target.model)
        # the devices the target runs on and the share of its layers' KV cache each keeps (one, all of it, unless
        # target.device_map split it)
        self.shares = layer_shares(target.model) or {target.device: 1.0}
        self.scale = 1  # the estimate's multiplier: doubled at each out-of-memory error
        self.most_rows = 0  # the largest batch generated so far (each sized to the memory, up to `batch`)
        torch.manual_seed(rc.seed)
        self._log_plan()

    def _plan(self, batch: list[tuple[str, list[int], int, int]]) -> BatchPlan | None:
        """The rows and prefill chunk of the waiting prompts `batch` (sorted, shortest first) that fit the memory. A
        target split by target.device_map is planned on each of its devices (the KV cache of its layers there, the
        widest layer's transients and the logits counted on every one): the fewest rows any device takes, then the
        shortest prefill chunk any needs at that many rows. Sets self.bound: (device, free bytes) of the device that
        bounds the plan."""
        widths, news = [len(p) for _, p, _, _ in batch], [m for _, _, m, _ in batch]
        devices = self._devices()

        def plans(cap):
            return [(plan_batch(cost, self.budget_share * free / self.scale, widths, news, cap, self.all_logits),
                     dev, free) for dev, free, cost in devices]
        got = plans(self.batch)
        if any(p is None for p, _, _ in got):
            self.bound = next((dev, free) for p, dev, free in got if p is None)
            return None
        rows = min(p.rows for p, _, _ in got)
        if any(p.rows > rows for p, _, _ in got):
            got = plans(rows)
        plan, *bound = min(got, key=lambda g: (g[0].rows, g[0].chunk or widths[g[0].rows - 1] + 1))
        self.bound = tuple(bound)
        return plan

    def _devices(self) -> list[tuple[torch.device, int, ForwardCost]]:
        """(device, its free bytes, the forward's cost there) for each device the target runs on."""
        return [(dev, free_bytes(dev), dataclasses.replace(self.cost, kv_token=math.ceil(self.cost.kv_token * share)))
                for dev, share in self.shares.items()]

    def _log_plan(self) -> None:
        """One line: the batch prompts at the context limit get, and what bounds it."""
        width = max(1, self.ctx_limit - 1)
        new = max(1, min(self.rc.max_new_tokens, self.model_max - width))
        plan = self._plan([("", [0] * width, new, 0)] * self.batch)
        dev, free = self.bound
        where = (f"{human_bytes(free)} free on {dev}, the tightest of the {len(self.shares)} devices the target is "
                 f"split over" if len(self.shares) > 1 else f"{human_bytes(free)} free on the {dev.type} device")
        if plan is None:
            log(f"regen: generate engine: by its memory estimate not even one prompt of {width:,} tokens fits the "
                f"{where}; it tries one at a time, prefilled in chunks of {MIN_CHUNK} tokens")
        elif not plan.limited:
            log(f"regen: generate engine: {plan.rows} prompts a batch (at {width:,} prompt and {new:,} new tokens "
                f"about {human_bytes(plan.peak)} of the {where})")
        else:
            log(f"regen: generate engine: prompts of {width:,} tokens go {plan.rows} at a time"
                + (f", not {self.batch}" if plan.rows < self.batch else "")
                + (f", prefilled in chunks of {plan.chunk:,} tokens" if plan.chunk else "")
                + f", to fit the {where}: {self.cost.ruling(plan.rows, plan.chunk or width, width)}, the KV cache "
                f"{human_bytes(self.cost.kv_token)} a token (shorter prompts go more at a time)")

    def submit(self, rid: str, messages: list[dict], seed: int) -> None:
        p = self.prepare(rid, messages)
        if p is not None:
            self.pending.append((rid, *p, seed))

    def poll(self, timeout: float) -> list[TurnResult]:
        out, self.ready = self.ready, []
        if out or not self.pending:
            return out
        self.pending.sort(key=lambda x: len(x[1]))
        plan = self._plan(self.pending[: self.batch])
        rows, chunk = (plan.rows, plan.chunk) if plan else (1, MIN_CHUNK)  # none fits by the estimate: try one
        batch, self.pending = self.pending[:rows], self.pending[rows:]
        peak = plan.peak if plan else None
        while True:
            try:
                return out + self._generate(batch, chunk)
            except torch.OutOfMemoryError as e:
                # only the message is kept: the retry runs outside the handler, whose traceback holds the failed
                # call's tensors
                why = oom_summary(str(e))
            batch, chunk = self._smaller(batch, chunk, oom_detail(chunk, peak, why))
            peak = None

    def rows_together(self) -> int:
        return self.most_rows or self.batch

    def _smaller(self, batch: list, chunk: int | None, detail: str = "") -> tuple[list, int | None]:
        """After an out-of-memory error: half the rows (the rest wait for a later batch), or with one row left half the
        prefill chunk; refused in one line where no smaller call is left. Later batches take at most as many rows
        and are planned with twice the estimate (halving the rows alone, a plan would lengthen their prefill chunk)."""
        release_memory()
        self.scale *= 2
        width = max(len(p) for _, p, _, _ in batch)
        if len(batch) > 1:
            keep = len(batch) // 2
            self.pending[:0] = batch[keep:]
            self.batch = min(self.batch, keep)
            log(f"regen: out of memory generating {len(batch)} prompts of up to {width:,} tokens on the generate "
                f"engine{detail}; retrying {keep} of them, and later batches take at most {keep} with twice the "
                f"memory estimate")
            return batch[:keep], chunk
        step = min(chunk or width, width)
        if step <= 1:
            raise EyasError(f"the generate engine runs out of memory on a single prompt of {width:,} tokens even with "
                            f"its prefill one token at a time; lower data.max_seq_len or regen.max_new_tokens, or "
                            f"free the device's memory")
        log(f"regen: out of memory prefilling one prompt of {width:,} tokens{detail}; retrying in chunks of "
            f"{step // 2:,} tokens")
        return batch, step // 2

    def _generate(self, batch: list[tuple[str, list[int], int, int]], chunk: int | None) -> list[TurnResult]:
        """One `model.generate` call on `batch`, left-padded, the prompts prefilled in chunks of `chunk` tokens."""
        width = max(len(b[1]) for b in batch)
        pad = self.gen.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for _, p, _, _ in batch], device=self.t.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p, _, _ in batch], device=self.t.device)
        kw = {}
        if self.rc.temperature > 0:
            seeds = torch.tensor([s for *_, s in batch], device=self.t.device)
            kw["logits_processor"] = LogitsProcessorList(
                [SeededSampling(self.rc.temperature, self.rc.top_p, seeds, width)])
        gen = copy.deepcopy(self.gen)  # this call's settings in its config (transformers deprecates them beside one)
        gen.max_new_tokens = max(b[2] for b in batch)
        gen.prefill_chunk_size = chunk if chunk and chunk < width else None
        with torch.no_grad():
            res = self.t.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen, **kw)
        self.most_rows = max(self.most_rows, len(batch))
        return [self.result(rid, len(p), row[:max_new])
                for row, (rid, p, max_new, _) in zip(res[:, width:].tolist(), batch)]

    def close(self) -> None:
        pass


class StaticEngine(EmbeddedEngine):
    """eyas' own decode loop on FastLM. Each of the `batch` cache rows holds one sequence; every
    `check_every` decode steps one host sync finds the finished rows, which are refilled at once with
    waiting prompts (prefilled together, right-padded, in chunks of at most `prefill_tokens` tokens).
    A decode step advances all rows at a fixed shape (one CUDA graph replay on GPU) and samples on the
    device; a finished row keeps its position and writes its tokens to a spare column until refilled.

    Row groups (off by default): the first quarter of the rows takes prompts longer than `long_prompt`
    tokens (and others when it has room), the rest the shorter ones, and each group's attention spans only
    its own longest context (FastLM row groups). They gain nothing on ShareGPT-like prompts: long prompts
    spill into the short rows, whose span then grows too.

    `check_every` (None: 16 on a GPU, 8 elsewhere): on a GPU a host sync leaves the GPU waiting, so fewer
    checks are faster, while on a CPU a sync costs nothing and a finished row's idle steps cost as much as
    busy ones."""
    name = "static"
    # rows a step on a GPU: of 256, 512 and 1,024, 512 writes the most tokens a second (bench/bench_regen.py
    # compares them). Fewer where the cache would not fit (_rows_that_fit)
    gpu_batch = 512
    check_every: int | None = None
    long_prompt = 256
    row_groups = False
    # overlap: queue the next decode steps before reading which rows finished, from a copy of the row state
    # taken after the previous steps, so the GPU need not wait for the host at each check (without it the GPU
    # idles at every check)
    overlap = True

    def __init__(self, target, rc, reasoning, ctx_limit):
        super().__init__(target, rc, reasoning, ctx_limit)
        ok, why = supported(target.model)
        if not ok:
            raise EyasError(f"the static regen engine cannot run this target: {why}; use --engine generate")
        dev = target.device
        # a prompt is shorter than ctx_limit, and prompt + answer fit the model's context (see prepare)
        max_len = min(self.model_max, self.ctx_limit + rc.max_new_tokens)
        self.batch = self._rows_that_fit(target, max_len)
        self.prefill_tokens = 16384 if dev.type == "cuda" else 2048
        self.check_every = self.check_every or (16 if dev.type == "cuda" else 8)
        torch.manual_seed(rc.seed)
        self.lm = FastLM(target.model, self.batch, max_len)
        self.long_rows = self.batch // 4 if self.row_groups and self.batch >= 8 else 0
        if self.long_rows:
            self.lm.set_groups([0, self.long_rows])
        self.stop = torch.tensor(sorted(self.eot), device=dev)
        B = self.batch
        self.done = torch.ones(B, dtype=torch.bool, device=dev)  # idle rows count as done
        self.nnew = torch.zeros(B, dtype=torch.long, device=dev)  # tokens generated so far
        self.limit = torch.ones(B, dtype=torch.long, device=dev)  # max new tokens of the row
        self.out = torch.zeros(B, rc.max_new_tokens + 1, dtype=torch.long, device=dev)  # last column: spare
        self.seed = torch.zeros(B, dtype=torch.long, device=dev)  # each row's request's seed (sampling.py)
        self.pick_rows: slice | None = None  # the rows an eager decode step advances (the busy span)
        self.step = DecodeGraph(self.lm, self._pick)  # after the buffers _pick reads: a GPU captures it here
        self.pending: deque[tuple[str, list[int], int]] = deque()  # (rid, prompt, max new): greedyval fills it too
        self.seeds: dict[str, int] = {}  # each waiting request's seed (0 where none was given)
        self.slot: list[tuple[str, int] | None] = [None] * B  # (rid, prompt length) of each busy row
        self.hpos = [0] * B  # host-side bound on each busy row's next position
        self.cap = [0] * B  # ... and the last position it can reach
        if self.overlap:  # two host copies of (done, nnew, out), written in turn after each batch of steps
            pin = dev.type == "cuda"
            self.snaps = [{k: torch.zeros(v.shape, dtype=v.dtype, pin_memory=pin)
                           for k, v in (("done", self.done), ("nnew", self.nnew), ("out", self.out))} for _ in range(2)]
            self.snap_count = 0  # copies taken so far; copy i lives in snaps[i % 2]
            self.snap_event = None  # marks when the last copy is complete (GPU)
            self.valid_from = [0] * B  # a row's copies count from this one on (its prefill came before it)

    def _rows_that_fit(self, target, max_len: int) -> int:
        """`self.batch`, or fewer rows when a cache of `max_len` slots per row would not fit in half of
        the free memory."""
        c = target.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        per_row = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * max_len * target.dtype.itemsize
        if target.device.type == "cuda":
            free = torch.cuda.mem_get_info(target.device)[0]
        else:
            free = mem_available()
        rows = min(self.batch, free // 2 // per_row)
        if rows < 1:
            raise EyasError(f"the static regen engine's KV cache needs {human_bytes(per_row)} for one sequence of "
                            f"{max_len} tokens but only {human_bytes(free)} are free; lower data.max_seq_len or "
                            f"regen.max_new_tokens, or use --engine generate")
        if rows < self.batch:
            log(f"regen: the static KV cache holds {rows} sequences, not {self.batch} ({human_bytes(per_row)} each "
                f"for {max_len} tokens; {human_bytes(free)} free)")
        return rows

    def _pick(self, logits, rows=None):
        """Next token per row from logits [b, V] of rows `rows` (an index tensor; None: the rows a decode step
        advances), on the device without a host sync: argmax, or a draw from the temperature/top-p distribution
        seeded by each row's request and step (sampling.py: graph-safe)."""
        if self.rc.temperature == 0:
            return logits.argmax(-1)
        if rows is None:  # a decode step: the token numbered nnew of each row, of every row (a graph) or the span
            rows = slice(None) if logits.shape[0] == self.batch or self.pick_rows is None else self.pick_rows
            steps = self.nnew[rows]
        else:  # a prefill: each row's first token
            steps = self.nnew.new_zeros(logits.shape[0])
        return seeded_pick(logits, self.rc.temperature, self.rc.top_p, self.seed[rows], steps)

    def submit(self, rid: str, messages: list[dict], seed: int) -> None:
        p = self.prepare(rid, messages)
        if p is not None:
            self.pending.append((rid, *p))
            self.seeds[rid] = seed

    def _admit(self) -> None:
        """Fill free rows with waiting prompts: long prompts into the long rows (short ones into the
        others) while they have room, then right-padded prefills of at most `prefill_tokens` tokens,
        shortest first, each row's first token sampled from its last prompt position."""
        free = [r for r, s in enumerate(self.slot) if s is None]
        take = [self.pending.popleft() for _ in range(min(len(free), len(self.pending)))]
        take.sort(key=lambda x: len(x[1]))
        pools = ([r for r in free if r >= self.long_rows], [r for r in free if r < self.long_rows])  # short, long
        rows = [0] * len(take)
        for j in reversed(range(len(take))):  # the longest prompts choose first
            want = int(len(take[j][1]) > self.long_prompt)
            rows[j] = (pools[want] or pools[1 - want]).pop()
        i = 0
        while i < len(take):
            j = i + 1
            while j < len(take) and (j + 1 - i) * len(take[j][1]) <= self.prefill_tokens:
                j += 1
            self._prefill(rows[i:j], take[i:j])
            i = j

    def _prefill(self, rows: list[int], items: list[tuple[str, list[int], int]]) -> None:
        def send(data):  # without waiting for the decode steps queued on a GPU
            return to_device(torch.tensor(data), self.t.device)

        width = max(len(p) for _, p, _ in items)
        ids = send([p + [0] * (width - len(p)) for _, p, _ in items])
        lens = send([len(p) for _, p, _ in items])
        limit = send([m for _, _, m in items])
        r = send(rows)
        self.seed[r] = send([self.seeds.pop(rid, 0) for rid, _, _ in items])
        logits, _ = self.lm.forward(ids, torch.zeros_like(lens), rows=r, upto=width, last_idx=lens - 1, one_off=True)
        tok = self._pick(logits[:, 0], r)
        self.step.ids[r, 0] = tok
        self.step.pos[r] = lens
        self.out[r, 0] = tok
        self.nnew[r] = 1
        self.limit[r] = limit
        self.done[r] = (tok[:, None] == self.stop).any(-1) | (limit <= 1)
        for row, (rid, p, m) in zip(rows, items):
            self.slot[row] = (rid, len(p))
            self.hpos[row], self.cap[row] = len(p), len(p) + m - 1
            if self.overlap:
                self.valid_from[row] = self.snap_count  # the next copy (this index) is taken after this prefill

    def _decode(self, steps: int) -> None:
        """`steps` decode steps over all rows; no host sync."""
        busy = [r for r, s in enumerate(self.slot) if s is not None]
        if not busy:
            return
        if self.lm.groups:  # each group's bound: its busiest row (1 for a group with none)
            his = [max((self.hpos[r] for r in busy if a <= r < z), default=0) for a, z in self.lm.groups]
        else:
            his = [max(self.hpos[r] for r in busy)]
        spare = self.out.shape[1] - 1
        # eager steps (a CPU) advance only the span of busy rows: the idle rows' tokens are thrown away, and a
        # run with fewer prompts than rows, or the tail of one, would pay for every row. A CUDA graph replays its
        # fixed shape.
        span = None if self.lm.groups else slice(min(busy), max(busy) + 1)
        self.pick_rows = span
        for s in range(steps):
            tok = self.step(upto=tuple(h + s + 1 for h in his) if self.lm.groups else his[0] + s + 1, rows=span)
            live = ~self.done
            self.out.scatter_(1, torch.where(live, self.nnew, spare)[:, None], tok[:, None])
            self.nnew += live
            self.step.pos += live
            self.step.ids[:, 0] = torch.where(live, tok, self.step.ids[:, 0])
            self.done |= live & ((tok[:, None] == self.stop).any(-1) | (self.nnew >= self.limit))
        for r in busy:
            self.hpos[r] = min(self.hpos[r] + steps, self.cap[r])

    def _collect(self) -> list[TurnResult]:
        """The one host sync of a check: results of the rows that finished, whose rows become free."""
        done = self.done.tolist()
        rows = [r for r, s in enumerate(self.slot) if s is not None and done[r]]
        if not rows:
            return []
        r = torch.tensor(rows, device=self.t.device)
        packed = torch.cat([self.nnew[r, None], self.out[r]], 1).tolist()
        res = []
        for row, (n, *toks) in zip(rows, packed):
            rid, plen = self.slot[row]
            self.slot[row] = None
            res.append(self.result(rid, plen, toks[:n]))
        return res

    def _snapshot(self) -> None:
        """Copy the row state to the host after the steps queued so far, without waiting for them."""
        snap = self.snaps[self.snap_count % 2]
        for k in snap:
            snap[k].copy_(getattr(self, k), non_blocking=True)
        self.snap_count += 1
        if self.t.device.type == "cuda":
            self.snap_event = torch.cuda.Event()
            self.snap_event.record()

    def _collect_copy(self, i: int, event) -> list[TurnResult]:
        """Results of the rows finished in host copy i (waits for that copy only)."""
        if event is not None:
            event.synchronize()
        snap = self.snaps[i % 2]
        done = snap["done"].tolist()
        res = []
        for row, s in enumerate(self.slot):
            if s is None or not done[row] or self.valid_from[row] > i:
                continue
            n = int(snap["nnew"][row])
            rid, plen = s
            self.slot[row] = None
            res.append(self.result(rid, plen, snap["out"][row, :n].tolist()))
        return res

    def poll(self, timeout: float) -> list[TurnResult]:
        out, self.ready = self.ready, []
        while not out and (self.pending or any(s is not None for s in self.slot)):
            if self.overlap:
                # the next steps first, then a copy of the state after them; the rows that finished are read
                # from the copy taken after the previous steps, while the GPU runs the new ones
                prev, prev_event = self.snap_count - 1, self.snap_event
                self._decode(self.check_every)
                self._snapshot()
                if prev >= 0:
                    out += self._collect_copy(prev, prev_event)
                self._admit()
                continue
            out += self._collect()
            if self.t.device.type == "cuda":
                # queue the next steps first: the GPU runs them while the host launches the prefill and
                # the caller renders the next prompts (a freed row waits one check longer)
                self._decode(self.check_every)
                self._admit()
            else:
                self._admit()
                self._decode(self.check_every)
        return out

    def close(self) -> None:
        self.lm = self.step = None


def embedded_engine(target, rc: RegenConfig) -> type[EmbeddedEngine]:
    """The engine class rc.engine names for this target (auto: static where it runs the target), built by no one."""
    engine = rc.engine
    # auto never picks continuous: transformers' continuous batching runs well below the padded, length-grouped
    # generate engine (bench/bench_regen.py compares them)
    if engine == "auto":  # static wherever it runs the target (faster than the generate engine, on a CPU too)
        engine = "static" if fast_engine_runs(target.model, "regen") else "generate"
    if engine == "continuous" and not hasattr(target.model, "init_continuous_batching"):
        raise EyasError("this transformers version has no continuous batching; use --engine generate")
    return {"static": StaticEngine, "continuous": ContinuousEngine}.get(engine, GenerateEngine)


def make_embedded(target, rc: RegenConfig, reasoning: str, ctx_limit: int) -> EmbeddedEngine:
    """The engine embedded_engine names, built; a continuous engine that cannot start on this target is refused in
    one line that names the generate engine instead."""
    cls = embedded_engine(target, rc)
    try:
        return cls(target, rc, reasoning, ctx_limit)
    except EyasError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. an architecture without paged attention
        if cls is not ContinuousEngine:
            raise
        raise EyasError(f"continuous batching could not start for this target ({type(e).__name__}: {e}); "
                        f"use --engine generate") from None
