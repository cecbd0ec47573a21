"""`eyas regen`: regenerate every assistant turn of a data set with the target, so the drafter learns
the target's own answers.

For each conversation the system and user turns are kept, the original assistant turns dropped, and
each assistant turn generated in order, conditioned on the regenerated history. Backends:

* embedded (default): the target in-process. `static` is eyas' own decode loop (eyas.fastlm): a
  static KV cache of `batch` rows, a finished row refilled with the next prompt within a few steps
  (a conversation's next turn joins as soon as its previous turn ends), one CUDA graph per decode step
  on GPU; it runs Llama, Mistral and Qwen2 targets. `continuous` uses transformers' continuous
  batching (paged KV cache); `generate` is the fallback for any target: padded batches of prompts
  grouped by length through `model.generate`. `auto` takes `static` where it can run, else `generate`.
* server: any OpenAI-compatible endpoint (see server.py).

Output: `<run>/data/regen/shard-NNNNN.jsonl`, one `Conversation.to_dict()` per line with `meta`
holding the source id, sampling settings and per-turn finish reason and token counts. `plan.json`
fixes which conversations go to which shard, so a killed run resumes: shards are written whole
(atomic rename) once all their conversations are done, existing shards are never touched, and the
rest is generated again. Until its shard is written, each finished conversation is appended to the shard's
journal (`shard-NNNNN.partial`), which a resumed run reads back instead of asking again: a kill loses only the
conversations in flight (a multi-turn conversation can hold its shard open for minutes while the window moves on,
so without it a kill lost whole shards' worth of finished work). Conversations that failed are listed in
`shard-NNNNN.errors.json`.
Beside the first sample, `regen.samples` writes sample S as `shard-sS-*.jsonl` (record ids `<id>~sampleS`), and
`regen.later_turns` the later answers of every conversation that has a later user turn as `shard-later-*.jsonl`
(record ids `<id>~later`): its first answer as the data set has it, each later one generated with the data set's
own earlier answers before it rather than the target's (which loop more with every turn).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config, RegenConfig, check_settings
from ..util import (EyasError, atomic_write_json, atomic_write_text, dist_barrier, dist_env, human_bytes, log,
                    mem_available, progress, read_json, repeated_share, stable_hash, text_lines, to_device)
from .conversation import Conversation, Turn, split_reasoning
from .prepare import check_data_settings, regen_dir
from .readers import LATER_SUFFIX, SAMPLE_SUFFIX, read_dataset, select_split
from .reasoning import capture_by_turn, capture_words
from .regen_failed import CallOutcomes, failure_error, folder_failures
from .server import ServerBackend, TurnResult, template_kwargs

PLAN_VERSION = 1


LATER = "later"  # the set regen.later_turns writes, beside the samples (1, 2, ...)


def _tag(sample: int | str) -> str:
    """A set's name in its files: none for the first sample, sS for sample S, `later` for the later turns."""
    return "" if sample == 1 else f"s{sample}" if isinstance(sample, int) else sample


def _shard_prefix(sample: int | str) -> str:
    """What every file name of a set's shards starts with, before the shard's number."""
    return f"shard-{_tag(sample)}-" if _tag(sample) else "shard-"


def _shard_stem(k: int, sample: int | str) -> str:
    return f"{_shard_prefix(sample)}{k:05d}"


def shard_path(d: Path, k: int, sample: int | str = 1) -> Path:
    return d / f"{_shard_stem(k, sample)}.jsonl"


# what each kind of left-out conversation means, for the log (http_NNN and others are shown as they are)
ERROR_WORDS = {"context": "first prompt too long for the context", "empty_answer": "empty first answer",
               "bad_response": "the server's answers unreadable", "unreadable_record": "unreadable shard lines"}


def left_out_words(errors: dict) -> str:
    """A report's `errors` (kind -> count) in words: "first prompt too long for the context: 6, http_400: 1"."""
    return ", ".join(f"{ERROR_WORDS.get(k, k)}: {n}" for k, n in sorted(errors.items()))


def errors_path(d: Path, k: int, sample: int | str = 1) -> Path:
    return d / f"{_shard_stem(k, sample)}.errors.json"


def journal_path(d: Path, k: int, sample: int | str = 1) -> Path:
    """Shard k's finished conversations so far, a JSON line each, until the shard is written (not *.jsonl, so no
    reader of shards takes it for one)."""
    return d / f"{_shard_stem(k, sample)}.partial"


def plan_path(d: Path, sample: int | str = 1) -> Path:
    return d / (f"plan-{_tag(sample)}.json" if _tag(sample) else "plan.json")


def _samples_after(d: Path, n: int) -> list[int]:
    """The samples after the first n that regen folder d holds files of (shards, journals, error lists or plans)."""
    found = (re.match(r"(?:shard|plan)-s(\d+)[-.]", f.name) for f in d.iterdir()) if d.is_dir() else ()
    return sorted({int(m[1]) for m in found if m and int(m[1]) > n})


def drop_samples_after(d: Path, n: int) -> list[int]:
    """Remove the sets of samples after the first n from the regen folder d (their shards, journals, error lists and
    plans) and its report, which no longer describes the folder; the first sample and the later turns stay. Returns
    the samples removed. For `eyas run` when only regen.samples changed: the samples kept are what a run with the new
    count makes of them (a sample's plan, seeds and shards do not depend on the count)."""
    gone = _samples_after(d, n)
    for s in gone:
        for f in [*d.glob(f"{_shard_prefix(s)}*"), plan_path(d, s)]:
            f.unlink(missing_ok=True)
    (d / "report.json").unlink(missing_ok=True)
    return gone


