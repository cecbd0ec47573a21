"""The train stage: EAGLE-3 drafter training with training-time test, on one process or many.

One code path for 1 and N processes (torchrun: gloo on CPU, NCCL on GPU). With more than one process the
drafter is wrapped in DDP, sharded by FSDP2 (`train.parallel=fsdp`), or, where the step runs as CUDA graphs
(`train.cuda_graph`, the GPU default), left whole while `stepgraph.AccumGraph` sums the gradients with one
all-reduce between its graphs. Each optimizer step takes a *group* of
`world × grad_accum` packed micro-batches; rank r trains on micro-batches r·A .. r·A+A-1 of it.
The loss of every TTT step is normalised by the number of loss-masked positions of the whole
group (computed from the token data, known to every rank), so the update is the same for any
split of a group over processes and micro-batches.

Run directory: `ckpt/step-NNNNNNN/` (model.safetensors, optim.safetensors, state.json) and
`ckpt/latest.json` written atomically; `ckpt/best.json` + `draft/` (the drafter with the best
validation simulated acceptance length, written with save_drafter); `train/metrics.jsonl`,
`train/curves.png`, `train/tb/` (TensorBoard, when it is installed). A killed run started again
with the same command continues from the last checkpoint and, on the CPU, repeats the same losses. On one
process, Ctrl-C or SIGTERM lets the step under way finish and saves a checkpoint there before stopping.
"""
from __future__ import annotations

import bisect
import contextlib
import json
import math
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import KEYED_WHEN_CHANGED, Config, check_settings
from ..draft import NON_FINITE, Eagle3Drafter, build_drafter, check_fits, read_safetensors, save_drafter
from .ttt import (PackedBatch, StepStats, acceptance_length, chain_acceptance, count_positions, decoder_rounds,
                  drafter_compile_on, drafter_state, loss_state, pack_samples, target_labels, ttt_unroll)
from ..rope import target_rope
from .stepgraph import AccumGraph, StepGraph, graph_unfit
from ..target_head import HeadRows, draft_rows, head_for_labels
from ..util import (EyasError, PhaseClock, Terminated, atomic_path, atomic_write_json, human_bytes, log, progress,
                   read_json, refuse_non_finite, share, stable_hash, text_lines, writing)

# what to do about a training whose loss or weights stopped being finite numbers
DIVERGED = ("lower train.lr or set train.grad_clip (or check the features, if they hold NaN) and train again; "
            "the checkpoint and drafter kept are from before it")

# settings whose change makes a checkpoint belong to a different run
TRAJECTORY_KEYS = ["epochs", "lr", "weight_decay", "max_seq_len", "ttt_steps", "ttt_decay", "noise_std", "scheduler",
                   "warmup_ratio", "finetune_from", "batch_tokens", "grad_accum", "grad_clip", "seed",
                   "max_steps", "draft_intermediate_size", "init_head", "fc_init", "precision"]


# ------------------------------------------------------------------------------ distributed

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


# ------------------------------------------------------------------------------------ data

def pack_indices(lengths: list[int], budget: int, seed: int) -> list[list[int]]:
    """Sequences (already capped at `budget` tokens) into bins of at most `budget` tokens: shuffle,
    then best fit in decreasing length, then shuffle the bins. Deterministic in `seed`."""
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    order.sort(key=lambda i: -lengths[i])
    free: list[tuple[int, int]] = []  # (space left, bin) sorted
    bins: list[list[int]] = []
    for i in order:
        L = lengths[i]
        k = bisect.bisect_left(free, (L, -1))
        if k < len(free):
            space, b = free.pop(k)
        else:
            space, b = budget, len(bins)
            bins.append([])
        bins[b].append(i)
        if space - L > 0:
            bisect.insort(free, (space - L, b))
    rng.shuffle(bins)
    return [sorted(b) for b in bins]


class Data:
    """Token lengths, epoch packing and feature access for one split."""

    def __init__(self, tokens, features, max_len: int, budget: int, fp32: bool = False, all_positions: bool = False):
        self.tokens = tokens
        self.all_positions = all_positions  # train.loss_positions=all: the loss on every token, not the answers only
        self.features = features
        self.max_len = max_len
        self.budget = budget
        self.lengths = [min(int(x), max_len) for x in tokens.lengths()]
        self._epoch: tuple[tuple[int, int], list] | None = None
        self.fp32 = fp32  # train.precision=fp32 on a GPU: features cast up like on the CPU
        self.fixed = False  # every batch padded to the budget, wherever it runs (a graphed or compiled step)

    def bins(self, seed: int) -> list[list[int]]:
        return self.slot_bins(seed, 1)[0]

    def slot_bins(self, seed: int, slots: int) -> list[list[list[int]]]:
        """An epoch's micro-batches for each of `slots` slots (processes x grad_accum), slot j taking its
        step-i micro-batch from its own list. Sequence i always belongs to slot i % slots, so a process
        meets the same sequences every epoch (its feature cache serves them all after the first) and
        packs them anew each epoch. The lists depend on `slots`, not on how the slots are spread over
        processes, so 2 processes and 1 process with grad_accum 2 train on the same batches."""
        key = (seed, slots)
        if self._epoch is None or self._epoch[0] != key:
            out = []
            for j in range(slots):
                idx = list(range(j, len(self.lengths), slots))
                packed = pack_indices([self.lengths[i] for i in idx], self.budget,
                                      seed if slots == 1 else seed * 1_000_003 + j)
                out.append([[idx[k] for k in b] for b in packed])
            self._epoch = (key, out)
        return self._epoch[1]

    def counts(self, bins: list[list[int]], steps: int) -> list[int]:
        total = [0] * steps
        for b in bins:
            for i in b:
                _, m = self.tokens[i]
                L = self.lengths[i]
                if self.all_positions:
                    m = torch.ones_like(m)
                for j, c in enumerate(count_positions(m[:L], [L], steps)):
                    total[j] += c
        return total

    def batch(self, idx: list[int], device, multiple: int) -> PackedBatch:
        samples = self.features.get(idx)
        # on the GPU (or wherever the drafter's step is compiled) every batch has the budget's shape, so compiled
        # kernels are built once; elsewhere no padding
        dev = torch.device(device)
        pad_to = self.budget if dev.type == "cuda" or self.fixed else 0
        batch = pack_samples(samples, self.max_len, pad_to, multiple).to(device)
        if self.all_positions:  # the padding stays out: step_targets counts only rows below n_real
            batch.loss_mask = torch.ones_like(batch.loss_mask)
        if batch.aux.device.type != "cuda" or self.fp32:  # fp32 drafter math: stored bf16/fp8 features cast up
            batch.aux, batch.final = batch.aux.float(), batch.final.float()
        return batch


def make_features(cfg: Config, target, tokens, split: str, cache_bytes: int = 0, host_bytes: int = 0):
    if cfg.train.online:
        from ..features import OnlineFeatures

        return OnlineFeatures(target, tokens, max_batch_tokens=max(cfg.features.batch_tokens, cfg.train.batch_tokens),
                              cache_bytes=cache_bytes, norm=cfg.features.norm, host_bytes=host_bytes)
    try:
        from ..features import OfflineFeatures
    except ImportError:
        raise EyasError("offline features are not available in this version of eyas; use --online") from None
    feats = OfflineFeatures(cfg.out, split)
    return ReadAhead(feats, cfg.train.num_workers) if cfg.train.num_workers > 0 and split == "train" else feats


class ReadAhead:
    """Stored features read ahead of the training loop (train.num_workers threads): while a step runs, the
    micro-batches of the next ones are read from their shards (and fp8 ones dequantized), so a step that would wait
    for the disk finds its batch read. What a batch holds does not depend on when it was read, so the losses are
    the same as reading in the loop. Anything else (lengths, a batch asked for that was not read ahead) goes to the
    features themselves."""

    def __init__(self, features, workers: int):
        from concurrent.futures import ThreadPoolExecutor

        self.features, self.workers = features, workers
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="eyas-read-ahead")
        self.pending: dict[tuple, object] = {}

    def ahead(self, batches: list[list[int]]) -> None:
        for idx in batches:
            key = tuple(idx)
            if key not in self.pending:
                self.pending[key] = self.pool.submit(self.features.get, list(idx))

    def get(self, idx: list[int]):
        fut = self.pending.pop(tuple(idx), None)
        return fut.result() if fut is not None else self.features.get(idx)

    def __getattr__(self, name):
        return getattr(self.features, name)


