"""Speculative decoding engine: an EAGLE-3 drafter proposes K tokens, the target verifies them in one pass.

One round, with L tokens committed (the target has processed positions 0..L-2, the last token
x[L-1] is not yet in its cache; the drafter's cache holds positions 0..L-2 and its last output,
at position L-2, predicts token L):

    draft   d1 from the drafter's last output; d2..dK from K-1 one-token drafter steps that feed
            back the drafter's own prenorm hidden state (positions L-1 .. L+K-3)
    verify  target forward over [x[L-1], d1..dK] at positions L-1..L-1+K (one pass, K+1 logits,
            aux states via pre-hooks); accept the longest prefix (greedy: d_i == argmax; sampling:
            the standard rejection rule), then one target token (correction or bonus)
    commit  one host sync (`.tolist()`), roll the target cache's length pointer back to the
            committed length, and rebuild the drafter's cache for the new positions from the
            target's aux states (fixed shape K+1; entries past the committed length are stale,
            are masked by position, and are overwritten before anything attends to them)

Greedy verification is exactly lossless (the output equals plain greedy decoding); rejection
sampling is lossless in distribution. `Decoder.generate(..., speculative=False)` is plain decoding
on the same caches and code path, the baseline for speedups. Batch size 1.

The target runs on eyas' own static-cache forward (`eyas.engine.fastlm`) where it supports the
architecture (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE: fastlm.supported), else on transformers
with its StaticCache (logged once, with the reason). On CUDA, the fixed-shape steps (verify,
drafter step, plain decode step) are captured as CUDA graphs on first use; the first replays of
each are checked against an eager run and any difference or failure turns graphs off for the rest
of the run (logged), so a graph can cost speed, never correctness.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .draft import check_fits
from .engine.fastlm import attended_slots, fast_engine_runs, one_off_kernels, supported
from .engine.graphs import StepGraphs
from .engine.runners import FastTargetRunner, TargetRunner
from .engine.sampling import probs_from_logits, sample
from .util import EyasError, PhaseClock


# ---------------------------------------------------------------------------------------------
# token choice and verification rules (pure functions over a leading batch dimension)

def verify_greedy(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits [B, K+1, V], drafts [B, K] -> (accepted [B], next token [B]).
    Accept while each draft equals the target's argmax; then emit the target's argmax there."""
    g = target_logits.argmax(-1)  # [B, K+1]
    ok = (drafts == g[:, :-1]).long()
    a = ok.cumprod(-1).sum(-1)
    return a, g.gather(1, a[:, None])[:, 0]


def verify_sample(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling rule. p [B, K+1, V]: target probabilities at the K+1 verified
    positions; q [B, K, V]: the drafter's probabilities each draft was sampled from (over the target
    vocabulary); drafts [B, K]. Draft i is accepted with probability min(1, p_i(d)/q_i(d)); at the
    first rejection the token is drawn from normalise(max(p_i - q_i, 0)); if all K are accepted a
    bonus token is drawn from p_K. Returns (accepted [B], next token [B]); no host sync."""
    B, K = drafts.shape
    pd = p[:, :K].gather(-1, drafts[..., None])[..., 0]
    qd = q.gather(-1, drafts[..., None])[..., 0]
    u = torch.rand(B, K, device=p.device, generator=generator)
    ok = (u * qd < pd).long()  # u < p/q, with q > 0 for a token sampled from q
    a = ok.cumprod(-1).sum(-1)  # [B]
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # position K: residual = p itself
    rows = torch.arange(B, device=p.device)
    pa, qa = p[rows, a], q_pad[rows, a]
    r = (pa - qa).clamp_min(0)
    r = torch.where(r.sum(-1, keepdim=True) > 0, r, pa)  # p == q exactly: residual is empty
    return a, sample(r, generator)


# ---------------------------------------------------------------------------------------------
# caches

class DraftCache:
    """A preallocated KV cache for one of the drafter's attention layers. Keys/values are written at
    absolute positions; a query at position p attends to slots 0..p, so a rollback needs no work:
    stale slots past the committed length are rewritten before any query can see them."""

    def __init__(self, drafter, max_len: int, device, dtype):
        c = drafter.config
        shape = (1, c.num_key_value_heads, max_len, c.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.slots = torch.arange(max_len, device=device)
        self.max_len = max_len
        self.pos: torch.Tensor | None = None  # [T] positions of the current call
        self.upto = max_len  # host-known bound on the slots the current call may attend to
        self.gqa = c.num_attention_heads != c.num_key_value_heads

    def attend(self, q, k, v):
        pos = self.pos
        self.k.index_copy_(2, pos, k.to(self.k.dtype))
        self.v.index_copy_(2, pos, v.to(self.v.dtype))
        n = self.upto
        mask = self.slots[None, :n] <= pos[:, None]  # [T, n]
        return F.scaled_dot_product_attention(q, self.k[:, :, :n].to(q.dtype), self.v[:, :, :n].to(q.dtype),
                                              attn_mask=mask, enable_gqa=self.gqa)


# ---------------------------------------------------------------------------------------------
# the engine

@dataclass
class Generation:
    tokens: list[int]                                   # new tokens (stop token included if hit)
    accepted: list[int] = field(default_factory=list)   # accepted drafts per verify round
    target_forwards: int = 0                            # verify (or plain decode) passes, prefill excluded
    prompt_tokens: int = 0
    seconds: float = 0.0                                # wall time including prefill, device-synced
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0                        # the target's (and the drafter's) prompt prefill
    stopped: bool = False                               # ended on a stop token

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per target forward (verify rounds only)."""
        return (sum(self.accepted) + len(self.accepted)) / max(1, len(self.accepted))