def check_no_extra_sets(d: Path, samples: int, later_turns: bool) -> None:
    """Refuse a regen folder d that holds sets of answers a call with these settings does not ask for: samples after
    the first `samples`, or later turns where regen.later_turns is off. Every command that trains on the folder reads
    all its shards, so they would be trained on as well. `eyas run` removes them itself when only the sample count
    went down (drop_samples_after) and starts over on any other change; a standalone `eyas regen` leaves the choice
    to its user: go on with them, or remove them."""
    if not d.is_dir():
        return
    extra: list[int | str] = list(_samples_after(d, samples))
    if not later_turns and (plan_path(d, LATER).exists() or any(d.glob(f"{_shard_prefix(LATER)}*"))):
        extra.append(LATER)
    if not extra:
        return
    nums = [x for x in extra if x != LATER]
    what = ", ".join([*(f"sample {x}" for x in nums), *(["the later turns"] if LATER in extra else [])])
    asks = f"regen.samples={samples}" + ("" if later_turns or LATER not in extra else ", regen.later_turns off")
    keep = ([f"--samples {max(nums)}"] if nums else []) + (["--later-turns"] if LATER in extra else [])
    files = ", ".join(f"{_shard_prefix(x)}*, {plan_path(d, x).name}" for x in extra)
    raise EyasError(f"{d} holds answers this call does not ask for ({what}; it asks for {asks}). Every command "
                    f"that trains on this folder reads all of them. To go on with them, give {' '.join(keep)}; to "
                    f"keep only what this call asks for, delete their files in {d} ({files}) first")


def sample_copy(conv: Conversation, sample: int) -> Conversation:
    """The conversation to regenerate as its sample `sample` (> 1): its id suffixed, so its seeds, shards and
    records are its own; `split_of` strips the suffix, so every sample of a conversation lands on the same side of
    a split."""
    return Conversation(f"{conv.id}{SAMPLE_SUFFIX}{sample}", list(conv.turns),
                        {**conv.meta, "sample_of": conv.id, "sample": sample})


def later_copy(conv: Conversation) -> Conversation:
    """The conversation whose later answers regen.later_turns asks for, with an id of its own (as sample_copy)."""
    return Conversation(f"{conv.id}{LATER_SUFFIX}", list(conv.turns), {**conv.meta, "later_of": conv.id})


def answer_slots(conv: Conversation) -> int:
    """How many answers regeneration asks for in `conv` (every one, regen.turns=0)."""
    return len(ConvState(0, conv).source_answers)


# --------------------------------------------------------------------------- one conversation