# ------------------------------------------------------------------------------- schedule

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


# --------------------------------------------------------------------------------- drafter

def finetune_source(cfg: Config, target) -> tuple[Eagle3Drafter, Path]:
    """The drafter --finetune-from names (eyas draft folder, run directory, checkpoint folder, or an
    SGLang/EAGLE/vLLM-speculators folder via eyas.export) and its folder; refused, saying why, when it is not
    there or does not fit `target` (the pipeline asks before its first stage)."""
    p = Path(cfg.train.finetune_from).expanduser()
    if not p.exists():
        raise EyasError(f"train.finetune_from: {p} does not exist")
    if (p / "draft" / "config.json").exists():
        p = p / "draft"
    if (p / "state.json").exists() and (p / "model.safetensors").exists():  # an eyas checkpoint folder
        return _drafter_from_checkpoint(p, target), p
    if not (p / "config.json").exists():
        raise EyasError(f"train.finetune_from: {p} is not a drafter folder (no config.json), a run directory or a "
                        f"checkpoint folder")
    from ..export import import_drafter

    d = import_drafter(p, target)  # an eyas folder, or an engine's; a damaged config.json or weights file is named
    check_fits(d.config, target, str(p))
    return d, p


def draft_variants(cfg: Config) -> dict:
    """The drafter variants (eyas.variants) the train.draft_* settings ask for."""
    tc = cfg.train
    return {"norm_before_residual": tc.draft_norm_before_residual, "norm_before_fc": tc.draft_norm_before_fc,
            "fc_norm": tc.draft_fc_norm, "norm_output": tc.draft_norm_output, "layer_type": tc.draft_layer_type}


def initial_drafter(cfg: Config, target, draft_ids: torch.Tensor) -> Eagle3Drafter:
    """A fresh drafter, or the one --finetune-from names (eyas draft folder, run directory,
    checkpoint folder, or an SGLang/EAGLE/vLLM-speculators folder via eyas.export)."""
    src = cfg.train.finetune_from
    if not src:
        if cfg.train.draft_layers < 1:
            raise EyasError(f"train.draft_layers must be at least 1, got {cfg.train.draft_layers}")
        d = build_drafter(target, draft_ids.numel(), draft_ids, cfg.train.draft_intermediate_size,
                          cfg.train.draft_layers, draft_variants(cfg))
        if cfg.train.init_head:
            init_head_from_target(d, target)
        return d
    d, p = finetune_source(cfg, target)
    log(f"finetune: starting from the drafter in {p} ({d.config.num_hidden_layers} layer(s), draft vocabulary "
        f"{d.config.draft_vocab_size}, aux layers {d.config.aux_layers})")
    if d.config.draft_vocab_size != draft_ids.numel() or not torch.equal(d.draft_ids.cpu(), draft_ids.cpu()):
        log(f"finetune: keeping the draft vocabulary of {p} ({d.config.draft_vocab_size} tokens), "
            f"not the run's ({draft_ids.numel()})")
    return d


@torch.no_grad()
def init_head_from_target(drafter: Eagle3Drafter, target) -> None:
    """Start the drafter's output side where the target's is: lm_head = the target's output rows of
    the draft vocabulary, final norm = the target's final norm. The drafter's hidden state lives in
    the target's hidden space (fc maps the aux states into it), so from step 0 the head reads it the
    way the target reads its own last state."""
    head = draft_rows(target, drafter.draft_ids)
    W = head.weight if isinstance(head, HeadRows) else head.weight[drafter.draft_ids.to(head.weight.device)]
    drafter.lm_head.weight.copy_(W.to(drafter.lm_head.weight))
    norm = target.final_norm_weight()
    if norm is not None and norm.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(norm.to(drafter.norm.weight))


@torch.no_grad()
def aux_layer_rms(batches, n: int, H: int) -> torch.Tensor:
    """RMS of each of the n aux layers' states [float64, n] over `batches` (PackedBatch), the first token of each
    sequence (an attention sink, whose states are far larger: SmolLM2's reach RMS ~1,000) left out; ones when the
    batches hold no such token."""
    sq = torch.zeros(n, dtype=torch.float64)
    count = 0
    for b in batches:
        keep = b.pos[: b.n_real] > 0
        a = b.aux[: b.n_real][keep].float().view(-1, n, H)
        sq += a.pow(2).sum((0, 2)).double().cpu()
        count += a.shape[0] * H
    if count == 0:
        return torch.ones(n, dtype=torch.float64)
    return (sq / count).sqrt().clamp_min(1e-6)


@torch.no_grad()
def scale_fc_init(drafter: Eagle3Drafter, batches) -> list[float]:
    """Divide each aux layer's block of fc columns by that layer's RMS over `batches` (aux_layer_rms).
    The target's aux layers differ in scale (SmolLM2: RMS 3.0, 6.6, 22.6 at layers 2, 15, 27), so
    with PyTorch's init the deepest layer dominates fc's output. Returns the RMS per layer."""
    c = drafter.config
    n, H = len(c.aux_layers), c.target_hidden_size
    rms = aux_layer_rms(batches, n, H)
    w = drafter.fc.weight
    w.copy_((w.view(w.shape[0], n, H) / rms.to(w)[None, :, None]).view_as(w))
    return [round(float(r), 4) for r in rms]


def _drafter_from_checkpoint(p: Path, target) -> Eagle3Drafter:
    from ..draft import DraftConfig

    state = read_json(p / "state.json")
    c = DraftConfig.from_dict(state["draft_config"])
    check_fits(c, target, str(p))
    d = Eagle3Drafter(c, target.embed_tokens().weight.detach().float())
    weights = read_safetensors(p / "model.safetensors")
    refuse_non_finite(weights, str(p / "model.safetensors"), NON_FINITE)
    d.load_state_dict(weights, strict=False)
    return d


class TTTModule(torch.nn.Module):
    """The drafter plus the TTT unroll in one forward, so that DDP sees one forward per backward."""

    def __init__(self, drafter: Eagle3Drafter, compile_loss: str = "auto", compile_drafter: str = "auto"):
        super().__init__()
        self.drafter = drafter
        self.compile = {"compile_loss": compile_loss, "compile_drafter": compile_drafter}  # train.compile_*

    def forward(self, batch, labels, steps, noise_std, generator, chain=False, loss_path="all"):
        return ttt_unroll(self.drafter, batch, labels, steps, noise_std, generator, chain=chain, loss_path=loss_path,
                          **self.compile)


# ------------------------------------------------------------------------------ checkpoints

def ckpt_dir(run: Path) -> Path:
    return run / "ckpt"


def plain_group(g: dict) -> dict:
    """An optimizer param group (less its params) as a checkpoint keeps it, whichever way the step ran: a learning
    rate held as a tensor for a CUDA graph as a number, and capturable off (`stepgraph`)."""
    out = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
    if "capturable" in out:
        out["capturable"] = False
    return out