def _emitted(packed: list[int]) -> tuple[int, list[int]]:
    """A round's [accepted count, K drafts..., next token] -> (accepted count, the tokens it emits)."""
    na = packed[0]
    return na, packed[1:1 + na] + [packed[-1]]


def _commit(out: list[int], new: list[int], stop: set, max_new: int) -> bool:
    """Append a step's or round's tokens to `out` up to the first stop token or the max_new-th token;
    True when the generation ends there."""
    for t in new:
        out.append(t)
        if t in stop or len(out) >= max_new:
            return True
    return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Run:
    """One generate call under way, from Decoder._begin to Decoder._finish."""
    gen: Generation      # gen.tokens: the tokens made so far
    stop: set            # stop token ids
    clock: PhaseClock    # draft / verify / prefill times
    t_start: float = 0.0  # wall-clock start, after a device sync


class Decoder:
    """Speculative (and plain) decoding of one sequence at a time with a target and an EAGLE-3 drafter.

    target: eyas Target (any transformers causal LM); drafter: Eagle3Drafter or None (plain only).
    The drafter is moved to the target's device and dtype. temperature 0 = greedy verification.
    max_len bounds prompt + new tokens + K + 1 (caches are allocated once, here). fuse_drafter: the drafter's
    projections fused and its rope from a table (Eagle3Drafter.fuse), fewer kernels per drafter step; False
    runs it unfused, to compare."""
    # queue the next plain step or fused round before reading the last one's tokens (Decoder._pipelined):
    # None = on a GPU only (on a CPU the work is synchronous, so it would only add a dropped step at the end)
    overlap: bool | None = None
    # the target's steps and verify passes with FastLM.compile_elementwise (rope, add+norm, silu*mul compiled).
    # None = on a GPU only, where fewer kernels make each step and round markedly shorter (bench/bench_decode.py
    # --ew 0,1 compares); on a CPU, compiling costs seconds a shape for little gain
    compile_elementwise: bool | None = None
    # with compile_elementwise, the norms compiled only where they round a verify's rows as one-token steps do
    # (FastLM.settle_norms); False compiles them regardless (bench/bench_decode.py --norms 0,1 compares)
    settle_norms: bool = True
    # the prompt's prefill as a fixed-shape step (greedy, eyas' forward): the prompt right-padded to a multiple of
    # PREFILL_BUCKET tokens, so under CUDA graphs one graph per padded length replaces the eager prefill's hundreds
    # of kernel launches from Python. None = where CUDA graphs are on; True also pads without graphs (tests)
    graph_prefill: bool | None = None
    PREFILL_BUCKET = 128
    # the drafter's draft steps and a fused round's catch-up as two torch.compile'd parts each, around the attention
    # (Eagle3Drafter.forward with `_eyas_compiled`): about half the kernels of an eager drafter step. Draft tokens
    # can round differently; verification is the target's, so the output stays lossless. None = on a GPU, where
    # it decodes a few percent faster at every K with τ unchanged (bench/bench_decode.py --draft-compile 0,1
    # compares); on a CPU, compiling costs seconds for little gain
    compile_drafter: bool | None = None
    # plain decoding's steps shaped as a round's verify: K+1 tokens at once for a chain, a tree's N (the last token
    # repeated), the first row's logits picking the next token, over the slots a verify at that position attends.
    # Then every product, norm and attention call runs with the verify's shapes, so a kernel whose rounding depends
    # on the row count (a GEMM's split of a long row, a compiled reduction's blocking) rounds plain decoding as it
    # rounds the verify, and greedy speculative decoding must give plain decoding's tokens bit for bit. The eval's
    # lossless check reruns an answer that parts from plain decoding this way, to tell rounding at a near-tie from a
    # wrong token. Off for timing: a one-token step is what plain decoding costs
    plain_like_verify: bool = False

    def __init__(self, target, drafter=None, k: int = 3, temperature: float = 0.0, top_p: float = 1.0,
                 max_len: int = 2048, compile: bool = False, seed: int = 0, engine: str = "auto",
                 fused: bool | None = None, fuse_drafter: bool = True):
        if k < 1:
            raise EyasError(f"eval.k must be at least 1, got {k}")
        if temperature < 0:
            raise EyasError(f"eval.temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise EyasError(f"eval.top_p must be in (0, 1], got {top_p}")
        self.target = target
        self.device = target.device
        self.dtype = target.dtype
        self.k = k
        self.temperature = temperature
        self.top_p = top_p
        self.max_len = max_len
        if engine not in ("auto", "fast", "hf"):
            raise EyasError(f"decoder engine must be auto, fast or hf, got {engine!r}")
        ok, why = supported(target.model)
        if engine == "fast" and not ok:
            raise EyasError(f"the fast decoder cannot run this target: {why}")
        if engine == "auto":
            fast_engine_runs(target.model, "decoder")  # logs the fallback and why
        self.engine = "fast" if ok and engine != "hf" else "hf"
        self.runner = FastTargetRunner(target, max_len) if self.engine == "fast" else TargetRunner(target, max_len)
        if self.engine == "fast":
            self.runner.lm.compile_elementwise = self.elementwise_compiled
        # greedy rounds on eyas' own forward as one step (drafts, verify, acceptance, drafter rebuild): one
        # CUDA graph and no host work between its parts; its time is reported as verify time.
        # None: on a GPU only (eval.round=auto; on a CPU the stepwise round is faster)
        self.fused = self._on_gpu_unless_set(fused) and temperature == 0 and self.engine == "fast"
        self.drafter = None
        if drafter is not None:
            check_fits(drafter.config, target, "given to the decoder")
            self.drafter = drafter.to(device=self.device, dtype=self.dtype).eval()
            if fuse_drafter:
                self.drafter.fuse(max_len)
            else:
                self.drafter.unfuse()
            # one cache per drafter decoder layer
            self.dcaches = [DraftCache(self.drafter, max_len, self.device, self.dtype)
                            for _ in range(self.drafter.config.num_hidden_layers)]
            self._dattends = [dc.attend for dc in self.dcaches]  # what the drafter calls, layer by layer
            self.drafter.__dict__["_eyas_compiled"] = self.drafter_compiled
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        # CUDA graphs need a capture-safe target forward: eyas' own, not transformers' StaticCache
        self.graphs = StepGraphs(self.device, enabled=bool(compile) and self.engine == "fast")

    def _call(self, name: str, *args, upto: int):
        """Run a fixed-shape step: "draft" (drafter over ids, hidden, pos) or "verify" (target over
        ids, pos), attending to `upto` cache slots; under CUDA graphs, one graph per (step, shapes, upto)."""
        fn = {"draft": self._drafter_fwd, "verify": self._target_fwd, "round": self._round_fwd,
              "prefill": self._prefill_fwd, "prefill_spec": self._prefill_spec_fwd}[name]
        if self.graphs.enabled:
            return self.graphs.run(f"{name}@{upto}", lambda *a: fn(*a, upto=upto), *args)
        return fn(*args, upto=upto)

    # -- pieces ----------------------------------------------------------------------------------
    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Target token from logits [..., V]."""
        if self.temperature == 0:
            return logits.argmax(-1)
        return sample(probs_from_logits(logits, self.temperature, self.top_p), self.generator)

    def _pos(self, start: int, T: int) -> torch.Tensor:
        return torch.arange(start, start + T, device=self.device)

    def _drafter_fwd(self, ids, hidden, pos: torch.Tensor, upto: int):
        """Drafter over ids [1, T] at positions pos [T], attending to cache slots < upto."""
        for dc in self.dcaches:
            dc.pos, dc.upto = pos, upto
        return self.drafter(ids, hidden.to(self.dtype), pos[None], attend=self._dattends, rope_table=True)

    def _upto(self, end: int) -> int:
        """Cache slots a call whose positions end before `end` attends to (fastlm.attended_slots)."""
        return attended_slots(end, self.max_len)

    def _target_fwd(self, ids, pos, upto: int):
        return self.runner.forward(ids, pos, upto=upto)

    def _prefill_target(self, ids, last, upto: int, want_aux: bool):
        """The target over a right-padded prompt ids [1, Tp] at positions 0.., its last real token at index last
        [1] -> (the first new token [1] (greedy), aux [1, Tp, 3H] or None). The padding writes cache slots past the
        prompt, which the generation overwrites before anything attends to them (each query sees slots up to its
        own position); its outputs are dropped."""
        logits, aux = self.runner.lm.forward(ids, torch.zeros(1, dtype=torch.long, device=ids.device), last_idx=last,
                                             want_aux=want_aux, upto=upto, one_off=True)
        return logits[:, 0].argmax(-1), aux

    def _prefill_fwd(self, ids, last, upto: int):
        """The plain decoder's padded prefill (_prefill_target) -> (first [1],)."""
        return self._prefill_target(ids, last, upto, False)[:1]

    def _prefill_spec_fwd(self, ids, last, upto: int):
        """The padded prefill (_prefill_target), then the drafter's (_drafter_prefill) -> (first [1], the drafter's
        hidden state [1, 1, H] and logits [1, Vd] at index last)."""
        first, aux = self._prefill_target(ids, last, upto, True)
        return (first, *self._drafter_prefill(ids, first, aux, last, upto))

    def _drafter_prefill(self, ids, first, aux, last, upto: int):
        """The drafter over a prompt ids [1, T] (padded or not) at positions 0.., fed each next token (the first new
        one [1] at index last [1], the prompt's last token) and the target's aux states [1, T, 3H] -> (its hidden
        state [1, 1, H] and logits [1, Vd] at index last). A shape seen once unless padded, so attention without
        per-shape plans (as the target's prefill)."""
        feed = torch.cat([ids[:, 1:], ids[:, :1]], 1).scatter(1, last.view(1, 1), first.view(1, 1))
        with one_off_kernels(self.device):
            h, dl = self._drafter_fwd(feed, aux, torch.arange(ids.shape[1], device=ids.device), upto)
        at = last.view(1, 1, 1)
        return h.gather(1, at.expand(1, 1, h.shape[-1])), dl.gather(1, at.expand(1, 1, dl.shape[-1]))[:, 0]

    @property
    def prefill_padded(self) -> bool:
        """Whether prompts are prefilled right-padded to a multiple of PREFILL_BUCKET tokens, as fixed-shape steps
        (Decoder.graph_prefill; None: where CUDA graphs are on). Greedy decoding on eyas' forward only."""
        on = self.graphs.enabled if self.graph_prefill is None else bool(self.graph_prefill)
        return on and self.engine == "fast" and self.temperature == 0

    def _prefill_len(self, n: int) -> int | None:
        """The padded length of an n-token prompt's prefill, or None for an unpadded one."""
        if not self.prefill_padded:
            return None
        tp = -(-n // self.PREFILL_BUCKET) * self.PREFILL_BUCKET
        return tp if tp <= self.max_len else None

    def _prefill(self, ids, speculative: bool):
        """The prompt ids [1, n] into the target's cache (and the drafter's) -> (the first new token [1]; with
        `speculative`, the drafter's hidden state [1, 1, H] and logits [1, Vd] after it, else None, None)."""
        n = ids.shape[1]
        tp = self._prefill_len(n)
        last = torch.full((1,), n - 1, dtype=torch.long, device=self.device)
        if tp is not None:  # one fixed-shape step (a CUDA graph per padded length)
            padded = torch.zeros(1, tp, dtype=torch.long, device=self.device)
            padded[:, :n] = ids
            res = self._call("prefill_spec" if speculative else "prefill", padded, last, upto=self._upto(tp))
            return (res[0], res[1], res[2]) if speculative else (res[0], None, None)
        logits, aux = self.runner.forward(ids, self._pos(0, n), last_only=True, upto=self._upto(n), one_off=True)
        first = self._pick(logits[:, -1])  # [1]
        if not speculative:
            return first, None, None
        return (first, *self._drafter_prefill(ids, first, aux, last, self._upto(n)))

    def _propose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft-vocab logits [1, Vd] -> (target token id [1], q over the target vocab [1, V] or None)."""
        d2t = self.drafter.d2t
        if self.temperature == 0:
            i = logits.argmax(-1)
            return i + d2t[i], None
        qd = probs_from_logits(logits, self.temperature, self.top_p)
        i = sample(qd, self.generator)
        q = torch.zeros(qd.shape[0], self.target.vocab_size, device=self.device, dtype=qd.dtype)
        q.index_copy_(1, self.drafter.draft_ids, qd)
        return i + d2t[i], q

    def _chain(self, h_last: torch.Tensor, logits_last: torch.Tensor, step):
        """K drafts from the drafter's last output; `step(j, token [1], h)` runs drafter step j and
        returns its (hidden, logits). -> (drafts [1, K], q [1, K, V] or None)."""
        toks, qs = [], []
        t, q = self._propose(logits_last)
        toks.append(t)
        qs.append(q)
        h = h_last
        for j in range(1, self.k):
            h, lg = step(j, t, h)
            h, lg = h[:, -1:], lg[:, -1]
            t, q = self._propose(lg)
            toks.append(t)
            qs.append(q)
        drafts = torch.stack(toks, 1)
        return drafts, (torch.stack(qs, 1) if qs[0] is not None else None)

    def draft(self, h_last: torch.Tensor, logits_last: torch.Tensor, L: int):
        """K drafts from the drafter's last output (at position L-2), each drafter step a fixed-shape
        call attending to the slots it needs -> (drafts [1, K], q [1, K, V] or None)."""
        return self._chain(h_last, logits_last, lambda j, t, h: self._call(
            "draft", t[:, None], h, self._pos(L - 2 + j, 1), upto=self._upto(L - 1 + j)))

    def verify(self, last_tok: torch.Tensor, drafts: torch.Tensor, q, L: int):
        """-> (accepted [1], next [1], aux [1, K+1, 3H])."""
        ids = torch.cat([last_tok.view(1, 1), drafts], dim=1)
        logits, aux = self._call("verify", ids, self._pos(L - 1, ids.shape[1]), upto=self._upto(L + ids.shape[1]))
        if self.temperature == 0:
            a, nxt = verify_greedy(logits, drafts)
        else:
            p = probs_from_logits(logits, self.temperature, self.top_p)
            a, nxt = verify_sample(p, q, drafts, self.generator)
        return a, nxt, aux

    def _draft_chain(self, h_last, logits_last, pos0, upto: int):
        """The fused round's K greedy drafts [1, K], from position pos0 [1] (= L-1) as a tensor, every
        drafter step attending to `upto` slots (a superset of what each needs: the cache masks by position)."""
        return self._chain(h_last, logits_last,
                           lambda j, t, h: self._drafter_fwd(t[:, None], h, pos0 + (j - 1), upto))[0]

    def _round_fwd(self, last, h_last, logits_last, pos0, upto: int):
        """One greedy round with no host sync, from the last emitted token [1] at position pos0 [1]
        (= L-1): K drafts, the target's verify pass over K+1 tokens, acceptance, and the drafter rerun
        on the target's aux states. -> (packed [K+2] = accepted count, the K drafts, the next token;
        the drafter's hidden state [1, 1, H] and logits [1, Vd] at the last accepted position; the next
        round's pos0 [1]): everything the next round needs stays on the device."""
        drafts = self._draft_chain(h_last, logits_last, pos0, upto)
        ar = torch.arange(self.k + 1, device=drafts.device)
        logits, aux = self._target_fwd(torch.cat([last.view(1, 1), drafts], 1), pos0 + ar, upto)
        a, nxt = verify_greedy(logits, drafts)
        feed = torch.cat([drafts, nxt.view(1, 1)], 1)
        feed = torch.where(ar[None] == a.view(1, 1), nxt.view(1, 1), feed)
        h, dl = self._drafter_fwd(feed, aux, pos0 + ar, upto)
        h_last = h.gather(1, a.view(1, 1, 1).expand(1, 1, h.shape[-1]))
        logits_last = dl.gather(1, a.view(1, 1, 1).expand(1, 1, dl.shape[-1]))[:, 0]
        return torch.cat([a, drafts[0], nxt]), h_last, logits_last, pos0 + a + 1

    # -- generation ------------------------------------------------------------------------------
    def _on_gpu_unless_set(self, value: bool | None) -> bool:
        """A setting whose None means: on where the decoder runs on a GPU."""
        return bool(value) if value is not None else self.device.type == "cuda"

    @property
    def elementwise_compiled(self) -> bool:
        """Whether the target's elementwise work runs as compiled kernels (Decoder.compile_elementwise; None: on a
        GPU, with eyas' own forward)."""
        return self.engine == "fast" and self._on_gpu_unless_set(self.compile_elementwise)

    @property
    def drafter_compiled(self) -> bool:
        """Whether the drafter's steps run as compiled parts (Decoder.compile_drafter; None: on a GPU, with eyas'
        own forward)."""
        return self.engine == "fast" and self._on_gpu_unless_set(self.compile_drafter)

    @property
    def overlapped(self) -> bool:
        """Whether plain steps and fused rounds are queued ahead of the host's reads (Decoder.overlap; None: on a GPU)."""
        return self._on_gpu_unless_set(self.overlap)

    def _launch(self, state, speculative: bool, bound: int):
        """Queue one plain step or fused greedy round on the device, with no host sync. state: plain
        (last token [1], its position as an int); speculative (last token [1], drafter hidden [1, 1, H],
        drafter logits [1, Vd], pos0 [1]). bound: the committed length L, or a bound on it when rounds
        before this one are not read yet. -> (the next state, the device tensor the host reads: the
        round's packed [K+2] or the step's token [1])."""
        if speculative:
            last, h, lg, pos = state
            packed, h, lg, pos = self._call("round", last, h, lg, pos, upto=self._upto(self._verify_end(bound - 1)))
            return (packed[-1:], h, lg, pos), packed
        last, p = state  # a plain step adds one token: its position is known on the host
        # with the verify's shapes, the verify's span; the rows past the first write slots the next step overwrites
        logits, _ = self._call("verify", *self._plain_step(last, p),
                               upto=self._upto(self._verify_end(p) if self.plain_like_verify else p + 1))
        nxt = self._pick(logits[:, 0]).view(1)
        return (nxt, p + 1), nxt

    def _plain_step(self, tok: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A plain step's ids and positions from token tok [1] at position p: the one token, or with
        plain_like_verify the verify's tokens (the token repeated; the first row's logits pick the next token)."""
        T = self.verify_tokens if self.plain_like_verify else 1
        return tok.view(1, 1).expand(1, T).contiguous(), self._pos(p, T)

    @property
    def verify_tokens(self) -> int:
        """Tokens in a round's verify call: the last token and the K drafts."""
        return self.k + 1

    def _verify_end(self, p: int) -> int:
        """The end of the slots a round from the token at position p attends to: the verify's, the drafter's rerun's
        (the round's span; plain decoding with plain_like_verify attends the same)."""
        return p + self.k + 2

    @property
    def round_slots(self) -> int:
        """Cache slots past the committed length a round may write (the fit check of generate and _pipelined)."""
        return self.k + 1

    def _to_host(self, t: torch.Tensor):
        """Start copying t to the host without waiting: (host tensor, event to wait on, or None on a CPU)."""
        if self.device.type != "cuda":
            return t, None
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return buf, ev

    def _pipelined(self, gen: Generation, out: list[int], L: int, state, speculative: bool, max_new: int,
                   stop: set, clock) -> None:
        """Plain steps or fused greedy rounds until a stop token or max_new tokens, each launched from the
        previous one's device outputs. With `overlap`, the next step is queued before the host reads the
        last one's tokens, so the host's reading, bookkeeping and next launch run while the GPU works
        (a step launched past the end is computed and dropped: it writes cache slots past the committed
        length, which are masked by position and overwritten before anything attends to them)."""
        ahead = self.overlapped
        grow = self.k + 1 if speculative else 1  # most tokens one launch can commit (a tree's k is its depth)
        pending = deque()
        # one verify span for the whole loop when overlapping: a launch's own span would also hold the wait for
        # the step queued before it
        t_loop = clock.start() if ahead else None
        while True:
            # launch until one step is queued beyond the one to read next (ahead), while the queued ones
            # might still leave tokens to make and the cache has room for the furthest they could reach
            while (not pending or ahead and len(pending) < 2 and len(out) + len(pending) < max_new
                   and L + grow * len(pending) + self.round_slots <= self.max_len):
                t0 = None if ahead else clock.start()
                state, res = self._launch(state, speculative, L + grow * len(pending))
                if t0 is not None:
                    clock.stop("verify", t0)
                pending.append(self._to_host(res))
            buf, ev = pending.popleft()
            if ev is not None:
                ev.synchronize()  # this step's result only: the one queued after it keeps the GPU busy
            vals = buf.tolist()
            if speculative:
                na, new = _emitted(vals)
                gen.accepted.append(na)
            else:
                new = vals
            gen.target_forwards += 1
            if _commit(out, new, stop, max_new):
                if t_loop is not None:
                    clock.stop("verify", t_loop)
                return
            L += len(new)

    def step_calls(self, plain: bool = True, speculative: bool = True) -> list[tuple]:
        """Every fixed-shape step a generation within max_len can make, as (name, args, upto): for each span of
        attended cache slots, the plain step, and the fused round or (sampling, stepwise rounds) the drafter
        step, the verify pass and the drafter rebuild; with padded prefills, the prefill of every padded length.
        Positions lie inside the span; the inputs are zeros."""
        if self.engine != "fast":
            return []
        dev, k = self.device, self.k
        speculative = speculative and self.drafter is not None
        tok = torch.zeros(1, dtype=torch.long, device=dev)
        if speculative:
            c = self.drafter.config
            h = torch.zeros(1, 1, c.hidden_size, device=dev, dtype=self.dtype)
            lg = torch.zeros(1, c.draft_vocab_size, device=dev, dtype=self.dtype)
            aux = torch.zeros(1, k + 1, len(c.aux_layers) * c.target_hidden_size, device=dev, dtype=self.dtype)
            ids = torch.zeros(1, k + 1, dtype=torch.long, device=dev)
        calls = []
        for u in sorted({self._upto(e) for e in range(1, self.max_len + 1)}):  # u <= max_len
            p = max(0, u - (k + 1))  # room for K + 1 positions below the span's end
            if plain:
                calls.append(("verify", self._plain_step(tok, p), u))
            if speculative and self.fused:
                calls.append(("round", (tok, h, lg, self._pos(p, 1)), u))
            elif speculative:
                calls += [("draft", (tok.view(1, 1), h, self._pos(p, 1)), u),
                          ("verify", (ids, self._pos(p, k + 1)), u),
                          ("draft", (ids, aux, self._pos(p, k + 1)), u)]
        if self.prefill_padded:  # every padded prompt length that fits
            for tp in range(self.PREFILL_BUCKET, self.max_len + 1, self.PREFILL_BUCKET):
                args = (torch.zeros(1, tp, dtype=torch.long, device=dev), torch.full((1,), tp - 1, device=dev))
                for name, on in (("prefill", plain), ("prefill_spec", speculative)):
                    if on:
                        calls.append((name, args, self._upto(tp)))
        return calls

    def _settle_norms(self) -> None:
        """With compiled elementwise kernels, the norms compiled only where they round each of the verify's rows as
        a one-token step does (FastLM.settle_norms; once per verify size, outside any graph capture)."""
        lm = getattr(self.runner, "lm", None)
        if self.engine == "fast" and self.settle_norms and lm.compile_elementwise and \
                lm.exact_rows != (self.verify_tokens,):
            lm.exact_rows = (self.verify_tokens,)
            lm.settle_norms()

    @torch.no_grad()
    def warm_up(self, plain: bool = True, speculative: bool = True) -> int:
        """Run every fixed-shape step a generation can make (step_calls) before anything is timed: under CUDA
        graphs each is captured and checked against eager runs here, and kernels that are built per shape
        (compiled elementwise kernels, attention plans) are built here, instead of in the first generation that
        reaches a longer span of the cache. The steps write cache slots that every generation overwrites before
        attending to them (its prefill and its own steps write each slot below its committed length; slots
        past it are masked by position). -> the number of calls made."""
        # under graphs: the capture and its eager checks (every call until `check` of them are done)
        reps = max(1, self.graphs.check) if self.graphs.enabled else 1
        n = 0
        self._settle_norms()
        for name, args, upto in self.step_calls(plain, speculative):
            for _ in range(reps):
                self._call(name, *args, upto=upto)
                n += 1
        _sync(self.device)
        return n

    def _begin(self, prompt_ids, max_new_tokens: int, stop_ids, speculative: bool, round_slots: int,
               round_what: str = ""):
        """The start every generate shares: check the prompt (list or 1-D tensor) fits the cache with max_new_tokens
        and the `round_slots` a last round may write past them (`round_what` names those in the error), start the
        clocks, prefill -> (the _Run, whose gen.tokens holds the first token; first [1]; the drafter's h_last and
        logits_last after it, None when not `speculative`)."""
        if speculative and self.drafter is None:
            raise EyasError("speculative decoding needs a drafter")
        self._settle_norms()
        ids = torch.as_tensor(list(prompt_ids) if not torch.is_tensor(prompt_ids) else prompt_ids,
                              dtype=torch.long, device=self.device).view(1, -1)
        n = ids.shape[1]
        if n == 0:
            raise EyasError("empty prompt")
        if n + max_new_tokens + round_slots > self.max_len:
            raise EyasError(f"prompt of {n} tokens + {max_new_tokens} new tokens{round_what} does not fit the "
                            f"decoder's cache of {self.max_len} tokens")
        run = _Run(Generation(tokens=[], prompt_tokens=n), set(int(s) for s in stop_ids), PhaseClock(self.device))
        _sync(self.device)
        run.t_start = time.perf_counter()
        t0 = run.clock.start()
        first, h_last, logits_last = self._prefill(ids, speculative)
        run.clock.stop("prefill", t0)
        run.gen.tokens.append(int(first.item()))
        return run, first, h_last, logits_last

    def _finish(self, run: _Run) -> Generation:
        """The end every generate shares: the device synced, the wall and phase times and the stop flag filled in."""
        gen = run.gen
        _sync(self.device)
        gen.seconds = time.perf_counter() - run.t_start
        tot = run.clock.totals()
        gen.draft_seconds, gen.verify_seconds = tot.get("draft", 0.0), tot.get("verify", 0.0)
        gen.prefill_seconds = tot.get("prefill", 0.0)
        gen.stopped = gen.tokens[-1] in run.stop
        return gen

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int = 256, stop_ids=(), speculative: bool = True) -> Generation:
        """Decode up to `max_new_tokens` after `prompt_ids` (list or 1-D tensor), stopping after any
        token in `stop_ids`. speculative=False: plain decoding, one target forward per token."""
        plain_slots = max(self.k + 1, self.verify_tokens if self.plain_like_verify else 1)
        run, first, h_last, logits_last = self._begin(prompt_ids, max_new_tokens, stop_ids, speculative,
                                                      self.round_slots if speculative else plain_slots)
        gen, out, stop, clock = run.gen, run.gen.tokens, run.stop, run.clock
        L = gen.prompt_tokens + 1
        last_dev = first.view(1)
        if (not speculative or self.fused) and len(out) < max_new_tokens and out[-1] not in stop:
            state = (last_dev, h_last, logits_last, self._pos(L - 1, 1)) if speculative else (last_dev, L - 1)
            self._pipelined(gen, out, L, state, speculative, max_new_tokens, stop, clock)
        # the step-by-step round (sampling, or eval.round=stepwise): drafts, verify, one host sync, rebuild
        while speculative and not self.fused and len(out) < max_new_tokens and out[-1] not in stop:
            t0 = clock.start()
            drafts, q = self.draft(h_last, logits_last, L)
            clock.stop("draft", t0)
            t0 = clock.start()
            a, nxt, aux = self.verify(last_dev, drafts, q, L)
            clock.stop("verify", t0)
            # the one host sync of the round: accepted count and the emitted tokens
            na, new = _emitted(torch.cat([a, drafts[0], nxt]).tolist())
            gen.accepted.append(na)
            gen.target_forwards += 1
            # rebuild the drafter's cache from the target's aux states at positions L-1..L-1+K
            t0 = clock.start()
            feed = torch.cat([drafts, nxt.view(1, 1)], 1)
            feed[0, na] = nxt[0]
            h, dl = self._call("draft", feed, aux, self._pos(L - 1, self.k + 1), upto=self._upto(L + self.k))
            h_last, logits_last = h[:, na:na + 1], dl[:, na]
            last_dev = nxt.view(1)  # the round's last emitted token is always the target's
            clock.stop("draft", t0)
            if _commit(out, new, stop, max_new_tokens):
                break
            L += len(new)
        return self._finish(run)

    def generate_like_verify(self, prompt_ids, max_new_tokens: int = 256, stop_ids=()) -> Generation:
        """Plain decoding with its steps shaped as the verify (plain_like_verify), whatever that setting: what greedy
        speculative decoding must give bit for bit."""
        was, self.plain_like_verify = self.plain_like_verify, True
        try:
            return self.generate(prompt_ids, max_new_tokens, stop_ids, speculative=False)
        finally:
            self.plain_like_verify = was

    def close(self) -> None:
        self.runner.close()