@dataclass
class ConvState:
    """Walks one conversation: keeps system/user turns, asks for an assistant turn wherever the source
    had one (and after a final unanswered user turn), stops after `max_turns` answers.
    `history="original"` asks each answer with the source's own earlier answers as its context instead of the
    target's (the record still holds the target's answers); `keep` answers at the start are kept as the source has
    them, not asked for (regen.later_turns: keep=1, the first answer being the samples')."""
    index: int
    conv: Conversation
    max_turns: int = 0
    history: str = "generated"
    keep: int = 0
    out: list[Turn] = field(default_factory=list)
    turn_meta: list[dict] = field(default_factory=list)
    pos: int = 0
    error: tuple[str, str] | None = None
    stopped: str | None = None

    def __post_init__(self):
        script: list = []
        answers: list = []  # the source's answer in each slot (None after a final unanswered user turn)
        seen_user = False
        for t in self.conv.turns:
            if t.role == "assistant":
                if seen_user and (not script or script[-1] is not None):
                    script.append(None)  # None = generate here
                    answers.append(t)
            else:
                seen_user |= t.role == "user"
                script.append(t)
        if script and script[-1] is not None and seen_user:
            script.append(None)
            answers.append(None)
        if self.max_turns:
            n = 0
            for i, s in enumerate(script):
                n += s is None
                if n == self.keep + self.max_turns:
                    script = script[: i + 1]
                    break
        self.script = script
        self.source_answers = answers
        self.ctx: list[Turn] = []  # what the next answer is asked with: `out`, or with the source's answers in it
        self.slot = 0  # answer slots passed

    def next_messages(self) -> list[dict] | None:
        """Messages to answer next, or None when the conversation is done."""
        if self.error or self.stopped:
            return None
        while self.pos < len(self.script):
            t = self.script[self.pos]
            if t is None:
                if self.slot >= self.keep:
                    break
                t = self.source_answers[self.slot]  # kept as the source has it
                self.slot += 1
            self.out.append(t)
            self.ctx.append(t)
            self.pos += 1
        if self.pos >= len(self.script):
            return None
        return [{"role": t.role, "content": t.content, **({"reasoning": t.reasoning} if t.reasoning else {})}
                for t in self.ctx]

    def accept(self, r: TurnResult) -> None:
        if r.error:
            self.error = (r.error, r.message)
            self.failed_retries = dict(r.retries)
            return
        meta = {"finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens}
        if r.retries:
            meta["retries"] = dict(r.retries)
        if r.finish_reason == "context":
            self.stopped = "context"
        elif not r.content.strip() and not r.reasoning:
            self.stopped = "empty_answer"
        else:
            answer = Turn("assistant", r.content, r.reasoning)
            self.out.append(answer)
            source = self.source_answers[self.slot]
            self.ctx.append(source if self.history == "original" and source is not None else answer)
            self.turn_meta.append(meta)
            self.pos += 1
            self.slot += 1
            return
        self.dropped = meta

    @property
    def n_answers(self) -> int:
        return len(self.turn_meta)

    def record(self, settings: dict, backend: dict) -> dict:
        turns = list(self.out)
        while turns and turns[-1].role != "assistant":  # a conversation ends with an answer
            turns.pop()
        meta = {"source_id": self.conv.id, **backend, "sampling": settings, "turns": self.turn_meta}
        if self.keep:
            meta["source_answers_kept"] = self.keep
        if self.stopped:
            meta["stopped"] = self.stopped
            meta["dropped_turn"] = getattr(self, "dropped", {})
        if self.conv.meta:
            meta["source_meta"] = self.conv.meta
        return Conversation(self.conv.id, turns, meta).to_dict()


# --------------------------------------------------------------------------- embedded engines


def _render_prompt(tokenizer, messages: list[dict], reasoning: str) -> list[int]:
    from .reasoning import history_messages
    from .tokenize import render

    turns = [Turn(m["role"], m["content"], m.get("reasoning")) for m in messages]
    text = render(tokenizer, history_messages(turns, tokenizer, reasoning), add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


class _Embedded:
    """What both embedded engines share: prompt rendering, context limits, decoding of answers."""

    gpu_batch = 256  # regen.batch_size=0 on a GPU (32 on a CPU)

    def reseed(self, seed: int) -> None:
        """Restart the sampling stream of an engine that draws from one (the continuous engine; the static and
        generate engines seed each request's draws from its own seed, seeded.py): regen.samples' later samples start
        from a seed of their own, so a sample regenerated in a later process than the first does not replay the
        first's draws over the same prompts."""
        import torch

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
        from transformers import GenerationConfig

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


class ContinuousEngine(_Embedded):
    """transformers continuous batching: a paged KV cache shared by up to `batch` running sequences."""
    name = "continuous"

    def __init__(self, target, rc, reasoning, ctx_limit):
        super().__init__(target, rc, reasoning, ctx_limit)
        self.lens: dict[str, int] = {}
        self._start(rc.seed)

    def _start(self, seed: int) -> None:
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


class GenerateEngine(_Embedded):
    """Padded batches through `model.generate`, prompts grouped by length (shortest first) so little
    of each batch is padding."""
    name = "generate"

    def __init__(self, target, rc, reasoning, ctx_limit):
        super().__init__(target, rc, reasoning, ctx_limit)
        import torch

        self.pending: list[tuple[str, list[int], int, int]] = []
        self.gen = self.generation_config(sampled=False)  # sampling: each row from its request's seed (seeded.py)
        torch.manual_seed(rc.seed)

    def submit(self, rid: str, messages: list[dict], seed: int) -> None:
        p = self.prepare(rid, messages)
        if p is not None:
            self.pending.append((rid, *p, seed))

    def poll(self, timeout: float) -> list[TurnResult]:
        import torch

        out, self.ready = self.ready, []
        if out or not self.pending:
            return out
        self.pending.sort(key=lambda x: len(x[1]))
        batch, self.pending = self.pending[: self.batch], self.pending[self.batch:]
        width = max(len(b[1]) for b in batch)
        pad = self.gen.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for _, p, _, _ in batch], device=self.t.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p, _, _ in batch], device=self.t.device)
        sampling = {}
        if self.rc.temperature > 0:
            from transformers import LogitsProcessorList

            from .seeded import SeededSampling

            seeds = torch.tensor([s for *_, s in batch], device=self.t.device)
            sampling["logits_processor"] = LogitsProcessorList(
                [SeededSampling(self.rc.temperature, self.rc.top_p, seeds, width)])
        with torch.no_grad():
            res = self.t.model.generate(input_ids=ids, attention_mask=mask, generation_config=self.gen,
                                        max_new_tokens=max(b[2] for b in batch), **sampling)
        for row, (rid, p, max_new, _) in zip(res[:, width:].tolist(), batch):
            out.append(self.result(rid, len(p), row[:max_new]))
        return out

    def close(self) -> None:
        pass


class StaticEngine(_Embedded):
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
    # rows a step on a GPU: 512 wrote the most tokens a second of 256, 512 and 1,024 (bench/bench_regen.py;
    # BENCHMARKS.md). Fewer where the cache would not fit (_rows_that_fit)
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
        import torch

        from ..fastlm import DecodeGraph, FastLM, supported

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
        self.seed = torch.zeros(B, dtype=torch.long, device=dev)  # each row's request's seed (seeded.py)
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
        import torch

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
        seeded by each row's request and step (seeded.py: graph-safe)."""
        from .seeded import seeded_pick

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
        import torch

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
        import torch

        busy = [r for r, s in enumerate(self.slot) if s is not None]
        if not busy:
            return
        if self.lm.groups:  # each group's bound: its busiest row (1 for a group with none)
            his = [max((self.hpos[r] for r in busy if a <= r < z), default=0) for a, z in self.lm.groups]
        else:
            his = [max(self.hpos[r] for r in busy)]
        spare = self.out.shape[1] - 1
        # eager steps (a CPU) advance only the span of busy rows: the idle rows' tokens are thrown away, and a
        # run with fewer prompts than rows, or the tail of one, would pay for every row (the pipeline test's 8
        # prompts on 32 rows: 0.77 s a step on a 2-core CPU). A CUDA graph replays its fixed shape.
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
        import torch

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
        import torch

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


def embedded_engine(target, rc: RegenConfig) -> type[_Embedded]:
    """The engine class rc.engine names for this target (auto: static where it runs the target), built by no one."""
    engine = rc.engine
    # auto never picks continuous: transformers' continuous batching ran well below the padded, length-grouped
    # generate engine (bench/bench_regen.py compares them)
    if engine == "auto":  # static wherever it runs the target (faster than the generate engine, on a CPU too)
        from ..fastlm import fast_engine_runs

        engine = "static" if fast_engine_runs(target.model, "regen") else "generate"
    if engine == "continuous" and not hasattr(target.model, "init_continuous_batching"):
        raise EyasError("this transformers version has no continuous batching; use --engine generate")
    return {"static": StaticEngine, "continuous": ContinuousEngine}.get(engine, GenerateEngine)


def make_embedded(target, rc: RegenConfig, reasoning: str, ctx_limit: int):
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


