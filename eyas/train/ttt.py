"""Training-time test (TTT): unroll the EAGLE-3 drafter over `steps` steps on a packed batch.

Notation for one sequence x_0..x_{L-1} with target states aux_t, final_t (lm_head(final_t) is the
target's distribution for x_{t+1}):

  step 0, position t:  input (embed(x_{t+1}), fc(aux_t))         -> predicts x_{t+2}
  step j, position t:  input (embed(x_{t+j+1}), h^{(j-1)}_t)      -> predicts x_{t+j+2}

and the label of step j at t is the target distribution at t+j+1 restricted to the draft vocabulary
(soft cross-entropy), counted where x_{t+j+2} is a loss-masked (assistant) token and the target's own
top token there is in the draft vocabulary. Accuracy counts the same loss-masked positions, a
target token outside the draft vocabulary being a miss, so Σ_k Π_{i≤k} acc_i simulates the
acceptance length of a chain of drafts.

Attention at step j, query position t: the step-0 keys at positions <= t of the same sequence, and
the keys of steps 1..j at position t only (what the drafter saw while drafting that chain).
Step j runs at rope position t+j: the position the drafted token has when the drafter runs
chained at serving time (eyas' decoder and vLLM advance the position one per draft step), so the
relative distances the drafter learns are the ones it meets when it drafts. Sequences are packed into one row; `doc` keeps
attention inside each sequence. The pattern (eyas/train/attention.py) is one mask over the keys of all steps so
far, concatenated: flex-attention with a block mask on CUDA (only the causal blocks and the diagonal
blocks of later steps are computed), the same mask as a dense boolean SDPA mask elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..features import Sample, target_top
from ..target_head import HeadRows
from ..util import EyasError, compile_failure, log, to_device
from .attention import TTTAttend


@dataclass
class PackedBatch:
    """Several sequences packed into one row of `n` tokens (the tail is padding)."""
    input_ids: torch.Tensor  # [n] long
    loss_mask: torch.Tensor  # [n] bool
    aux: torch.Tensor        # [n, 3H]
    final: torch.Tensor      # [n, H]
    doc: torch.Tensor        # [n] int32: sequence number within the batch; padding has its own
    pos: torch.Tensor        # [n] long: position inside the sequence
    doc_len: torch.Tensor    # [n] long: length of the token's sequence
    n_real: int              # tokens that are not padding
    top: torch.Tensor | None = None  # [n] int32: the target's full-vocabulary argmax (None: compute it)

    def to(self, device) -> "PackedBatch":
        f = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
             for k, v in self.__dict__.items()}
        return PackedBatch(**f)


def pack_samples(samples: list[Sample], max_len: int = 0, pad_to: int = 0, multiple: int = 1) -> PackedBatch:
    """Concatenate samples (each truncated to `max_len` if > 0) and pad to at least `pad_to` tokens,
    rounded up to a multiple of `multiple`."""
    parts = []
    for s in samples:
        L = len(s.input_ids) if max_len <= 0 else min(max_len, len(s.input_ids))
        parts.append((s.input_ids[:L], s.loss_mask[:L], s.aux[:L], s.final[:L], None if s.top is None else s.top[:L]))
    n_real = sum(len(p[0]) for p in parts)
    n = max(n_real, pad_to)
    n = -(-n // multiple) * multiple
    pad = n - n_real
    ref = samples[0]
    dev = ref.aux.device
    aux = torch.cat([p[2] for p in parts] + [ref.aux.new_zeros(pad, ref.aux.shape[-1])])
    final = torch.cat([p[3] for p in parts] + [ref.final.new_zeros(pad, ref.final.shape[-1])])
    top = None
    if all(p[4] is not None for p in parts):
        top = torch.cat([p[4].to(dev, torch.int32) for p in parts] + [torch.zeros(pad, dtype=torch.int32, device=dev)])
    lens = [len(p[0]) for p in parts] + ([pad] if pad else [])
    # the integer columns (ids, loss mask, document, position, document length) are built on the host
    # and sent to the features' device in one copy
    cols = torch.stack([
        torch.cat([p[0].cpu().long() for p in parts] + [torch.zeros(pad, dtype=torch.long)]),
        torch.cat([p[1].cpu().long() for p in parts] + [torch.zeros(pad, dtype=torch.long)]),
        torch.cat([torch.full((L,), i, dtype=torch.long) for i, L in enumerate(lens)]),
        torch.cat([torch.arange(L) for L in lens]),
        torch.cat([torch.full((L,), L, dtype=torch.long) for L in lens])])
    cols = to_device(cols, dev)
    ids, mask, doc, pos, doc_len = cols[0], cols[1].bool(), cols[2].int(), cols[3], cols[4]
    return PackedBatch(ids, mask, aux, final, doc, pos, doc_len, n_real, top)


# ------------------------------------------------------------------------------------- labels

@dataclass
class Labels:
    logits: torch.Tensor    # [n, V_d] target logits over the draft vocabulary (no grad)
    draft_idx: torch.Tensor  # [n] long: draft index of the target's top token, -1 if outside the draft vocab


@torch.no_grad()
def target_labels(final: torch.Tensor, lm_head: torch.nn.Module, draft_ids: torch.Tensor, chunk: int = 4096,
                  top: torch.Tensor | None = None, temperature: float = 1.0) -> Labels:
    """Target logits restricted to the draft vocabulary, and whether the full-vocabulary argmax
    is in it: `top` when the features carry it, else computed here in row chunks. `temperature` divides the
    logits (below 1 the soft labels are sharper, nearer the greedy token a decoder verifies; the argmax is kept).
    `lm_head`: the target's whole output layer, or its draft vocabulary's rows alone (a HeadRows read for
    `draft_ids`), which need `top`."""
    W = lm_head.weight
    b = getattr(lm_head, "bias", None)
    if isinstance(lm_head, HeadRows):  # the draft vocabulary's rows alone, read for these ids
        if lm_head.ids.numel() != draft_ids.numel():
            raise EyasError(f"the trainer holds the target's output rows of {lm_head.ids.numel():,} token ids, not "
                            f"of the draft vocabulary's {draft_ids.numel():,}")
        if top is None:
            raise EyasError("these features do not carry the target's top token (`top`, stored by extraction), and "
                            "the trainer holds only the draft vocabulary's rows of the target's output layer, too "
                            "few to compute it: run `eyas extract` again")
        Wd, bd, vocab = W, b, lm_head.vocab_size
    else:
        Wd, bd, vocab = W[draft_ids], None if b is None else b[draft_ids], W.shape[0]
    logits = F.linear(final.to(W.dtype), Wd, bd)
    if temperature != 1.0:
        logits = logits / temperature
    to_draft = torch.full((vocab,), -1, dtype=torch.long, device=W.device)
    to_draft[draft_ids] = torch.arange(draft_ids.numel(), device=W.device)
    if top is None:
        top = target_top(final, lm_head, chunk)
    return Labels(logits, to_draft[top.long()])


# ---------------------------------------------------------------------------------- the unroll

@dataclass
class StepStats:
    """Per TTT step: summed loss (differentiable), loss-masked positions, positions predicted right. With
    `chain`, also the greedy chain a decoder would accept from each position (`chain_step`): per step the row
    masks of the positions still in the chain (`alive`) and of those accepted there (`hits`)."""
    loss_sum: list[torch.Tensor]
    count: list[torch.Tensor]
    correct: list[torch.Tensor]
    alive: list[torch.Tensor] = field(default_factory=list)
    hits: list[torch.Tensor] = field(default_factory=list)


def chain_step(logits: torch.Tensor, draft_idx: torch.Tensor, nxt: torch.Tensor, valid: torch.Tensor,
               ids: torch.Tensor, draft_ids: torch.Tensor, prev: tuple[torch.Tensor, torch.Tensor] | None):
    """One step of greedy chain acceptance, simulated on the unroll: a decoder drafting from position t feeds
    the drafter its own guesses, which equal the data's tokens only while each guess was the target's greedy
    token and the data's next token is that token too. So step j counts at t when steps < j were accepted
    there and the token it is fed (the data's, row t+j+1) is the one step j-1 drafted; it is accepted when its
    argmax is the target's top token at row t+j+1 (`draft_idx`, -1 outside the draft vocabulary: never).
    Where the data leave the target's greedy path the chain is cut, not rejected: a decoder would have fed
    other tokens there, which the data cannot tell. prev: (hit mask, drafted index) of step j-1, None at
    step 0. Returns (alive mask, hit mask, drafted index) over the rows."""
    drafted = logits.argmax(-1)
    if prev is None:
        alive = valid
    else:
        hit, before = prev
        alive = hit & valid & (ids[nxt] == draft_ids[before])
    return alive, alive & (drafted == draft_idx[nxt]), drafted


def chain_acceptance(alive: list[float], hit: list[float]) -> list[float]:
    """Per-position acceptance of the simulated greedy chain: accepted / still in the chain at each step (a
    decoder's per-position acceptance, conditional on the earlier drafts being accepted)."""
    return [h / a if a else 0.0 for a, h in zip(alive, hit)]


def decoder_rounds(batch: PackedBatch, hits: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """The rounds a greedy decoder drafting `len(hits)` tokens per round would run on each sequence of `batch`,
    which must be the target's greedy text (prompt, then its greedy answer, loss-masked): the first round drafts
    from the prompt's last position, each round accepts the simulated chain's length a there (the summed `hits`
    of `chain_step`) and the next starts a + 1 positions on (the accepted drafts and the target's own token);
    rounds whose chain the unroll cannot see to its end (the answer's last few positions) are left out.
    Averaging the chain over every position instead counts each position once, where the decoder starts a round
    at every position just after a rejected draft (text that is often harder to guess) and none inside an
    accepted run.
    Returns per step (rounds reaching that draft, rounds accepting it): `chain_acceptance` of them is the
    decoder's per-position acceptance there and 1 + `acceptance_length` its τ."""
    steps = len(hits)
    alive, hit = [0.0] * steps, [0.0] * steps
    if not steps:
        return alive, hit
    n = batch.n_real
    chain = torch.stack(hits)[:, :n].sum(0).tolist()
    starts = (batch.pos[:n] == 0).nonzero().flatten().tolist() + [n]
    mask = batch.loss_mask[:n].tolist()
    for s, e in zip(starts[:-1], starts[1:]):
        first = next((i for i in range(s, e) if mask[i]), None)
        if first is None or first == s:
            continue
        t = first - 1
        while t + steps + 2 <= e:
            a = int(chain[t])
            for j in range(steps):
                alive[j] += a >= j
                hit[j] += a > j
            t += a + 1
    return alive, hit


def step_targets(batch: PackedBatch, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the label/input row t+j+1 for each position t (clamped), loss-masked validity)."""
    n = batch.input_ids.shape[0]
    ar = torch.arange(n, device=batch.input_ids.device)
    nxt = (ar + j + 1).clamp(max=n - 1)
    far = (ar + j + 2).clamp(max=n - 1)
    valid = (batch.pos + j + 2 < batch.doc_len) & batch.loss_mask[far] & (ar < batch.n_real)
    return nxt, valid


def count_positions(loss_mask: torch.Tensor, lengths: list[int], steps: int) -> list[int]:
    """Loss-masked positions per TTT step for unpacked sequences (what `step_targets` counts):
    step j trains on tokens x_{j+2}.. of each sequence whose loss mask is on."""
    out = [0] * steps
    off = 0
    for L in lengths:
        m = loss_mask[off:off + L]
        for j in range(steps):
            out[j] += int(m[j + 2:].sum()) if L > j + 2 else 0
        off += L
    return out


def _step_loss(logits: torch.Tensor, label_logits: torch.Tensor, nxt: torch.Tensor, didx: torch.Tensor,
               valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One TTT step's summed soft cross-entropy and right guesses, over every row of the batch.

    logits [n, V_d] (the drafter's), label_logits [n, V_d] (the target's) and didx [n] (the target's top token
    as a draft index, -1 outside the draft vocabulary), both read at rows nxt, and valid [n] (the positions the
    step counts; it trains on those whose label is in the draft vocabulary). The cross-entropy is written as
    logsumexp(q) - sum(p * q), which equals -(p * log_softmax(q)).sum() since p sums to one: it needs no
    [n, V_d] log-probabilities, so compiled (`compile_loss`) it runs as a few fused passes over the two
    logit tensors instead of a dozen elementwise ones, and every row is computed (no data-dependent
    row selection, so no host synchronisation and one shape for the compiler)."""
    lg = logits.float()
    d = didx[nxt]
    p = torch.softmax(label_logits[nxt].float(), -1)
    ce = torch.logsumexp(lg, -1) - (p * lg).sum(-1)
    loss = torch.where(valid & (d >= 0), ce, 0.0).sum()
    correct = ((lg.argmax(-1) == d) & valid).sum().float()
    return loss, correct


COMPILE_MODES = ("auto", "on", "off")  # train.compile_loss / train.compile_drafter: auto compiles on CUDA only
_compiled_loss = None


def compile_on(mode: str, device: torch.device) -> bool:
    """Whether a compile setting ("auto", "on" or "off") compiles on `device`: "auto" on CUDA only."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"a compile setting must be one of {COMPILE_MODES}, got {mode!r}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


class CompiledLoss:
    """`_step_loss` through torch.compile, checked on its first call in each mode: the forward, and with grad a
    forward and backward on a detached copy of the logits (inductor builds the backward lazily, at the first
    backward, which would otherwise fail inside the training step; a compiled backward cannot run twice on one
    graph, so the check does not reuse the real one). If either fails, it says why once and the loss runs
    eagerly from then on, so a compiler problem costs speed, not the run. `state` says which ("compiled",
    "eager: <why>")."""

    def __init__(self):
        self.fn = torch.compile(_step_loss, dynamic=False, fullgraph=True)
        self.checked: set[bool] = set()
        self.state = "compiled"

    def __call__(self, logits, *rest):
        if self.state != "compiled":
            return _step_loss(logits, *rest)
        grad = torch.is_grad_enabled() and logits.requires_grad
        if grad in self.checked:
            return self.fn(logits, *rest)
        try:
            if grad:  # build and run the compiled backward now, on a detached copy (the same shape: the same graphs)
                probe = logits.detach().requires_grad_()
                torch.autograd.grad(self.fn(probe, *rest)[0], probe)
            out = self.fn(logits, *rest)
        except Exception as e:  # any compiler failure: fall back, keep training
            self.state = f"eager: torch.compile failed ({compile_failure(e)})"
            log(f"the TTT loss runs eagerly from now on: {self.state}")
            return _step_loss(logits, *rest)
        self.checked.add(grad)
        return out


def step_loss_fn(device: torch.device, mode: str = "auto"):
    """The step loss, compiled where `mode` (train.compile_loss) says (bench/bench_train.py --compile-loss)."""
    global _compiled_loss
    if not compile_on(mode, device):
        return _step_loss
    if _compiled_loss is None:
        _compiled_loss = CompiledLoss()
    return _compiled_loss


class CompiledStep:
    """A drafter's step in the unroll with its two stateless parts, `Eagle3Drafter.pre_attention` and
    `post_attention`, each through torch.compile (one graph each: the norms, rope, projections, MLP and lm_head
    as a few fused kernels instead of the eager step's many small ones), and the attention, which keeps
    the earlier steps' keys, run as it is between them. Checked like `CompiledLoss`: the first call of each
    kind (with or without grad, from the target's states or the drafter's own) also runs on detached copies,
    through the backward where there is one, and a failure anywhere leaves the drafter eager from then on, with
    the reason in `state`. A new input shape counts as a new kind: its first call is compiled inside the check, so
    once torch's recompile limit is reached (unpadded batches of many lengths: training pads them where the step
    is compiled, but a caller of `ttt_unroll` may not) the step goes eager instead of failing the call."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.pre = torch.compile(drafter.pre_attention, dynamic=False, fullgraph=True)
        self.between = torch.compile(drafter.between_layers, dynamic=False, fullgraph=True)  # multi-layer only
        self.post = torch.compile(drafter.post_attention, dynamic=False, fullgraph=True)
        self.checked: set[tuple] = set()
        self.state = "compiled"

    def _run(self, ids, hidden, pos, attends):
        h, q, k, v = self.pre(ids, hidden, pos)
        for i in range(1, len(attends)):
            h, q, k, v = self.between(i, h, attends[i - 1](q, k, v), pos)
        return self.post(h, attends[-1](q, k, v))

    def __call__(self, ids, hidden, pos, attend):
        if self.state != "compiled":
            return self.drafter(ids, hidden, pos, attend)
        grad = torch.is_grad_enabled()
        kind = (grad, tuple(hidden.shape), tuple(ids.shape), hidden.requires_grad, self.drafter.training)
        if kind not in self.checked:
            try:
                self._probe(ids, hidden, pos, attend, grad)
            except Exception as e:  # any compiler failure: fall back, keep training
                self.state = f"eager: torch.compile failed ({compile_failure(e)})"
                log(f"the drafter's TTT steps run eagerly from now on: {self.state}")
                return self.drafter(ids, hidden, pos, attend)
            self.checked.add(kind)
        return self._run(ids, hidden, pos, self.drafter.attends(attend))

    def _probe(self, ids, hidden, pos, attend, grad):
        """Every part (and their backward, with grad) on detached inputs and a copy of the attention's state,
        so the real step's graph and the attention's keys are untouched and no gradient is accumulated."""
        probe = hidden.detach().requires_grad_(hidden.requires_grad)
        out = self._run(ids, probe, pos, [a.copy() for a in self.drafter.attends(attend)])
        if grad:
            params = [p for p in self.drafter.parameters() if p.requires_grad]
            torch.autograd.grad([out[0].float().sum() + out[1].float().sum()], params + ([probe] if probe.requires_grad else []),
                                allow_unused=True)


def drafter_compile_on(device: torch.device, mode: str = "auto") -> bool:
    """Whether `mode` (train.compile_drafter) asks for the compiled drafter step on `device` (training then pads
    every batch to one shape, as on a GPU: each new shape would be compiled again, and after torch's recompile
    limit, 8, the step falls back to eager)."""
    return compile_on(mode, device)


def drafter_step_fn(drafter, device: torch.device, mode: str = "auto"):
    """The unroll's drafter step: the drafter itself, or its `CompiledStep` where `mode` (train.compile_drafter)
    says (kept on the drafter, so compiled once per drafter; bench/bench_train.py --compile-drafter)."""
    # FSDP2 gathers a sharded drafter's weights in its forward hooks, which the two parts would bypass
    if not drafter_compile_on(device, mode) or any(type(p).__name__ == "DTensor" for p in drafter.parameters()):
        return drafter
    step = drafter.__dict__.get("_eyas_compiled_step")
    if step is None:
        step = drafter.__dict__["_eyas_compiled_step"] = CompiledStep(drafter)
    return step


def drafter_state(drafter, device: torch.device, mode: str = "auto") -> str:
    """How the drafter's TTT steps run: "compiled", "eager", or "eager: <why compiling failed>"."""
    step = drafter_step_fn(drafter, device, mode)
    return step.state if isinstance(step, CompiledStep) else "eager"


def loss_state(device: torch.device, mode: str = "auto") -> str:
    """How the TTT loss runs on `device`: "compiled", "eager", or "eager: <why compiling failed>"."""
    fn = step_loss_fn(device, mode)
    return fn.state if isinstance(fn, CompiledLoss) else "eager"


LOSS_PATHS = ("all", "greedy", "chain")


def ttt_unroll(drafter, batch: PackedBatch, labels: Labels, steps: int, noise_std: float = 0.0,
               generator: torch.Generator | None = None, backend: str = "auto", chain: bool = False,
               loss_path: str = "all", compile_loss: str = "auto", compile_drafter: str = "auto") -> StepStats:
    """Run `steps` TTT steps over a packed batch; return per-step loss sums and counts (and with `chain` the
    simulated greedy chain, `chain_step`).

    loss_path: the positions steps j > 0 count at. "all": every valid one. "greedy": only where the tokens fed at
    steps 1..j (the data's) are the target's top tokens, the only tokens a greedy decoder feeds its drafter.
    "chain": also only where the drafter's steps before j drafted those tokens, the positions a decoder's chain
    reaches (the token-alignable training of GRIFFIN). Step 0 counts every valid position in all three.
    compile_loss, compile_drafter: "auto" (compiled on CUDA), "on" or "off" for the step loss and the drafter's
    step (train.compile_loss, train.compile_drafter)."""
    if loss_path not in LOSS_PATHS:
        raise ValueError(f"loss_path must be one of {LOSS_PATHS}, got {loss_path!r}")
    ids = batch.input_ids
    aux = batch.aux
    if noise_std > 0:
        noise = torch.randn(aux.shape, generator=generator, device=generator.device if generator else aux.device,
                            dtype=torch.float32)
        aux = aux + (noise_std * noise).to(aux.device, aux.dtype)
    masks: dict = {}  # one block mask a step for every layer (TTTAttend)
    attend = [TTTAttend(batch.doc, backend, steps, batch.n_real, masks)
              for _ in range(drafter.config.num_hidden_layers)]
    pos = batch.pos[None]
    hidden = aux[None]
    stats = StepStats([], [], [])
    loss_fn = step_loss_fn(ids.device, compile_loss)
    step = drafter_step_fn(drafter, ids.device, compile_drafter)
    on_path = None  # loss_path: the positions whose tokens fed so far are on the path it keeps
    prev = None  # the chain's (hit, drafted) of the step before
    for j in range(steps):
        nxt, valid = step_targets(batch, j)
        hidden, logits = step(ids[nxt][None], hidden, pos + j, attend)
        counted = valid if on_path is None else valid & on_path  # the chain below simulates over every valid row
        loss, correct = loss_fn(logits[0], labels.logits, nxt, labels.draft_idx, counted)
        stats.loss_sum.append(loss)
        stats.count.append(counted.sum().float())
        stats.correct.append(correct)
        if loss_path != "all" and j + 1 < steps:
            top = labels.draft_idx[nxt]  # the target's top token after row t+j+1, which step j+1 is fed as data
            fed = ids[(nxt + 1).clamp(max=ids.shape[0] - 1)]
            keep = (top >= 0) & (fed == drafter.draft_ids[top.clamp(min=0)])
            if loss_path == "chain":
                keep = keep & (logits[0].detach().argmax(-1) == top)
            on_path = keep if on_path is None else on_path & keep
        if chain:
            alive, hit, drafted = chain_step(logits[0].detach(), labels.draft_idx, nxt, valid, ids,
                                             drafter.draft_ids, prev)
            prev = (hit, drafted)
            stats.alive.append(alive)
            stats.hits.append(hit)
    return stats


def acceptance_length(acc: list[float]) -> float:
    """Simulated acceptance length Σ_k Π_{i≤k} acc_i (drafted tokens accepted per chain, without
    the target's bonus token: τ ≈ 1 + this)."""
    total, prod = 0.0, 1.0
    for a in acc:
        prod *= a
        total += prod
    return total