class TrainState:
    """The drafter's weights and optimizer state by parameter name, whole, however the processes hold them:
    one process or DDP read them directly; under FSDP2 weights() and optimizer() are collectives (every process
    calls them) that leave the whole tensors on rank 0 (the others get empty ones), and load() puts whole
    tensors, read by every process, back into the shards."""

    PREFIX = "drafter."  # the FSDP root is the TTTModule: its names carry this prefix

    def __init__(self, drafter: Eagle3Drafter, opt: torch.optim.Optimizer, root: torch.nn.Module | None = None):
        self.drafter, self.opt, self.root = drafter, opt, root  # root: the fully_shard'ed module, or None

    def weights(self) -> dict[str, torch.Tensor]:
        """trainable_state_dict's tensors (every process must call it under FSDP)."""
        if self.root is None:
            return self.drafter.trainable_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        keep = self.drafter.trainable_names()
        return {k[len(self.PREFIX):]: v for k, v in sd.items() if k[len(self.PREFIX):] in keep}

    def optimizer(self) -> tuple[dict[str, dict], list[dict]]:
        """({param name: {state key: tensor}}, param groups with names for params)."""
        if self.root is None:
            names = {id(p): n for n, p in self.drafter.named_parameters()}
            osd = self.opt.state_dict()
            params = [p for g in self.opt.param_groups for p in g["params"]]
            st = {names[id(params[i])]: dict(v) for i, v in osd["state"].items()}
            groups = [plain_group(g) | {"params": [names[id(params[i])] for i in g["params"]]}
                      for g in osd["param_groups"]]
            return st, groups
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        osd = get_optimizer_state_dict(self.root, self.opt,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        n = len(self.PREFIX)
        if "state" not in osd:  # with cpu_offload the whole state lands on rank 0 only
            return {}, []
        st = {k[n:]: dict(v) for k, v in osd["state"].items()}
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [q[n:] for q in g["params"]]}
                  for g in osd["param_groups"]]
        return st, groups

    def load(self, weights: dict[str, torch.Tensor], st: dict[str, dict], groups: list[dict]) -> None:
        if self.root is None:
            self.drafter.load_state_dict(weights, strict=False)
            by_name = dict(self.drafter.named_parameters())
            params = [p for g in self.opt.param_groups for p in g["params"]]
            index = {id(p): i for i, p in enumerate(params)}
            osd = {"state": {index[id(by_name[n])]: {k: v.to(by_name[n].device) if k != "step" or v.dim() else v
                                                     for k, v in kv.items()} for n, kv in st.items()},
                   "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                    | {"params": [index[id(by_name[n])] for n in g["params"]]} for g in groups]}
            self.opt.load_state_dict(osd)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        P = self.PREFIX
        set_state_dict(self.root, self.opt, model_state_dict={P + k: v for k, v in weights.items()},
                       optim_state_dict={"state": {P + n: kv for n, kv in st.items()},
                                         "param_groups": [g | {"params": [P + q for q in g["params"]]} for g in groups]},
                       options=StateDictOptions(full_state_dict=True, strict=False))


def save_checkpoint(run: Path, ts: TrainState, state: dict, keep: int = 1, main: bool = True) -> Path | None:
    """ckpt/step-N/{model,optim}.safetensors + state.json, renamed into place, then latest.json. Every
    process calls it (under FSDP the state is gathered from all of them); `main` writes."""
    from safetensors.torch import save_file

    weights = ts.weights()
    st, groups = ts.optimizer()
    if not main:
        return None
    root = ckpt_dir(run)
    name = f"step-{state['step']:07d}"
    final = root / name
    weights = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    tensors = {f"{n}::{k}": torch.as_tensor(v).detach().cpu().contiguous() for n, kv in st.items() for k, v in kv.items()}
    # (the loss and gradient norm are checked as they are read; this is the last guard, where they went unread)
    refuse_non_finite(weights | tensors, f"{final}: not written", f"the training diverged at or before step "
                      f"{state['step']}: {DIVERGED}")
    rng = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["rng.cuda"] = torch.cuda.get_rng_state()
    tmp = root / f".{name}.{os.getpid()}.tmp"
    needed = sum(v.numel() * v.element_size() for v in (weights | tensors).values())
    try:
        with writing(final, needed):  # a full disk is named with the space a checkpoint takes
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            save_file(weights, str(tmp / "model.safetensors"))
            save_file(tensors | rng, str(tmp / "optim.safetensors"))
            atomic_write_json(tmp / "state.json", {**state, "param_groups": groups,
                                                   "draft_config": ts.drafter.config.to_dict(),
                                                   "python_random": repr(random.getstate())})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written left beside the checkpoints
        raise
    for f in ("model.safetensors", "optim.safetensors"):
        share(tmp / f)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_json(root / "latest.json", {"step": state["step"], "dir": name})
    olds = sorted(d for d in root.glob("step-*") if d.name != name)
    for d in olds[: max(0, len(olds) - (keep - 1))]:
        shutil.rmtree(d, ignore_errors=True)
    return final


class StopRequest:
    """SIGINT (Ctrl-C) or SIGTERM (a job scheduler's notice) while one process trains: the step under way
    finishes, a checkpoint is saved at it, and then the run stops as interrupted, so the work since the last
    periodic checkpoint is kept; the same signal again stops at once. A signal the process was started ignoring
    (a shell's background job ignores SIGINT) stays ignored. Several processes keep the default behaviour: each
    would see the signal at a step of its own, and a checkpoint needs all of them at the same one."""

    def __init__(self, active: bool):
        self.active = active and threading.current_thread() is threading.main_thread()
        self.requested: str | None = None
        self.old: dict = {}

    def __enter__(self) -> "StopRequest":
        if self.active:
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self.old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise self.interrupt(signal.Signals(signum).name)
        self.requested = signal.Signals(signum).name
        log(f"train: {self.requested}: stopping after this step, with a checkpoint; send it again to stop at once")

    @staticmethod
    def interrupt(name: str | None) -> KeyboardInterrupt:
        """What stops the run for signal `name`: Terminated for SIGTERM (the CLI exits 143), KeyboardInterrupt for
        Ctrl-C (130), as for the other commands."""
        return Terminated() if name == "SIGTERM" else KeyboardInterrupt()

    def __exit__(self, *exc) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)
        self.old = {}


def _latest_state(run: Path) -> tuple[Path, dict]:
    """The latest checkpoint's folder and state.json; a damaged one is named, with what to do."""
    try:
        info = read_json(ckpt_dir(run) / "latest.json")
        d = ckpt_dir(run) / info["dir"]
        return d, read_json(d / "state.json")
    except (EyasError, KeyError, TypeError) as e:
        raise EyasError(f"{ckpt_dir(run)}: unreadable checkpoint ({e}); delete {ckpt_dir(run)} to start over") from None


def _refuse_other_run(run: Path, stored: dict, fp: dict) -> None:
    """Stop on a checkpoint whose fingerprint differs from this run's, naming what changed (the keys of `fp` only)."""
    was, now = stored.get("train", {}), fp.get("train", {})
    diff = [f"train.{k}" for k in sorted({*now, *was}) if was.get(k) != now.get(k)]
    for key, name in (("target", "the target"), ("draft_vocab", "the draft vocabulary's size"),
                      ("draft_vocab_hash", "the draft vocabulary"), ("world", "the process count"),
                      ("tokens", f"the training data ({Path(run) / 'data' / 'tokens'})")):
        if key in fp and stored.get(key) != fp.get(key) and not (key == "draft_vocab_hash" and
                                                                 "the draft vocabulary's size" in diff):
            diff.append(name)
    if diff or stored != fp:
        raise EyasError(f"{ckpt_dir(run)} holds a checkpoint of a different training run ({', '.join(diff) or 'its settings'}"
                        f" changed); use another --out or delete {ckpt_dir(run)} to start over")


def precheck_checkpoint(cfg: Config, target, world: int) -> None:
    """Refuse a checkpoint of another training run before anything of the run is made again: what the fingerprint
    holds that is known before the tokens and the vocabulary (the training settings, the target, the process count,
    the draft vocabulary's size). Before, `eyas train --draft-vocab-size N` chose the vocabulary again and only then
    refused the checkpoint, leaving the run's vocabulary unlike its drafter and exports."""
    run = Path(cfg.out)
    if not (ckpt_dir(run) / "latest.json").exists():
        return
    stored = _latest_state(run)[1].get("fingerprint") or {}
    now = {"train": trajectory(cfg), "target": target.identity(), "world": world}
    if "draft_vocab" in stored:
        now["draft_vocab"] = min(cfg.vocab.draft_vocab_size, target.vocab_size)
    _refuse_other_run(run, {k: stored.get(k) for k in now}, now)