class _Deferred:
    """An embedded engine built when a shard is left to write: a run whose every shard is on disk (carried, or
    finished before) builds none. The static engine's KV cache can take tens of GB, which torch's allocator
    would keep from the features that `eyas run` trains on next."""

    def __init__(self, target, rc: RegenConfig, reasoning: str, ctx_limit: int):
        self._args, self._engine = (target, rc, reasoning, ctx_limit), None
        self._ident = embedded_engine(target, rc).identity(target)

    def describe(self) -> dict:
        return self._ident

    def __getattr__(self, name):  # anything else is the engine's: built on first use
        if self._engine is None:
            self._engine = make_embedded(*self._args)
        return getattr(self._engine, name)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


def engine_rows(backend) -> int | None:
    """The sequences an embedded engine decodes together (regen.batch_size, or the engine's own choice at 0: 512
    rows on a GPU with the static engine, fewer where its cache would not fit), once it was built; None for a
    server (it batches as it likes) or an engine never built (every shard already on disk)."""
    engine = backend._engine if isinstance(backend, _Deferred) else backend
    rows = getattr(engine, "batch", None) if isinstance(engine, _Embedded) else None
    return rows if isinstance(rows, int) else None


# --------------------------------------------------------------------------- the stage


def sampling_settings(cfg: Config, sample: int | str = 1) -> dict:
    """What a record says it was sampled with; a sample after the first also says which it is (the first's
    settings are the same as a run with regen.samples=1, so such a run's shards count as the first sample), and
    the later turns' set says what it is."""
    rc = cfg.regen
    which = {"later_turns": "original history"} if sample == LATER else {"sample": sample} if sample > 1 else {}
    return {"max_new_tokens": rc.max_new_tokens, "temperature": rc.temperature, "top_p": rc.top_p, "seed": rc.seed,
            "turns": 0 if sample == LATER else rc.turns, "reasoning": cfg.data.reasoning, **which,
            **({"chat_template_kwargs": template_kwargs(rc)} if rc.chat_template_kwargs else {})}


def _plan(d: Path, cfg: Config, ids: list[str], identity: dict, sample: int | str = 1) -> dict:
    # "data": the data settings that chose the conversations (the split's ratios only where a split is taken), so
    # that a command training on the answers can refuse other values it is given (prepare.check_regen_matches). Not
    # compared below, since the ids say which conversations were chosen: settings that choose the same ones replace
    # the record (a plan written before it gains one)
    chose = {"limit": cfg.data.limit}
    if cfg.regen.split != "all":
        chose.update(val_ratio=cfg.data.val_ratio, test_ratio=cfg.data.test_ratio)
    plan = {"version": PLAN_VERSION, "source": cfg.data.source, "split": cfg.regen.split,
            "settings": sampling_settings(cfg, sample), "generator": identity, "shard_size": cfg.regen.shard_size,
            "ids": ids, "data": chose}
    path = plan_path(d, sample)
    if path.exists():
        old = read_json(path)
        if _grows(old, plan):
            _extend(d, old, plan, sample)
            return plan
        for k in ("source", "split", "settings", "generator", "shard_size", "ids"):
            if old.get(k) != plan[k]:
                what = (f"{len(old.get('ids', []))} conversations before, {len(ids)} now" if k == "ids"
                        else f"{old.get(k)!r} before, {plan[k]!r} now")
                raise EyasError(f"{d} holds regenerated data made with different '{k}' ({what}); use another "
                                f"--out, or delete {d} to start over")
        if old.get("data") != plan["data"]:
            old["data"] = plan["data"]
            atomic_write_json(path, old)
        return old
    # a new plan: journals left from an earlier one (its plan deleted by hand) are not this plan's work
    for stale in d.glob(f"{_shard_prefix(sample)}[0-9]*.partial"):
        stale.unlink()
    atomic_write_json(path, plan)
    return plan


def _grows(old: dict, new: dict) -> bool:
    """Whether plan `new` only adds conversations after those of plan `old` (a larger regen.limit over the same data
    and settings): the old shards then hold the first conversations of the new plan's shards of the same numbers."""
    same = all(old.get(k) == new[k] for k in ("source", "split", "settings", "generator", "shard_size"))
    ids = old.get("ids")
    return same and isinstance(ids, list) and len(ids) < len(new["ids"]) and new["ids"][:len(ids)] == ids


def _extend(d: Path, old: dict, new: dict, sample: int | str) -> None:
    """Replace plan `old` by `new`, which adds conversations after its own (`_grows`). Every old shard stays but the
    last one when it was not full: the new plan gives that shard more conversations, so its finished ones go back to
    its journal, where the run reads them instead of asking again, and the shard is written whole once the new ones
    are done. Safe to cut anywhere: the journal is written before the shard is removed, and the plan replaced last."""
    size, n = new["shard_size"], len(old["ids"])
    of = "later turns: " if sample == LATER else f"sample {sample}: " if sample != 1 else ""
    k = n // size  # the old plan's last shard, unless its conversations filled whole shards
    shard = shard_path(d, k, sample)
    if n % size and shard.exists():
        index = {cid: i for i, cid in enumerate(new["ids"][k * size:(k + 1) * size], k * size)}
        got: dict[int, dict] = {}  # what a line does not say clearly is asked again
        for line in text_lines(shard.read_text(encoding="utf-8")):
            try:
                cid = json.loads(line).get("id")
            except (ValueError, AttributeError):
                continue
            if cid in index:
                got[index[cid]] = {"i": index[cid], "id": cid, "line": line}
        ef = errors_path(d, k, sample)
        for e in (read_json(ef).get("errors", []) if ef.exists() else []):
            if isinstance(e, dict) and e.get("id") in index:
                got[index[e["id"]]] = {"i": index[e["id"]], "id": e["id"], "error": e}
        atomic_write_text(journal_path(d, k, sample),
                          "".join(json.dumps(got[i], ensure_ascii=False) + "\n" for i in sorted(got)))
        shard.unlink()
        ef.unlink(missing_ok=True)
    atomic_write_json(plan_path(d, sample), new)
    log(f"regen: {of}the plan grows from {n:,} to {len(new['ids']):,} conversations: the answers to the first {n:,} "
        f"are kept")


