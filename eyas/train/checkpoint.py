"""Checkpoints of a training: `ckpt/step-NNNNNNN/` (model.safetensors, optim.safetensors, state.json) and
`ckpt/latest.json`, written atomically; the fingerprint that ties a checkpoint to its run; a stop on a signal that
saves one first; the best drafter written again from its checkpoint."""
from __future__ import annotations

import os
import random
import shutil
import signal
import threading
from pathlib import Path

import safetensors.torch as sft
import torch

from ..config import KEYED_WHEN_CHANGED, Config
from ..data.prepare import tokens_key
from ..draft import Eagle3Drafter, save_drafter
from ..util import (EyasError, Terminated, atomic_write_json, log, read_json, refuse_non_finite, share, stable_hash,
                    writing)

# what to do about a training whose loss or weights stopped being finite numbers
DIVERGED = ("lower train.lr or set train.grad_clip (or check the features, if they hold NaN) and train again; "
            "the checkpoint and drafter kept are from before it")

# settings whose change makes a checkpoint belong to a different run
TRAJECTORY_KEYS = ["epochs", "lr", "weight_decay", "max_seq_len", "ttt_steps", "ttt_decay", "noise_std", "scheduler",
                   "warmup_ratio", "finetune_from", "batch_tokens", "grad_accum", "grad_clip", "seed",
                   "max_steps", "draft_intermediate_size", "init_head", "fc_init", "precision"]


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
    # torch.distributed.checkpoint is imported where FSDP needs it: importing it (with torch.distributed.tensor) takes
    # 1.4-1.9 s on a 2-core CPU, which every run of one process would pay for nothing

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
            sft.save_file(weights, str(tmp / "model.safetensors"))
            sft.save_file(tensors | rng, str(tmp / "optim.safetensors"))
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
    the draft vocabulary's size), so that `eyas train --draft-vocab-size N` does not choose the vocabulary again before
    refusing the checkpoint, leaving the run's vocabulary unlike its drafter and exports."""
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
        sd = sft.load_file(str(d / "model.safetensors"))
        ot = sft.load_file(str(d / "optim.safetensors"))
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


def restore_best_draft(run: Path, drafter: Eagle3Drafter, best: dict) -> None:
    """draft/ lost its weights after training wrote them (a file removed from the run): a resumed run that has no
    step left to train writes the best drafter again from its checkpoint, or says why it cannot, where it would
    otherwise end as finished with no drafter."""
    src = ckpt_dir(run) / f"step-{best['step']:07d}" / "model.safetensors"
    if not src.exists():
        raise EyasError(f"{run / 'draft'} lost the best drafter (step {best['step']}), and no checkpoint of that step "
                        f"is kept in {ckpt_dir(run)} to write it from; delete {ckpt_dir(run)} to train again")
    save_drafter(drafter, run / "draft", extra={"trained": {**best, "restored_from": str(src)}},
                 tensors=sft.load_file(str(src)))
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
    return {"train": trajectory(cfg), "target": target.identity(),
            "draft_vocab": int(draft_ids.numel()), "draft_vocab_hash": stable_hash(str(draft_ids.tolist())),
            "world": world, "tokens": tokens_key(cfg.out)}