def load_checkpoint(run: Path, ts: TrainState, fp: dict | None = None) -> dict | None:
    """The latest checkpoint's state, its weights, optimizer and RNG loaded into `ts`; None when there is none.
    With `fp`, a checkpoint of another training run (another fingerprint) is refused, naming the settings that
    changed, before any of its tensors is read (a changed drafter shape would otherwise fail on the tensors)."""
    from safetensors.torch import load_file

    latest = ckpt_dir(run) / "latest.json"
    if not latest.exists():
        return None
    d, state = _latest_state(run)
    stored = state.get("fingerprint") or {}
    if fp is not None and "tokens" not in stored:  # a checkpoint from before the tokens were part of it
        fp = {k: v for k, v in fp.items() if k != "tokens"}
    if fp is not None and stored != fp:
        _refuse_other_run(run, stored, fp)
    try:
        sd = load_file(str(d / "model.safetensors"))
        ot = load_file(str(d / "optim.safetensors"))
    except Exception as e:  # noqa: BLE001 - a damaged file is a user-facing problem
        raise EyasError(f"{d}: unreadable checkpoint ({e}); delete {ckpt_dir(run)} to start over") from None
    for f, tensors in (("model.safetensors", sd), ("optim.safetensors", ot)):  # not resumed to train on
        refuse_non_finite(tensors, str(d / f), f"the training it comes from diverged, or the file is damaged; "
                          f"delete {ckpt_dir(run)} to start over")
    want = ts.drafter.trainable_names()
    missing, unexpected = sorted(want - set(sd)), sorted(set(sd) - want)
    if missing or unexpected:
        raise EyasError(f"{d}/model.safetensors does not match the drafter (missing {missing}, unexpected {unexpected})")
    st: dict = {}
    for key, v in ot.items():
        if not key.startswith("rng."):
            n, k = key.split("::")
            st.setdefault(n, {})[k] = v
    ts.load(sd, st, state["param_groups"])
    torch.set_rng_state(ot["rng.torch"])
    if "rng.cuda" in ot and torch.cuda.is_available():
        torch.cuda.set_rng_state(ot["rng.cuda"])
    return state


# ---------------------------------------------------------------------------------- metrics

class Metrics:
    """metrics.jsonl (rank 0), TensorBoard scalars when available, curves.png at the end."""

    def __init__(self, run: Path, main: bool, resume_step: int):
        self.path = run / "train" / "metrics.jsonl"
        self.main = main
        self.rows: list[dict] = []
        self.tb = None
        if not main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # keep what the checkpoint covers; drop rows a killed run wrote after it
            for line in text_lines(self.path.read_text()):
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if r.get("step", 0) <= resume_step:
                    self.rows.append(r)
        atomic_write_text_lines(self.path, self.rows)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run / "train" / "tb"), purge_step=resume_step + 1)
        except Exception:  # noqa: BLE001 - TensorBoard is optional
            self.tb = None

    def add(self, row: dict) -> None:
        if not self.main:
            return
        self.rows.append(row)
        with writing(self.path), open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k == "step":
                    continue
                if isinstance(v, list):
                    for i, x in enumerate(v):
                        self.tb.add_scalar(f"{k}/{i}", x, row["step"])
                elif isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])

    def close(self, png: Path) -> None:
        if not self.main:
            return
        if self.tb is not None:
            self.tb.close()
        plot_curves(self.rows, png)