def _check_cfg(cfg: Config) -> None:
    """Refuse the settings regen reads out of range, naming the key, before the data set and the target are read."""
    rc = cfg.regen
    if not rc.enabled:  # a setting of `eyas run`, which then leaves this stage out: a call of the stage is not
        where = "this command was given" if "regen.enabled" in getattr(cfg, "explicit", ()) else "the run's settings say"
        raise EyasError(f"{where} regen.enabled=false, which makes `eyas run` leave regeneration out; `eyas regen` "
                        f"stops here and regenerates nothing. To regenerate, give --enabled")
    check_data_settings(cfg)
    check_settings(cfg, (("regen.limit", rc.limit >= 0, "0 (all) or more"),
                         ("regen.turns", rc.turns >= 0, "0 (all) or more"),
                         ("regen.samples", rc.samples >= 1, "at least 1"),
                         ("regen.max_new_tokens", rc.max_new_tokens >= 1, "at least 1"),
                         ("regen.temperature", rc.temperature >= 0, "0 (greedy) or more"),
                         ("regen.top_p", 0 < rc.top_p <= 1, "above 0 and at most 1"),
                         ("regen.batch_size", rc.batch_size >= 0, "0 (auto) or more"),
                         ("regen.concurrency", rc.concurrency >= 1, "at least 1"),
                         ("regen.timeout", rc.timeout > 0, "above 0"),
                         ("regen.retries", rc.retries >= 0, "0 or more"),
                         ("regen.backoff", rc.backoff >= 0, "0 or more"),
                         ("regen.shard_size", rc.shard_size >= 1, "at least 1")))
    if rc.samples > 1 and rc.temperature == 0:
        raise EyasError(f"regen.samples={rc.samples} with regen.temperature=0: greedy answers are the same every "
                        f"time; sample at a temperature above 0 or keep one sample")
    if rc.chat_template_kwargs and rc.backend != "server":  # the embedded engines render with the template's defaults
        raise EyasError("regen.chat_template_kwargs is sent to a server: it needs regen.backend=server (--endpoint)")
    if rc.later_turns and rc.turns != 1:
        raise EyasError(f"regen.later_turns answers the later turns from the source's own history; with "
                        f"regen.turns={rc.turns} the samples would answer them as well: set regen.turns=1")


def run_regen(cfg: Config, target=None) -> dict:
    """Regenerate the assistant turns of cfg.data.source's cfg.regen.split; returns the validation report
    (under torchrun, on rank 0; the other ranks return where rank 0 wrote it)."""
    rc = cfg.regen
    _check_cfg(cfg)
    convs, rep = read_dataset(cfg.data.source, strict=cfg.data.strict, limit=cfg.data.limit)
    if rep.n_skipped:
        log(rep.summary())
    convs = select_split(convs, rc.split, cfg.data.val_ratio, cfg.data.test_ratio)
    if rc.limit:
        convs = convs[: rc.limit]
    seen: set[str] = set()
    dup = [c.id for c in convs if c.id in seen or seen.add(c.id)]
    if dup:
        raise EyasError(f"{cfg.data.source}: record id {dup[0]!r} occurs more than once ({len(dup)} duplicates); "
                        f"regeneration needs unique ids to resume safely")
    if not convs:
        raise EyasError(f"no conversations to regenerate in split '{rc.split}' of {cfg.data.source}")
    d = regen_dir(cfg.out)
    check_no_extra_sets(d, rc.samples, rc.later_turns)
    d.mkdir(parents=True, exist_ok=True)
    rank, world, local = dist_env()
    own_pg = False
    if world > 1:  # torchrun: each process regenerates the shards k with k % world == rank
        import datetime

        import torch.distributed as dist

        if not dist.is_initialized():  # gloo: barriers only; a rank may wait long for the slowest
            dist.init_process_group("gloo", timeout=datetime.timedelta(days=2))
            own_pg = True
    try:
        if rc.backend == "server":
            backend = ServerBackend(rc, cfg.target)
        else:
            from ..target import load_target

            if target is None:
                tcfg = cfg.target
                if world > 1 and tcfg.device in ("auto", "cuda"):
                    import torch

                    if torch.cuda.is_available():
                        torch.cuda.set_device(local)
                        tcfg = dataclasses.replace(tcfg, device=f"cuda:{local}")
                target = load_target(tcfg)
            if not target.has_chat_template:
                raise EyasError(f"target '{target.name}' has no chat template; regeneration needs one")
            backend = _Deferred(target, rc, cfg.data.reasoning, cfg.data.max_seq_len)
        ident = backend.describe()
        identity = {k: v for k, v in ident.items() if k not in ("engine", "endpoints")}
        sets: list[int | str] = [*range(1, rc.samples + 1), *([LATER] if rc.later_turns else [])]
        made = [0, 0.0]  # answer tokens generated by this call, and the seconds spent generating them
        try:
            for sample in sets:
                if sample == LATER:  # conversations with a later answer to ask for
                    these = [later_copy(c) for c in convs if answer_slots(c) > 1]
                else:
                    these = convs if sample == 1 else [sample_copy(c, sample) for c in convs]
                if rank == 0:  # rank 0 writes the plan (or checks the one there); the others then check it
                    plan = _plan(d, cfg, [c.id for c in these], identity, sample)
                dist_barrier()
                if rank != 0:
                    plan = _plan(d, cfg, [c.id for c in these], identity, sample)
                if sample == LATER:
                    log(f"regen: later turns: {len(these)} of {len(convs)} conversations have a later answer")
                n, secs = _drive(backend, these, plan, d, rc, sampling_settings(cfg, sample), ident, rank, world,
                                 sample, rc.samples)
                made[0] += n
                made[1] += secs
        finally:
            backend.close()
        rate = made[0] / max(made[1], 1e-9)
        if made[0] and world > 1:
            print(f"regen: rank {rank} generated {made[0]:,} answer tokens in {made[1]:.1f} s ({rate:,.0f} tok/s)",
                  file=sys.stderr, flush=True)
        dist_barrier()  # every rank's shards written
        if rank != 0:  # rank 0 reads every shard for the report; the others need not read them again
            return {"rank": rank, "world_size": world, "report": str(d / "report.json")}
        report = validation_report(d)
        if not report["records"]:  # nothing to train on: not a finished stage, and a rerun asks again
            raise failure_error(d, folder_failures(d), ident["backend"], report["planned"])
        made_words = ""
        if made[0] and world == 1:  # what this call generated (a resumed run generates only what was left)
            report["this_call"] = {"generated_tokens": made[0], "seconds": round(made[1], 2),
                                   "tokens_per_s": round(rate, 1)}
            rows = engine_rows(backend)
            if rows:  # the sequences the embedded engine decoded together (regen.batch_size, or its choice)
                report["this_call"]["rows"] = rows
            report["tokens_per_s"] = report["this_call"]["tokens_per_s"]
            made_words = (f"; this call generated {made[0]:,} answer tokens in {made[1]:.1f} s "
                          f"({report['tokens_per_s']:,.0f} tok/s" + (f", {rows} rows at a time" if rows else "") + ")")
        atomic_write_json(d / "report.json", report)
        left = f"{report['errors_total']} left out ({left_out_words(report['errors'])}), " if report["errors"] else ""
        log(f"regen: {report['records']} conversations in {d} ({left}"
            f"{report['truncated_turns']} truncated turns, reasoning in "
            f"{report['reasoning_capture_rate']:.0%} of turns "
            f"({capture_words(report['reasoning_capture_by_turn'], 4)}), "
            f"{report['looping_answer_rate']:.0%} of answers looping)"
            + made_words)
        return report
    finally:
        if own_pg:
            import torch.distributed as dist

            dist.destroy_process_group()


def report_lines(r: dict) -> list[str]:
    """A regen report (`validation_report`) for people: what was made, what was left out and why, the answers."""
    def pct(x) -> str:
        return f"{x:.0%}" if isinstance(x, (int, float)) else "?"

    def stats(d) -> str:
        return (f"mean {d.get('mean')}, median {d.get('median')}, p90 {d.get('p90')}, max {d.get('max')}"
                if isinstance(d, dict) and d.get("count") else "none")

    st = r.get("settings") or {}
    gen = r.get("generator") or {}
    left = left_out_words(r.get("errors") or {})
    lines = [
        f"regenerated data in {r.get('dir')}: {r.get('records')} of {r.get('planned')} planned conversations, "
        f"{r.get('shards_done')} of {r.get('shards_total')} shards done"
        + ("" if r.get("complete") else " (unfinished: run the same regen again to resume)")
        + (f", {r.get('samples')} samples per conversation" if (r.get("samples") or 1) > 1 else ""),
        f"left out: {r.get('errors_total', 0)}" + (f" ({left})" if left else ""),
        f"answers: {r.get('assistant_turns')}, {r.get('truncated_turns')} cut at max_new_tokens "
        f"({st.get('max_new_tokens', '?')}), {r.get('empty_answers')} empty, {r.get('looping_answers')} looping "
        f"({pct(r.get('looping_answer_rate'))}), reasoning in {pct(r.get('reasoning_capture_rate'))}",
        f"reasoning by answer turn: {capture_words(r.get('reasoning_capture_by_turn'))}",
        f"answer tokens: {stats(r.get('completion_tokens'))}",
        f"prompt tokens: {stats(r.get('prompt_tokens'))}",
        "sampled with " + ", ".join(f"{k} {v}" for k, v in st.items()),
        f"generator: {gen.get('backend', '?')}, {gen.get('model', '?')}",
    ]
    if r.get("duplicates"):
        lines.append(f"duplicates: {r['duplicates']} records written twice")
    if r.get("retries"):
        lines.append("retries: " + ", ".join(f"{k} {v}" for k, v in sorted(r["retries"].items())))
    return lines