def atomic_write_text_lines(path: Path, rows: list[dict]) -> None:
    from ..util import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def plot_curves(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [r for r in rows if "loss" in r]
    ev = [r for r in rows if "val_al" in r]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    if tr:
        ax[0].plot([r["step"] for r in tr], [r["loss"] for r in tr], lw=0.8)
        for j in range(len(tr[0]["acc"])):
            ax[1].plot([r["step"] for r in tr], [r["acc"][j] for r in tr], lw=0.8, label=f"train step {j}")
    for j in range(len(ev[0]["val_acc"]) if ev else 0):
        ax[1].plot([r["step"] for r in ev], [r["val_acc"][j] for r in ev], "o-", label=f"val step {j}")
    for key, label in (("val_al", "val_al (sum of step accuracies' products)"), ("val_tau", "val_tau (sampled answers)"),
                       ("greedy_tau", "greedy_tau (the target's greedy answers)")):
        pts = [r for r in ev if key in r]
        if pts:
            ax[2].plot([r["step"] for r in pts], [r[key] for r in pts], "o-", label=label)
    ax[0].set_title("training loss (TTT, weighted)")
    ax[1].set_title("accuracy per TTT step")
    ax[2].set_title("validation: simulated acceptance, tau forecasts")
    for a in ax:
        a.set_xlabel("optimizer step")
        a.grid(alpha=0.3)
    ax[1].legend(fontsize=7)
    if ev:
        ax[2].legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------ steps

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


def time_shares(totals: dict[str, float]) -> dict:
    """Seconds per phase of the training step and each one's share of their sum."""
    s = sum(totals.values()) or 1.0
    return {k: {"s": round(v, 4), "share": round(v / s, 3)} for k, v in totals.items()}


@torch.no_grad()
def evaluate(module, drafter, data: Data, lm_head, steps: int, d: Dist, multiple: int, precision: str = "auto",
             sharded: bool = False, rounds: bool = False) -> dict:
    """Per-position accuracy, simulated acceptance length and loss on a split, all ranks together. sharded:
    `module` is the FSDP root, whose forward gathers the weights, a collective: every process then runs as
    many forwards as the busiest one (the extra ones are not counted). rounds: the split is the target's greedy
    text, so also the decoder's rounds on it (`decoder_rounds`): round_accept, round_tau and rounds."""
    module.eval()
    every = data.bins(0)
    bins = every[d.rank::d.world]
    n = -(-len(every) // d.world) if sharded else len(bins)
    loss = torch.zeros(steps, dtype=torch.float64, device=d.device)
    cnt, cor, alive, hit, r_alive, r_hit = (torch.zeros_like(loss) for _ in range(6))
    for i in range(n):
        batch = data.batch(bins[i] if i < len(bins) else every[0], d.device, multiple)
        with autocast(d.device, precision):
            labels = target_labels(batch.final, lm_head, drafter.draft_ids, top=batch.top)
            st = (module(batch, labels, steps, 0.0, None, chain=True) if sharded
                  else ttt_unroll(drafter, batch, labels, steps, chain=True, **module.compile))
        if i >= len(bins):
            continue
        loss += torch.stack(st.loss_sum).double()
        cnt += torch.stack(st.count).double()
        cor += torch.stack(st.correct).double()
        alive += torch.stack([m.sum() for m in st.alive]).double()
        hit += torch.stack([m.sum() for m in st.hits]).double()
        if rounds:
            ra, rh = decoder_rounds(batch, st.hits)
            r_alive += torch.tensor(ra, dtype=torch.float64, device=d.device)
            r_hit += torch.tensor(rh, dtype=torch.float64, device=d.device)
    t = d.all_sum(torch.stack([loss, cnt, cor, alive, hit, r_alive, r_hit]))
    module.train()
    acc = (t[2] / t[1].clamp(min=1)).tolist()
    accept = chain_acceptance(t[3].tolist(), t[4].tolist())
    out = {"val_loss": float((t[0] / t[1].clamp(min=1)).sum()), "val_acc": acc, "val_al": acceptance_length(acc),
           "val_positions": int(t[1][0]), "val_accept": accept, "val_tau": 1 + acceptance_length(accept),
           "val_chain_positions": [int(x) for x in t[3].tolist()]}
    if rounds:
        r_accept = chain_acceptance(t[5].tolist(), t[6].tolist())
        out.update({"round_accept": r_accept, "round_tau": 1 + acceptance_length(r_accept), "rounds": int(t[5][0])})
    return out


def restore_best_draft(run: Path, drafter: Eagle3Drafter, best: dict) -> None:
    """draft/ lost its weights after training wrote them (a file removed from the run): a resumed run that has no
    step left to train writes the best drafter again from its checkpoint, or says why it cannot, where it would
    otherwise end as finished with no drafter."""
    from safetensors.torch import load_file

    src = ckpt_dir(run) / f"step-{best['step']:07d}" / "model.safetensors"
    if not src.exists():
        raise EyasError(f"{run / 'draft'} lost the best drafter (step {best['step']}), and no checkpoint of that step "
                        f"is kept in {ckpt_dir(run)} to write it from; delete {ckpt_dir(run)} to train again")
    save_drafter(drafter, run / "draft", extra={"trained": {**best, "restored_from": str(src)}},
                 tensors=load_file(str(src)))
    log(f"train: {run / 'draft'} had lost its weights; wrote the best drafter (step {best['step']}) again from {src}")


def trajectory(cfg: Config) -> dict:
    """The training settings a checkpoint belongs to (its fingerprint's "train")."""
    train = {k: getattr(cfg.train, k) for k in TRAJECTORY_KEYS}
    for key, old in KEYED_WHEN_CHANGED.items():  # settings added later: keyed only while changed
        sec, _, field = key.partition(".")
        if sec == "train" and getattr(cfg.train, field) != old:
            train[field] = getattr(cfg.train, field)
    return train


def fingerprint(cfg: Config, target, draft_ids: torch.Tensor, world: int) -> dict:
    from ..data.prepare import tokens_key

    return {"train": trajectory(cfg), "target": target.identity(),
            "draft_vocab": int(draft_ids.numel()), "draft_vocab_hash": stable_hash(str(draft_ids.tolist())),
            "world": world, "tokens": tokens_key(cfg.out)}


# tests: train.cuda_graph's step (static buffers, the graphs' bodies) on a CPU, run eagerly; the variable lets a
# test under torchrun ask for it
GRAPH_ON_CPU = os.environ.get("EYAS_DEBUG_GRAPH_ON_CPU") == "1"
LAG_STATS = True  # read a step's statistics one step later, so the host never waits for the device between steps


def check_train_settings(cfg: Config) -> None:
    """Refuse train settings out of range, and the tokenize stage's (which `eyas train` runs when the run has no
    tokens), naming the key, before anything is tokenized or trained."""
    from ..data.prepare import check_tokenize_settings

    tc = cfg.train
    check_settings(cfg, (
        ("train.ttt_steps", tc.ttt_steps >= 1, "at least 1"),
        ("train.epochs", tc.epochs >= 1, "at least 1"),
        ("train.batch_tokens", tc.batch_tokens >= 16, "at least 16"),
        ("train.grad_accum", tc.grad_accum >= 1, "at least 1"),
        ("train.max_seq_len", tc.max_seq_len >= 2, "at least 2"),
        ("train.label_temperature", tc.label_temperature > 0, "above 0"),
        ("train.ttt_decay", tc.ttt_decay >= 0, "0 or above"),
        ("train.lr", tc.lr > 0, "above 0"),
        ("train.weight_decay", tc.weight_decay >= 0, "0 or above"),
        ("train.noise_std", tc.noise_std >= 0, "0 or above"),
        ("train.warmup_ratio", 0 <= tc.warmup_ratio <= 1, "between 0 and 1"),
        ("train.grad_clip", tc.grad_clip >= 0, "0 (off) or above"),
        ("train.max_steps", tc.max_steps >= 0, "0 (every epoch) or above"),
        ("train.save_every", tc.save_every >= 0, "0 (each epoch end) or above"),
        ("train.eval_every", tc.eval_every >= 0, "0 (each epoch end) or above"),
        ("train.num_workers", tc.num_workers >= 0, "0 (read in the loop) or above"),
        ("train.draft_intermediate_size", tc.draft_intermediate_size >= 0, "0 (the target's) or above"),
        ("train.draft_layers", tc.draft_layers >= 1, "at least 1"),
        ("train.draft_fc_norm", not (tc.draft_fc_norm and tc.draft_norm_before_fc),
         "false while train.draft_norm_before_fc is true (two ways to norm fc's input: choose one)"),
        ("train.greedy_val", tc.greedy_val >= 0, "0 (off) or above"),
        ("train.feature_cache_gb", tc.feature_cache_gb >= 0 or tc.feature_cache_gb == -1, "-1 (auto), 0 or above"),
        ("train.feature_cache_host_gb", tc.feature_cache_host_gb >= 0 or tc.feature_cache_host_gb == -1,
         "-1 (auto), 0 or above")))
    check_tokenize_settings(cfg)


def run_train(cfg: Config, target=None, on_step=None) -> dict:
    """Train the drafter of run directory `cfg.out` (tokenizing and choosing the vocabulary first if
    those stages have not run) and write the best drafter to `<run>/draft/`. on_step: called with the step number
    after each optimizer step (a profiler's schedule, bench/bench_train.py --profile-steps)."""
    from ..data.prepare import ensure_tokens, load_tokens, tokens_dir
    from ..target_head import load_for_training, target_bytes_held
    from ..vocab import ensure_vocab, load_vocab

    tc = cfg.train
    check_train_settings(cfg)
    d = dist_setup(cfg.target.device)
    run = Path(cfg.out)
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    if target is None or not hasattr(target, "lm_head"):  # none, or a description (TargetSpec) without weights
        target = load_for_training(cfg, replace(cfg.target, device=str(d.device)), spec=target)
    if not tc.finetune_from:  # a target rope the drafter cannot have is refused before tokens and features
        target_rope(target.config, f"target '{cfg.target.name}'")
    if d.main:  # made now if missing; see ensure_tokens and ensure_vocab for what a standalone `eyas train` reuses
        precheck_checkpoint(cfg, target, d.world)
        ensure_tokens(cfg, target)
        ensure_vocab(cfg, target)
    d.barrier()
    draft_ids = load_vocab(run, target)
    max_len = min(tc.max_seq_len, tc.batch_tokens)
    multiple = 128 if d.device.type == "cuda" else 1
    fp32 = tc.precision == "fp32"
    group = d.world * tc.grad_accum  # micro-batch slots per optimizer step; slot j belongs to rank j // grad_accum
    train_tokens, val_tokens = load_tokens(run, "train"), load_tokens(run, "val")
    cache = {"train": 0, "val": 0}
    host = dict(cache)
    if tc.online:  # the budgets split between the splits by their tokens
        from ..features import feature_cache_budget, host_cache_budget, train_step_bytes

        budget = feature_cache_budget(tc.feature_cache_gb, target.device,
                                      train_step_bytes(tc.batch_tokens, tc.ttt_steps, int(draft_ids.numel())))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        host_budget = host_cache_budget(tc.feature_cache_host_gb, target.device, local_processes=local)
        n_tok = {k: max(1, int(t.lengths().sum())) for k, t in (("train", train_tokens), ("val", val_tokens))}
        cache = {k: budget * n / sum(n_tok.values()) for k, n in n_tok.items()}
        host = {k: host_budget * n / sum(n_tok.values()) for k, n in n_tok.items()}
        if budget or host_budget:
            log(f"train: online features kept after their first computation, in {target.device} memory up to "
                f"{human_bytes(budget)}" + (f", then in host memory up to {human_bytes(host_budget)}"
                                            if host_budget else ""))
    train = Data(train_tokens, make_features(cfg, target, train_tokens, "train", cache["train"], host["train"]),
                 max_len, tc.batch_tokens, fp32, all_positions=tc.loss_positions == "all")
    val = Data(val_tokens, make_features(cfg, target, val_tokens, "val", cache["val"], host["val"]), max_len,
               tc.batch_tokens, fp32) if len(val_tokens) else None
    if len(train.tokens) == 0:
        raise EyasError(f"{tokens_dir(run)}: the training split is empty")
    if tc.best_by == "greedy_tau" and tc.greedy_val <= 0:
        raise EyasError("train.best_by=greedy_tau picks the best checkpoint by the forecast on the target's greedy "
                        "answers, which train.greedy_val=0 turns off: set train.greedy_val above 0 or choose "
                        "train.best_by=val_tau or val_al")
    greedy = None  # the target's greedy answers to validation prompts: the decoder's tau forecast (eyas.greedyval)
    if tc.greedy_val > 0 and len(val_tokens):
        from ..features import OnlineFeatures
        from .greedyval import greedy_val_set

        n_new = cfg.eval.max_new_tokens
        gen_tokens = 65536 if target.device.type == "cuda" else 4096
        g_tokens, err = None, run / "train" / "greedy_val_error.json"
        if d.main:  # a measurement beside the training: its failure is reported, the training goes on
            err.unlink(missing_ok=True)
            try:
                g_tokens = greedy_val_set(run, target, val_tokens, tc.greedy_val, n_new, max_len, gen_tokens)
            except Exception as e:  # noqa: BLE001
                failed = f"{type(e).__name__}: {e}"
                log(f"train: WARNING: the greedy validation answers could not be made ({failed}); training goes on "
                    f"without greedy_tau")
                err.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(err, {"error": failed})
        d.barrier()
        if not d.main and not err.exists():  # the main process's answers, read back
            g_tokens = greedy_val_set(run, target, val_tokens, tc.greedy_val, n_new, max_len, gen_tokens)
        if g_tokens is not None and len(g_tokens):
            # the target's features of this text are computed as they are needed, with stored features too
            feats = OnlineFeatures(target, g_tokens, max_batch_tokens=max(cfg.features.batch_tokens, tc.batch_tokens),
                                   norm=cfg.features.norm)
            greedy = Data(g_tokens, feats, max_len, tc.batch_tokens, fp32)

    compiled = drafter_compile_on(d.device, tc.compile_drafter)
    for split in (train, val, greedy):  # the compiled step is built for one batch shape: every batch padded to it
        if split is not None:
            split.fixed = compiled
    best_key = tc.best_by if tc.best_by != "auto" else ("greedy_tau" if greedy is not None else "val_al")
    if best_key == "greedy_tau" and greedy is None and len(val_tokens):
        log("train: WARNING: train.best_by=greedy_tau, but there are no greedy answers to score: the best "
            "checkpoint is picked by val_al")
        best_key = "val_al"

    warm = None
    if cache["train"] or host["train"]:  # this process's sequences through the target ahead, extraction-sized
        mine_seqs = [i for i in range(len(train_tokens)) if i % group // tc.grad_accum == d.rank]
        t_w = time.perf_counter()
        n_kept = train.features.warm(mine_seqs, cfg.features.batch_tokens, keep=tc.feature_cache_keep)
        dt = time.perf_counter() - t_w
        n_tok = train.features.warm_tokens  # those computed: the warm-up stops once the budgets are full
        on_host = len(train.features.host_cache)
        warm = {"sequences": n_kept, "of": len(mine_seqs), "seconds": round(dt, 2), "tok_s": round(n_tok / dt, 1),
                "host_sequences": on_host, "keep": tc.feature_cache_keep}
        log(f"train: target features of {n_kept} of {len(mine_seqs)} sequences computed ahead and kept"
            + (f" ({on_host} of them in host memory)" if on_host else "") + ", "
            f"{dt:.1f} s ({n_tok / dt:,.0f} tok/s)")

    torch.manual_seed(tc.seed)
    drafter = initial_drafter(cfg, target, draft_ids).to(d.device)
    drafter.float()
    resuming = (ckpt_dir(run) / "latest.json").exists()  # its weights replace any init
    # same batches on every rank (DDP also broadcasts)
    normed_fc_input = drafter.config.norm_before_fc or drafter.config.fc_norm  # each aux state already at scale 1
    if not tc.finetune_from and tc.fc_init == "scaled" and not resuming and not normed_fc_input:
        first = train.slot_bins(tc.seed, group)[0][:2]  # slot 0 (rank 0) owns these sequences
        rms = scale_fc_init(drafter, [train.batch(b, d.device, multiple) for b in first])
        log(f"train: fc init scaled by the aux layers' RMS {rms} (layers {drafter.config.aux_layers})")
    drafter.embed_tokens.weight.requires_grad_(False)
    draft_ids = drafter.draft_ids
    lm_head = head_for_labels(target, draft_ids, [train.features, val.features if val else None])
    module = TTTModule(drafter, tc.compile_loss, tc.compile_drafter)
    model = module
    sharded = d.world > 1 and tc.parallel == "fsdp"
    graph_why = graph_unfit(d.device, d.world, tc.grad_accum, tc.noise_std, compiled, sharded) \
        if tc.cuda_graph and not (GRAPH_ON_CPU and d.device.type == "cpu") else ""
    graphed = tc.cuda_graph and not graph_why
    if graph_why and d.device.type == "cuda":
        log(f"train: train.cuda_graph is on, but the step runs without a graph: {graph_why}")
    if sharded:  # FSDP2: one group, the frozen embedding left whole on every process
        from torch.distributed.fsdp import fully_shard

        fully_shard(module, ignored_params={drafter.embed_tokens.weight})
    elif d.world > 1 and not graphed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(module, device_ids=[d.device.index] if d.device.type == "cuda" else None, broadcast_buffers=False)
    params = [p for p in drafter.parameters() if p.requires_grad]  # sharded ones under FSDP
    if graphed and d.world > 1:  # AccumGraph sums the gradients itself: the processes start from rank 0's weights
        with torch.no_grad():
            for p in params:
                dist.broadcast(p, 0)
    # a graph reads the learning rate from the device, and AdamW must allow the capture
    lr_t = torch.tensor(tc.lr, device=d.device) if graphed and d.device.type == "cuda" else None
    opt = torch.optim.AdamW(params, lr=tc.lr if lr_t is None else lr_t, betas=(0.9, 0.95),
                            weight_decay=tc.weight_decay,
                            **({"fused": True} if d.device.type == "cuda" and not sharded else {}),
                            **({"capturable": True} if lr_t is not None else {}))
    ts = TrainState(drafter, opt, module if sharded else None)

    spe = min(len(b) for e in range(tc.epochs) for b in train.slot_bins(tc.seed + e, group))
    n_bins = sum(len(b) for b in train.slot_bins(tc.seed, group))
    if spe == 0:
        raise EyasError(f"the training split packs into {n_bins} micro-batches of {tc.batch_tokens} tokens, fewer than "
                        f"the {group} one optimizer step needs ({d.world} processes x grad_accum {tc.grad_accum}); "
                        f"lower --batch-tokens or --grad-accum")
    total = tc.epochs * spe
    if tc.max_steps:
        total = min(total, tc.max_steps)
    fp = fingerprint(cfg, target, draft_ids, d.world)

    state = load_checkpoint(run, ts, fp)
    if lr_t is not None:  # the checkpoint's groups hold plain numbers (plain_group)
        for g in opt.param_groups:
            g["lr"], g["capturable"] = lr_t, True
    step, best = 0, {"val_al": -1.0, "step": -1}
    if state is not None:
        step, best = state["step"], state["best"]
        log(f"train: resuming from step {step} of {total}")
        if best.get("step", -1) >= 0 and best.get("by", "val_al") != best_key:
            log(f"train: the best checkpoint so far (step {best['step']}) was picked by {best.get('by', 'val_al')}; "
                f"from here on by {best_key}")
    metrics = Metrics(run, d.main, step)
    evals_due = (lambda s: s % tc.eval_every == 0) if tc.eval_every else (lambda s: s % spe == 0)
    saves_due = (lambda s: s % tc.save_every == 0) if tc.save_every else (lambda s: s % spe == 0)
    decay = [tc.ttt_decay ** j for j in range(tc.ttt_steps)]
    train.fixed = graphed or compiled  # a graph too replays one batch shape

    def forward_loss(batch, denom, gen, cache: bool = True):
        """The micro-batch's weighted TTT loss and step statistics (denom: the step's loss-masked positions, numbers
        or, for a graph, a device tensor)."""
        with autocast(d.device, tc.precision, cache):
            labels = target_labels(batch.final, lm_head, draft_ids, top=batch.top, temperature=tc.label_temperature)
            st: StepStats = model(batch, labels, tc.ttt_steps, tc.noise_std, gen, loss_path=tc.loss_path)
        return sum(decay[j] * st.loss_sum[j] / denom[j] for j in range(tc.ttt_steps)), st

    def clip_and_step() -> torch.Tensor:
        """Gradient clipping and the optimizer's step; the gradients' norm before clipping."""
        gnorm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip if tc.grad_clip > 0 else float("inf"))
        if hasattr(gnorm, "full_tensor"):  # a DTensor under FSDP
            gnorm = gnorm.full_tensor()
        opt.step()
        return gnorm

    def grad_body(batch, denom) -> torch.Tensor:
        """One micro-batch's forward and backward, as a graph captures it: the statistics the eager step gathers
        (loss, right guesses per TTT step, real tokens) in one tensor."""
        loss, st = forward_loss(batch, denom, None, cache=False)
        loss.backward()
        return torch.cat([loss.detach().double().reshape(1), torch.stack(st.correct).double(),
                          torch.as_tensor(batch.n_real, device=d.device).double().reshape(1)])

    def graph_body(batch, denom) -> torch.Tensor:
        """One process's whole step on one micro-batch, as `stepgraph.StepGraph` captures it: `grad_body`'s
        statistics and the gradient norm in one tensor."""
        stats = grad_body(batch, denom)
        return torch.cat([stats, clip_and_step().detach().double().reshape(1)])

    # several micro-batches a step (processes x grad_accum): `stepgraph.AccumGraph`, the gradients summed between
    # its two graphs; one: the whole step as one graph (`StepGraph`)
    accum = graphed and group > 1
    if accum and d.device.type == "cuda":
        log(f"train: {group} micro-batches a step ({d.world} processes x grad_accum {tc.grad_accum}): each one's "
            f"forward and backward, then the update, run as CUDA graphs, the gradients summed between them")
    stepper = None  # the StepGraph or AccumGraph, made at the first step
    n_params = sum(p.numel() for p in params)
    log(f"train: {len(train.tokens)} sequences in {n_bins} micro-batches of <= {tc.batch_tokens} tokens, "
        f"{spe} steps/epoch x {tc.epochs} epochs -> {total} steps on {d.world} x {d.device.type}; "
        f"drafter {n_params / 1e6:.1f}M trainable parameters, draft vocab {draft_ids.numel()}")

    def save_draft(trained: dict) -> None:
        """The drafter into run/draft: every process calls it (gathering the weights is a collective under
        FSDP), rank 0 writes."""
        weights = ts.weights() if sharded else None
        if d.main:
            save_drafter(drafter, run / "draft", extra={"trained": trained}, tensors=weights)

    def do_eval(s: int) -> None:
        nonlocal best
        if val is None:
            return
        r = evaluate(module, drafter, val, lm_head, tc.ttt_steps, d, multiple, tc.precision, sharded)
        if not math.isfinite(r["val_loss"]):  # every process sees the same sum
            bar.close()
            raise EyasError(f"train: the validation loss is {r['val_loss']} at step {s}: the training diverged and "
                            f"stops here, writing nothing of it; {DIVERGED}")
        if greedy is not None:
            g = evaluate(module, drafter, greedy, lm_head, tc.ttt_steps, d, multiple, tc.precision, sharded,
                         rounds=True)
            r.update({"greedy_tau": g["round_tau"], "greedy_accept": g["round_accept"], "greedy_rounds": g["rounds"],
                      "greedy_tau_all": g["val_tau"], "greedy_accept_all": g["val_accept"], "greedy_acc": g["val_acc"],
                      "greedy_chain_positions": g["val_chain_positions"]})
        metrics.add({"step": s, **r})
        log(f"train: step {s} val acc {[round(a, 3) for a in r['val_acc']]} simulated acceptance {r['val_al']:.3f}; "
            f"greedy chain: acceptance {[round(a, 3) for a in r['val_accept']]}, tau {r['val_tau']:.3f} at "
            f"K={len(r['val_accept'])}" + (f"; on the target's greedy answers: acceptance "
                                          f"{[round(a, 3) for a in r['greedy_accept']]}, tau {r['greedy_tau']:.3f} "
                                          f"over {r['greedy_rounds']} decoding rounds ({r['greedy_tau_all']:.3f} "
                                          f"averaged over every position)"
                                          if greedy is not None else ""))
        if r[best_key] > best.get(best_key, -1.0):
            best = {"by": best_key, "val_al": r["val_al"], "val_acc": r["val_acc"], "val_tau": r["val_tau"],
                    "val_accept": r["val_accept"], "step": s,
                    **({k: r[k] for k in ("greedy_tau", "greedy_accept", "greedy_rounds", "greedy_tau_all")}
                       if greedy is not None else {})}
            save_draft({"step": s, **r})
            if d.main:
                atomic_write_json(ckpt_dir(run) / "best.json", best)

    def do_save(s: int) -> None:
        save_checkpoint(run, ts, {"step": s, "epoch": s // spe, "best": best, "fingerprint": fp, "total": total},
                        main=d.main)
        d.barrier()

    if d.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(d.device)
    bar = progress(total=total, initial=step, desc="train", unit="step", **({} if d.main else {"disable": True}))
    t0, tok_done, tok_window, t_window = time.perf_counter(), 0, 0, time.perf_counter()
    warm_steps = min(5, max(0, (total - step) // 4))  # steady-state rate leaves out compilation and warm-up
    steady = [0.0, 0]
    per_epoch: dict[int, list] = {}  # epoch -> [seconds, tokens] of its steady steps
    clock = PhaseClock(d.device)  # where each steady step's time goes
    pending: list[tuple] = []  # a step whose statistics are still on their way to the host (LAG_STATS)
    last_done = [time.perf_counter()]  # when the last step's statistics were read (or the last eval/save ended)

    def finish(rec: tuple) -> None:
        """A step's bookkeeping once its statistics are on the host: rate, metrics row, progress bar."""
        nonlocal tok_done, tok_window, t_window
        s_, ep, lr_, host, ev, den, marks, warm = rec
        if ev is not None:
            ev.synchronize()  # waits for that step only, not for the one queued behind it
        vals = host.tolist()
        acc = [float(c) / dn for c, dn in zip(vals[1:1 + tc.ttt_steps], den)]
        ntok = int(vals[-2])
        tok_done += ntok
        now = time.perf_counter()
        dt, last_done[0] = now - last_done[0], now  # steps end one after another: the time between two ends
        if not warm:  # compilation and warm-up are not a step's usual time
            clock.fold(marks)  # the step's events are done: its statistics came after them
            steady[0] += dt
            steady[1] += ntok
            e_rate = per_epoch.setdefault(ep, [0.0, 0])
            e_rate[0] += dt
            e_rate[1] += ntok
        tok_window += ntok
        tps = tok_window / max(now - t_window, 1e-9)
        if now - t_window > 10:
            tok_window, t_window = 0, now
        row = {"step": s_, "epoch": ep, "loss": vals[0], "acc": acc, "lr": lr_, "grad_norm": vals[-1],
               "tokens": ntok, "tok_s": tps}
        metrics.add(row)
        # read here anyway (no wait of its own), and always before a validation or checkpoint writes anything
        for what, v in (("training loss", vals[0]), ("gradient norm", vals[-1])):
            if not math.isfinite(v):
                bar.close()
                raise EyasError(f"train: the {what} is {v} at step {s_} (lr {lr_:.3g}): the training diverged and "
                                f"stops here, writing nothing of it; {DIVERGED}")
        # the postfix without a refresh of its own: update() redraws at most every mininterval (a refresh per step
        # wrote every step of a 12,265-step run into the GPU harness' log, 1.6 MB)
        bar.set_postfix(loss=f"{row['loss']:.3f}", acc="/".join(f"{a:.2f}" for a in acc), tok_s=f"{tps:,.0f}",
                        refresh=False)
        bar.update(1)

    module.train()
    step_sleep = float(os.environ.get("EYAS_DEBUG_STEP_SLEEP", "0"))  # tests: make a run slow enough to kill
    stop = StopRequest(d.world == 1)
    mine = list(range(d.rank * tc.grad_accum, (d.rank + 1) * tc.grad_accum))  # this process's micro-batch slots
    with stop:
        while step < total:
            epoch, i = divmod(step, spe)
            slots = train.slot_bins(tc.seed + epoch, group)
            bins = [slot[i] for slot in slots]
            if isinstance(train.features, ReadAhead):  # this process's micro-batches of the next steps of the epoch
                train.features.ahead([slots[m][j] for j in range(i, min(i + 1 + train.features.workers, spe))
                                      for m in mine])
            counts = train.counts(bins, tc.ttt_steps)
            denom = [max(1, c) for c in counts]
            lr = tc.lr * lr_factor(step, total, tc.scheduler, tc.warmup_ratio)
            if lr_t is not None:
                lr_t.fill_(lr)
            else:
                for g in opt.param_groups:
                    g["lr"] = lr
            if accum:  # the micro-batches through one graph, the gradients summed, then the update's graph
                for m in mine:
                    t_ph = clock.start()
                    batch = train.batch(bins[m], d.device, multiple)
                    clock.stop("features", t_ph)
                    t_ph = clock.start()
                    if stepper is None:
                        stepper = AccumGraph(grad_body, clip_and_step, params, batch, tc.ttt_steps, d.all_sum,
                                             capture=d.device.type == "cuda")
                    if m == mine[0]:
                        stepper.begin()
                    stepper.add(batch, denom)
                    clock.stop("step", t_ph)
                t_ph = clock.start()
                stats = stepper.finish()
                clock.stop("step", t_ph)
            elif graphed:  # one process, one micro-batch: the whole step, a CUDA graph after its warm-up (stepgraph)
                t_ph = clock.start()
                batch = train.batch(bins[0], d.device, multiple)
                clock.stop("features", t_ph)
                if stepper is None:
                    stepper = StepGraph(graph_body, opt, batch, tc.ttt_steps, capture=d.device.type == "cuda")
                t_ph = clock.start()
                stats = stepper(batch, denom).clone()  # the graph's output is rewritten by the next replay
                clock.stop("step", t_ph)
            else:
                acc_t = torch.zeros(1 + tc.ttt_steps + 1, dtype=torch.float64, device=d.device)
                for a, m in enumerate(mine):
                    t_ph = clock.start()
                    batch = train.batch(bins[m], d.device, multiple)
                    clock.stop("features", t_ph)
                    t_ph = clock.start()
                    gen = step_generator(tc.seed, step, m, d.device) if tc.noise_std > 0 else None
                    last = a == len(mine) - 1
                    if sharded:  # gradients reduce-scattered after the last micro-batch only
                        model.set_requires_gradient_sync(last)
                    sync = contextlib.nullcontext() if (d.world == 1 or last or sharded) else model.no_sync()
                    with sync:
                        loss, st = forward_loss(batch, denom, gen)
                        clock.stop("forward", t_ph)
                        t_ph = clock.start()
                        (loss * d.world).backward()
                        clock.stop("backward", t_ph)
                    acc_t[0] += loss.detach().double()
                    acc_t[1:1 + tc.ttt_steps] += torch.stack(st.correct).double()
                    acc_t[-1] += batch.n_real
                t_ph = clock.start()
                gnorm = clip_and_step()
                opt.zero_grad(set_to_none=True)
                clock.stop("optimizer", t_ph)
                acc_t = d.all_sum(acc_t)
                stats = torch.cat([acc_t, gnorm.detach().reshape(1).to(acc_t)])
            step += 1
            # the step's statistics leave the device without a wait (a copy queued behind the step, with an event):
            # read one step later, so the host builds and queues the next step while the device runs this one
            host, ev = stats, None
            if stats.is_cuda:
                host = stats.to("cpu", non_blocking=True)  # into pinned memory: the copy runs on the stream
                ev = torch.cuda.Event()
                ev.record()
            rec = (step, epoch, lr, host, ev, denom, clock.take(), warm_steps > 0)
            warm_steps = max(0, warm_steps - 1)
            while pending:
                finish(pending.pop(0))
            stopping = stop.requested  # (read once: a signal after this line is seen at the next step)
            evals, saves = evals_due(step) or step == total, saves_due(step) or step == total or bool(stopping)
            # (a profiled run, with on_step, lags as well, as an unprofiled one does)
            if LAG_STATS and not (evals or saves or step_sleep):
                pending.append(rec)
            else:
                finish(rec)
            if evals:
                do_eval(step)
            if saves:
                do_save(step)
            if evals or saves:
                last_done[0] = time.perf_counter()  # the next step's time starts here, not at the last step's end
            if on_step is not None:
                on_step(step)
            if stopping and step < total:
                bar.close()
                log(f"train: stopped by {stopping} at step {step} of {total}; the checkpoint there is saved: run the "
                    f"same command again to go on")
                raise stop.interrupt(stopping)
            if step_sleep:
                time.sleep(step_sleep)
    bar.close()
    t_end = time.perf_counter()
    wall = t_end - t0
    peak = torch.cuda.max_memory_allocated(d.device) if d.device.type == "cuda" else 0
    if best["step"] < 0:  # no validation split: keep the last drafter
        save_draft({"step": step})
    elif d.main and not (run / "draft" / "model.safetensors").exists():
        restore_best_draft(run, drafter, best)
    metrics.close(run / "train" / "curves.png")
    summary = {"steps": step, "total_steps": total, "processes": d.world, "device": str(d.device),
               "tokens_trained": tok_done, "tok_s": tok_done / wall if tok_done else 0.0,
               "tok_s_steady": steady[1] / steady[0] if steady[1] else None,
               "epoch_tok_s": {str(e): round(n / t, 1) for e, (t, n) in sorted(per_epoch.items()) if t > 0},
               "feature_cache": train.features.cache_stats() if hasattr(train.features, "cache_stats") else None,
               "feature_warm": warm,
               "peak_memory": human_bytes(peak) if peak else None, "best": best,
               # times the caching allocator found no free block, returned its cache and asked the driver again
               # (each a device sync): a cause to rule out when the speed drifts with the GPU memory near full
               "cuda_alloc_retries": torch.cuda.memory_stats(d.device).get("num_alloc_retries", 0) if peak else None,
               "step_time_split": time_shares(clock.totals()), "loss": loss_state(d.device, tc.compile_loss),
               "step_graph": stepper.state if stepper is not None else (f"eager: {graph_why}" if graph_why else "off"),
               "drafter_step": drafter_state(drafter, d.device, tc.compile_drafter),
               "draft": str(run / "draft"), "curves": str(run / "train" / "curves.png"),
               # the target's weights this process holds: its head alone with stored features, else the whole model
               "target_held": "head" if hasattr(target, "bytes_held") else "whole",
               "target_bytes_held": target_bytes_held(target)}
    if d.main:
        atomic_write_json(run / "train" / "summary.json", summary)
        by = best.get("by", "val_al")
        pick = (f"the best, step {best['step']} by {by} {best[by]:.3f}" if best.get("step", -1) >= 0 and by in best
                else f"the last, step {step} (no validation split)")
        log(f"train: {step} steps in {wall:,.0f} s ({summary['tok_s']:,.0f} tok/s"
            + (f", peak memory {summary['peak_memory']}" if peak else "") + f"); {run / 'draft'} holds {pick}"
            + (f"; curves {run / 'train' / 'curves.png'}" if (run / "train" / "curves.png").exists() else ""))
    d.barrier()
    return summary