def _drive(backend, convs: list[Conversation], plan: dict, d: Path, rc: RegenConfig, settings: dict,
           ident: dict, rank: int = 0, world: int = 1, sample: int | str = 1, samples: int = 1) -> None:
    size = plan["shard_size"]
    n_shards = math.ceil(len(convs) / size)
    mine = [k for k in range(n_shards) if k % world == rank]
    todo = [k for k in mine if not shard_path(d, k, sample).exists()]
    for k in set(mine) - set(todo):  # a kill between a shard's write and its journal's removal
        journal_path(d, k, sample).unlink(missing_ok=True)
    later = sample == LATER
    of = "later turns: " if later else f"sample {sample} of {samples}: " if samples > 1 else ""
    def span(k: int) -> range:  # the plan's conversations in shard k
        return range(k * size, min(len(convs), (k + 1) * size))

    work = [(k, i) for k in todo for i in span(k)]
    backend_meta = {k: v for k, v in ident.items() if k != "endpoints"}
    if world > 1:  # every process says what it takes (log() speaks for rank 0 only)
        print(f"regen: {of}rank {rank} of {world} regenerates {len(todo)} of its {len(mine)} shards "
              f"({len(work)} conversations)", file=sys.stderr, flush=True)
    if not work:
        return 0, 0.0
    if sample != 1 and hasattr(backend, "reseed"):  # (a server gets each request's own seed, from its record id)
        backend.reseed((rc.seed * 1_000_003 + (stable_hash(LATER) if later else sample)) % (1 << 31))
    if len(todo) < len(mine):
        log(f"regen: {of}resuming, {len(mine) - len(todo)} of {len(mine)} shards already done"
            + (f" (rank {rank} of {world})" if world > 1 else ""))
    # each unfinished shard's outcomes so far (index -> outcome), read back from its journal
    done_by_shard = {k: _read_journal(journal_path(d, k, sample), convs, span(k)) for k in todo}
    kept = sum(len(v) for v in done_by_shard.values())
    if kept:
        log(f"regen: {of}{kept} finished conversations of unfinished shards read back from their journals"
            + (f" (rank {rank} of {world})" if world > 1 else ""))
    work = [(k, i) for k, i in work if i not in done_by_shard[k]]
    active: dict[str, ConvState] = {}
    outcomes = CallOutcomes()  # this call's failures in a row: a server failing request after request stops it
    nxt = 0
    t0, toks = time.time(), 0
    bar = progress(total=len(work) + kept, initial=kept,
                   desc="regen" + (" later turns" if later else f" sample {sample}/{samples}" if samples > 1 else "")
                   + (f" rank {rank}" if world > 1 else ""), unit="conv",
                   **({} if rank == 0 else {"disable": True}))

    def shard_done(k: int) -> None:
        if len(done_by_shard[k]) == len(span(k)):
            _write_shard(d, k, [done_by_shard[k][i] for i in sorted(done_by_shard[k])], sample)
            journal_path(d, k, sample).unlink(missing_ok=True)
            del done_by_shard[k]

    def finish(st: ConvState) -> None:
        k = st.index // size
        o = _outcome(st, settings, backend_meta)
        with open(journal_path(d, k, sample), "a", encoding="utf-8") as f:
            f.write(json.dumps(o, ensure_ascii=False) + "\n")
        done_by_shard[k][st.index] = o
        bar.update(1)
        shard_done(k)
        outcomes.add(o)
        if outcomes.hopeless() and ident["backend"] == "server":
            raise failure_error(d, outcomes, ident["backend"])

    def ask(st: ConvState) -> None:
        msgs = st.next_messages()
        if msgs is None:
            finish(st)
            return
        rid = f"{st.index}:{st.n_answers}"
        active[rid] = st
        seed = (rc.seed * 1_000_003 + stable_hash(f"{st.conv.id}:{st.n_answers}")) % (1 << 31)
        backend.submit(rid, msgs, seed)

    try:
        for k in list(done_by_shard):  # a kill between a journal's last line and its shard
            shard_done(k)
        while nxt < len(work) or active:
            while nxt < len(work) and len(active) < backend.window:
                _, i = work[nxt]
                nxt += 1
                # the later turns: every answer after the first, each asked with the source's history before it
                ask(ConvState(i, convs[i], history="original", keep=1) if later else ConvState(i, convs[i], rc.turns))
            for r in backend.poll(timeout=0.5):
                st = active.pop(r.rid, None)
                if st is None:
                    continue
                if r.fatal:
                    raise EyasError(f"{ident['backend']} backend: {r.message}. Finished shards are kept in {d}; "
                                    f"run the same command again to resume")
                st.accept(r)
                toks += r.completion_tokens
                ask(st)
            dt = max(time.time() - t0, 1e-6)
            bar.set_postfix_str(f"{toks / dt:,.0f} tok/s", refresh=False)
    finally:
        bar.close()
    return toks, time.time() - t0


def _outcome(st: ConvState, settings: dict, backend_meta: dict) -> dict:
    """What a finished conversation leaves in its shard: its record's line, or its entry in the errors file
    (`i` and `id` say which conversation of the plan it is)."""
    if st.error or st.n_answers == 0:
        if st.error:
            kind, msg = st.error
        elif st.stopped == "context":
            kind = "context"
            msg = (f"its first prompt ({(st.dropped or {}).get('prompt_tokens', '?')} tokens) leaves no room for an "
                   f"answer within the context (data.max_seq_len, or the model's own)")
        elif st.stopped == "empty_answer":
            kind, msg = "empty_answer", "the target's first answer was empty"
        else:
            kind, msg = "no_answer", "no assistant turn could be generated"
        return {"i": st.index, "id": st.conv.id,
                "error": {"id": st.conv.id, "kind": kind, "message": msg,
                          "retries": dict(sum((Counter(t.get("retries", {})) for t in st.turn_meta),
                                              Counter(getattr(st, "failed_retries", {}))))}}
    return {"i": st.index, "id": st.conv.id, "line": json.dumps(st.record(settings, backend_meta), ensure_ascii=False)}


def _read_journal(path: Path, convs: list[Conversation], span: range) -> dict[int, dict]:
    """The outcomes a shard's journal holds for its conversations `span` of the plan. A line cut short by a kill
    (or not this plan's) is left out, and the journal rewritten without it, so that lines appended later are
    whole."""
    if not path.exists():
        return {}
    got: dict[int, dict] = {}
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for line in lines:
        try:
            o = json.loads(line)
        except ValueError:
            continue
        i = o.get("i") if isinstance(o, dict) else None
        if (isinstance(i, int) and i in span and o.get("id") == convs[i].id
                and isinstance(o.get("line") or o.get("error"), (str, dict))):
            got[i] = o
    if len(got) != len(lines):
        atomic_write_text(path, "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in got.values()))
    return got


def _write_shard(d: Path, k: int, outcomes: list[dict], sample: int | str = 1) -> None:
    errors = [o["error"] for o in outcomes if "error" in o]
    lines = [o["line"] for o in outcomes if "error" not in o]
    # errors first: a shard file present means its errors file is complete too
    atomic_write_json(errors_path(d, k, sample), {"shard": k, "errors": errors})
    atomic_write_text(shard_path(d, k, sample), "".join(line + "\n" for line in lines))


# --------------------------------------------------------------------------- validation report


def _stats(xs: list[int]) -> dict:
    if not xs:
        return {"count": 0}
    xs = sorted(xs)
    return {"count": len(xs), "total": sum(xs), "mean": round(statistics.fmean(xs), 1), "median": xs[len(xs) // 2],
            "p90": xs[min(len(xs) - 1, int(len(xs) * 0.9))], "max": xs[-1]}


# an answer "loops" when at least LOOP_SHARE of its word LOOP_NGRAM-grams occurred earlier in it. A small target's own
# answers loop often (SmolLM2's: a fifth of its first answers' tokens, a third to a half of its later ones', against
# about 1% of ShareGPT's original answers), and a drafter learns little from loops, so the report counts them
LOOP_NGRAM, LOOP_SHARE = 6, 0.5


def _planned_shards(plans: list[dict]) -> int:
    return sum(math.ceil(len(p["ids"]) / p["shard_size"]) for p in plans)


def shard_progress(d: Path) -> tuple[int, int] | None:
    """(shards written, shards planned) over every set of answers in regen folder d, from the file names and plans
    alone (validation_report reads the shards too); None where d has no plan (shards copied in by hand) or one that
    does not say its conversations and shard size."""
    plans = [read_json(f) for f in sorted(d.glob("plan*.json"))] if (d / "plan.json").exists() else []
    if not plans or not all(isinstance(p, dict) and isinstance(p.get("ids"), list)
                            and isinstance(p.get("shard_size"), int) and p["shard_size"] > 0 for p in plans):
        return None
    return len(list(d.glob("shard-*.jsonl"))), _planned_shards(plans)


def validation_report(path: str | Path) -> dict:
    """What a regeneration produced: a run directory or its data/regen folder (or any folder of shards)."""
    p = Path(path)
    d = regen_dir(p) if (regen_dir(p)).is_dir() else p
    if not d.is_dir():
        raise EyasError(f"{p}: no regenerated data here (expected {regen_dir(p)} or a folder of shard-*.jsonl)")
    shards = sorted(d.glob("shard-*.jsonl"))  # every sample's
    plan = read_json(d / "plan.json") if (d / "plan.json").exists() else None
    plans = [plan] + [read_json(f) for f in sorted(d.glob("plan-s*.json"))] if plan else []
    later = read_json(plan_path(d, LATER)) if plan and plan_path(d, LATER).exists() else None
    records, bad_lines, turns, truncated, empty, with_reasoning, looping = 0, 0, 0, 0, 0, 0, 0
    errors: Counter = Counter()
    retries: Counter = Counter()
    stopped: Counter = Counter()
    prompt_toks, completion_toks, turns_per, thought = [], [], [], []  # thought: each record's answers with reasoning
    ids: list[str] = []
    for f in shards:
        for lineno, line in enumerate(text_lines(f.read_text(encoding="utf-8")), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                conv = Conversation.from_dict(rec)
            except (ValueError, KeyError, TypeError):
                bad_lines += 1
                continue
            records += 1
            ids.append(conv.id)
            meta = conv.meta or {}
            tmeta = meta.get("turns", [])
            # the target's answers (a later-turns record starts with answers kept as the data set has them)
            answers = [t for t in conv.turns if t.role == "assistant"][int(meta.get("source_answers_kept", 0)):]
            turns += len(answers)
            turns_per.append(len(answers))
            thought.append([bool(t.reasoning) for t in answers])
            for t in answers:
                with_reasoning += bool(t.reasoning)
                empty += not t.content.strip()
                looping += repeated_share(t.content.split(), LOOP_NGRAM) >= LOOP_SHARE
            for tm in tmeta:
                truncated += tm.get("finish_reason") == "length"
                prompt_toks.append(int(tm.get("prompt_tokens", 0)))
                completion_toks.append(int(tm.get("completion_tokens", 0)))
                retries.update(tm.get("retries", {}))
            if meta.get("stopped"):
                stopped[meta["stopped"]] += 1
                empty += meta["stopped"] == "empty_answer"
        ef = f.with_name(f.name.removesuffix(".jsonl") + ".errors.json")
        if ef.exists():
            for e in read_json(ef).get("errors", []):
                errors[e.get("kind", "unknown")] += 1
                retries.update(e.get("retries", {}))
                empty += e.get("kind") == "empty_answer"
    if bad_lines:
        errors["unreadable_record"] += bad_lines
    samples = len(plans) or None
    plans += [later] if later else []
    planned = sum(len(p["ids"]) for p in plans) if plans else None
    n_shards = _planned_shards(plans) if plans else len(shards)
    dup = len(ids) - len(set(ids))
    return {
        "dir": str(d), "planned": planned, "records": records, "shards_done": len(shards), "shards_total": n_shards,
        "complete": len(shards) == n_shards, "duplicates": dup,
        "errors": dict(errors), "errors_total": sum(errors.values()), "retries": dict(retries),
        "assistant_turns": turns, "truncated_turns": truncated, "empty_answers": empty,
        "stopped_early": dict(stopped), "turns_with_reasoning": with_reasoning,
        "reasoning_capture_rate": (with_reasoning / turns) if turns else 0.0,
        "reasoning_capture_by_turn": capture_by_turn(thought),
        "looping_answers": looping, "looping_answer_rate": (looping / turns) if turns else 0.0,
        "turns_per_conversation": _stats(turns_per), "prompt_tokens": _stats(prompt_toks),
        "completion_tokens": _stats(completion_toks),
        "settings": plan.get("settings") if plan else None, "generator": plan.get("generator") if plan else None,
        "samples": samples, **({"later_turns": len(later["ids"])} if later else {}),
    }
