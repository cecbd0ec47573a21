"""The trainer: one training run over a run directory that has its tokens and vocabulary, from the last checkpoint
(or step 0) to the end, validating and saving on the way (eyas/train/__init__.py tells how the processes share a
step and what the run directory holds)."""
from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..config import Config
from ..draft import save_drafter
from ..target_head import head_for_labels, target_bytes_held
from ..util import EyasError, PhaseClock, atomic_write_json, human_bytes, log, progress
from ..vocab import load_vocab
from .batches import ReadAhead
from .checkpoint import (DIVERGED, StopRequest, TrainState, ckpt_dir, fingerprint, load_checkpoint,
                         restore_best_draft, save_checkpoint)
from .dist import Dist
from .drafter_init import initial_drafter, scale_fc_init
from .metrics import Metrics, StepLog, time_shares
from .splits import load_splits, warm_features
from .stepgraph import AccumGraph, StepGraph, graph_unfit
from .steps import TTTModule, autocast, lr_factor, step_generator
from .ttt import StepStats, drafter_compile_on, drafter_state, loss_state, target_labels
from .validate import evaluate

# tests: train.cuda_graph's step (static buffers, the graphs' bodies) on a CPU, run eagerly; the variable lets a
# test under torchrun ask for it
GRAPH_ON_CPU = os.environ.get("EYAS_DEBUG_GRAPH_ON_CPU") == "1"
LAG_STATS = True  # read a step's statistics one step later, so the host never waits for the device between steps


class Trainer:
    """One training run on this process: made (splits, drafter, optimizer, the checkpoint resumed) before `fit` trains.
    The step runs one of three ways: eager (plain, DDP or FSDP2), one CUDA graph (`StepGraph`, one micro-batch a
    step) or two (`AccumGraph`, several)."""

    def __init__(self, cfg: Config, d: Dist, target):
        tc = cfg.train
        self.cfg, self.tc, self.d, self.target, self.run = cfg, tc, d, target, Path(cfg.out)
        self.multiple = 128 if d.device.type == "cuda" else 1
        self.group = d.world * tc.grad_accum  # micro-batch slots per optimizer step; slot j belongs to rank j // A
        self.mine = list(range(d.rank * tc.grad_accum, (d.rank + 1) * tc.grad_accum))  # this process's slots
        draft_ids = load_vocab(self.run, target)
        splits = load_splits(cfg, d, target, draft_ids, min(tc.max_seq_len, tc.batch_tokens))
        self.train, self.val, self.greedy = splits.train, splits.val, splits.greedy
        self.compiled = drafter_compile_on(d.device, tc.compile_drafter)
        for split in splits.all():  # the compiled step is built for one batch shape: every batch padded to it
            split.fixed = self.compiled
        self.best_key = tc.best_by if tc.best_by != "auto" else ("greedy_tau" if self.greedy is not None else "val_al")
        if self.best_key == "greedy_tau" and self.greedy is None and self.val is not None:
            log("train: WARNING: train.best_by=greedy_tau, but there are no greedy answers to score: the best "
                "checkpoint is picked by val_al")
            self.best_key = "val_al"
        self.warm = warm_features(cfg, d, self.train, self.group) if splits.cached else None
        self._make_drafter(draft_ids)
        self._parallelize()
        self._plan()

    # ---------------------------------------------------------------------------------------------- setup

    def _make_drafter(self, draft_ids: torch.Tensor) -> None:
        """The drafter to train, its fc scaled to the aux layers' RMS where asked, and the labels' head."""
        cfg, tc, d, train = self.cfg, self.tc, self.d, self.train
        torch.manual_seed(tc.seed)
        drafter = initial_drafter(cfg, self.target, draft_ids).to(d.device)
        drafter.float()
        resuming = (ckpt_dir(self.run) / "latest.json").exists()  # its weights replace any init
        # same batches on every rank (DDP also broadcasts)
        normed_fc_input = drafter.config.norm_before_fc or drafter.config.fc_norm  # each aux state already at scale 1
        if not tc.finetune_from and tc.fc_init == "scaled" and not resuming and not normed_fc_input:
            first = train.slot_bins(tc.seed, self.group)[0][:2]  # slot 0 (rank 0) owns these sequences
            rms = scale_fc_init(drafter, [train.batch(b, d.device, self.multiple) for b in first])
            log(f"train: fc init scaled by the aux layers' RMS {rms} (layers {drafter.config.aux_layers})")
        drafter.embed_tokens.weight.requires_grad_(False)
        self.drafter, self.draft_ids = drafter, drafter.draft_ids
        self.lm_head = head_for_labels(self.target, self.draft_ids,
                                       [train.features, self.val.features if self.val else None])

    def _parallelize(self) -> None:
        """How the step runs (eager, DDP, FSDP2, CUDA graphs), and the optimizer over the trainable parameters."""
        tc, d, drafter = self.tc, self.d, self.drafter
        self.module = self.model = TTTModule(drafter, tc.compile_loss, tc.compile_drafter)
        self.sharded = d.world > 1 and tc.parallel == "fsdp"
        self.graph_why = graph_unfit(d.device, d.world, tc.grad_accum, tc.noise_std, self.compiled, self.sharded) \
            if tc.cuda_graph and not (GRAPH_ON_CPU and d.device.type == "cpu") else ""
        self.graphed = tc.cuda_graph and not self.graph_why
        if self.graph_why and d.device.type == "cuda":
            log(f"train: train.cuda_graph is on, but the step runs without a graph: {self.graph_why}")
        if self.sharded:  # FSDP2: one group, the frozen embedding left whole on every process
            # (imported here: torch.distributed.fsdp takes about 1.3 s to import, for runs of several processes only)
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.module, ignored_params={drafter.embed_tokens.weight})
        elif d.world > 1 and not self.graphed:
            self.model = DistributedDataParallel(
                self.module, device_ids=[d.device.index] if d.device.type == "cuda" else None, broadcast_buffers=False)
        self.params = [p for p in drafter.parameters() if p.requires_grad]  # sharded ones under FSDP
        if self.graphed and d.world > 1:  # AccumGraph sums the gradients itself: the processes start from rank 0's
            with torch.no_grad():
                for p in self.params:
                    dist.broadcast(p, 0)
        # a graph reads the learning rate from the device, and AdamW must allow the capture
        self.lr_t = torch.tensor(tc.lr, device=d.device) if self.graphed and d.device.type == "cuda" else None
        self.opt = torch.optim.AdamW(self.params, lr=tc.lr if self.lr_t is None else self.lr_t, betas=(0.9, 0.95),
                                     weight_decay=tc.weight_decay,
                                     **({"fused": True} if d.device.type == "cuda" and not self.sharded else {}),
                                     **({"capturable": True} if self.lr_t is not None else {}))
        self.ts = TrainState(drafter, self.opt, self.module if self.sharded else None)
        # several micro-batches a step (processes x grad_accum): `stepgraph.AccumGraph`, the gradients summed between
        # its two graphs; one: the whole step as one graph (`StepGraph`)
        self.accum = self.graphed and self.group > 1
        if self.accum and d.device.type == "cuda":
            log(f"train: {self.group} micro-batches a step ({d.world} processes x grad_accum {tc.grad_accum}): each "
                f"one's forward and backward, then the update, run as CUDA graphs, the gradients summed between them")
        self.stepper = None  # the StepGraph or AccumGraph, made at the first step

    def _plan(self) -> None:
        """The steps an epoch and the run take, and where the run starts: step 0 or its last checkpoint."""
        tc, d, train = self.tc, self.d, self.train
        self.spe = min(len(b) for e in range(tc.epochs) for b in train.slot_bins(tc.seed + e, self.group))
        n_bins = sum(len(b) for b in train.slot_bins(tc.seed, self.group))
        if self.spe == 0:
            raise EyasError(f"the training split packs into {n_bins} micro-batches of {tc.batch_tokens} tokens, fewer "
                            f"than the {self.group} one optimizer step needs ({d.world} processes x grad_accum "
                            f"{tc.grad_accum}); lower --batch-tokens or --grad-accum")
        self.total = tc.epochs * self.spe
        if tc.max_steps:
            self.total = min(self.total, tc.max_steps)
        self.fp = fingerprint(self.cfg, self.target, self.draft_ids, d.world)
        state = load_checkpoint(self.run, self.ts, self.fp)
        if self.lr_t is not None:  # the checkpoint's groups hold plain numbers (plain_group)
            for g in self.opt.param_groups:
                g["lr"], g["capturable"] = self.lr_t, True
        self.step, self.best = 0, {"val_al": -1.0, "step": -1}
        if state is not None:
            self.step, self.best = state["step"], state["best"]
            log(f"train: resuming from step {self.step} of {self.total}")
            if self.best.get("step", -1) >= 0 and self.best.get("by", "val_al") != self.best_key:
                log(f"train: the best checkpoint so far (step {self.best['step']}) was picked by "
                    f"{self.best.get('by', 'val_al')}; from here on by {self.best_key}")
        self.metrics = Metrics(self.run, d.main, self.step)
        self.decay = [tc.ttt_decay ** j for j in range(tc.ttt_steps)]
        train.fixed = self.graphed or self.compiled  # a graph too replays one batch shape
        n_params = sum(p.numel() for p in self.params)
        log(f"train: {len(train.tokens)} sequences in {n_bins} micro-batches of <= {tc.batch_tokens} tokens, "
            f"{self.spe} steps/epoch x {tc.epochs} epochs -> {self.total} steps on {d.world} x {d.device.type}; "
            f"drafter {n_params / 1e6:.1f}M trainable parameters, draft vocab {self.draft_ids.numel()}")

    # ---------------------------------------------------------------------------------------------- step

    def forward_loss(self, batch, denom, gen, cache: bool = True):
        """The micro-batch's weighted TTT loss and step statistics (denom: the step's loss-masked positions, numbers
        or, for a graph, a device tensor)."""
        tc = self.tc
        with autocast(self.d.device, tc.precision, cache):
            labels = target_labels(batch.final, self.lm_head, self.draft_ids, top=batch.top,
                                   temperature=tc.label_temperature)
            st: StepStats = self.model(batch, labels, tc.ttt_steps, tc.noise_std, gen, loss_path=tc.loss_path)
        return sum(self.decay[j] * st.loss_sum[j] / denom[j] for j in range(tc.ttt_steps)), st

    def clip_and_step(self) -> torch.Tensor:
        """Gradient clipping and the optimizer's step; the gradients' norm before clipping."""
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, self.tc.grad_clip if self.tc.grad_clip > 0 else float("inf"))
        if hasattr(gnorm, "full_tensor"):  # a DTensor under FSDP
            gnorm = gnorm.full_tensor()
        self.opt.step()
        return gnorm

    def grad_body(self, batch, denom) -> torch.Tensor:
        """One micro-batch's forward and backward, as a graph captures it: the statistics the eager step gathers
        (loss, right guesses per TTT step, real tokens) in one tensor."""
        loss, st = self.forward_loss(batch, denom, None, cache=False)
        loss.backward()
        return torch.cat([loss.detach().double().reshape(1), torch.stack(st.correct).double(),
                          torch.as_tensor(batch.n_real, device=self.d.device).double().reshape(1)])

    def graph_body(self, batch, denom) -> torch.Tensor:
        """One process's whole step on one micro-batch, as `stepgraph.StepGraph` captures it: `grad_body`'s
        statistics and the gradient norm in one tensor."""
        stats = self.grad_body(batch, denom)
        return torch.cat([stats, self.clip_and_step().detach().double().reshape(1)])

    def _batch(self, idx: list[int]):
        t_ph = self.clock.start()
        batch = self.train.batch(idx, self.d.device, self.multiple)
        self.clock.stop("features", t_ph)
        return batch

    def _accum_step(self, bins, denom) -> torch.Tensor:
        """The micro-batches through one graph, the gradients summed, then the update's graph."""
        clock = self.clock
        for m in self.mine:
            batch = self._batch(bins[m])
            t_ph = clock.start()
            if self.stepper is None:
                self.stepper = AccumGraph(self.grad_body, self.clip_and_step, self.params, batch, self.tc.ttt_steps,
                                          self.d.all_sum, capture=self.d.device.type == "cuda")
            if m == self.mine[0]:
                self.stepper.begin()
            self.stepper.add(batch, denom)
            clock.stop("step", t_ph)
        t_ph = clock.start()
        stats = self.stepper.finish()
        clock.stop("step", t_ph)
        return stats

    def _graph_step(self, bins, denom) -> torch.Tensor:
        """One process, one micro-batch: the whole step, a CUDA graph after its warm-up (stepgraph)."""
        batch = self._batch(bins[0])
        if self.stepper is None:
            self.stepper = StepGraph(self.graph_body, self.opt, batch, self.tc.ttt_steps,
                                     capture=self.d.device.type == "cuda")
        t_ph = self.clock.start()
        stats = self.stepper(batch, denom).clone()  # the graph's output is rewritten by the next replay
        self.clock.stop("step", t_ph)
        return stats

    def _eager_step(self, bins, denom) -> torch.Tensor:
        """Each of this process's micro-batches forward and backward (the gradients synced after the last), then the
        update."""
        tc, d, clock = self.tc, self.d, self.clock
        acc_t = torch.zeros(1 + tc.ttt_steps + 1, dtype=torch.float64, device=d.device)
        for a, m in enumerate(self.mine):
            batch = self._batch(bins[m])
            t_ph = clock.start()
            gen = step_generator(tc.seed, self.step, m, d.device) if tc.noise_std > 0 else None
            last = a == len(self.mine) - 1
            if self.sharded:  # gradients reduce-scattered after the last micro-batch only
                self.model.set_requires_gradient_sync(last)
            sync = contextlib.nullcontext() if (d.world == 1 or last or self.sharded) else self.model.no_sync()
            with sync:
                loss, st = self.forward_loss(batch, denom, gen)
                clock.stop("forward", t_ph)
                t_ph = clock.start()
                (loss * d.world).backward()
                clock.stop("backward", t_ph)
            acc_t[0] += loss.detach().double()
            acc_t[1:1 + tc.ttt_steps] += torch.stack(st.correct).double()
            acc_t[-1] += batch.n_real
        t_ph = clock.start()
        gnorm = self.clip_and_step()
        self.opt.zero_grad(set_to_none=True)
        clock.stop("optimizer", t_ph)
        acc_t = d.all_sum(acc_t)
        return torch.cat([acc_t, gnorm.detach().reshape(1).to(acc_t)])

    def train_step(self, warm: bool) -> tuple:
        """One optimizer step; its record for StepLog.finish, the statistics on their way to the host."""
        tc, train = self.tc, self.train
        epoch, i = divmod(self.step, self.spe)
        slots = train.slot_bins(tc.seed + epoch, self.group)
        bins = [slot[i] for slot in slots]
        if isinstance(train.features, ReadAhead):  # this process's micro-batches of the next steps of the epoch
            train.features.ahead([slots[m][j] for j in range(i, min(i + 1 + train.features.workers, self.spe))
                                  for m in self.mine])
        denom = [max(1, c) for c in train.counts(bins, tc.ttt_steps)]
        lr = tc.lr * lr_factor(self.step, self.total, tc.scheduler, tc.warmup_ratio)
        if self.lr_t is not None:
            self.lr_t.fill_(lr)
        else:
            for g in self.opt.param_groups:
                g["lr"] = lr
        step_fn = self._accum_step if self.accum else self._graph_step if self.graphed else self._eager_step
        stats = step_fn(bins, denom)
        self.step += 1
        # the step's statistics leave the device without a wait (a copy queued behind the step, with an event):
        # read one step later, so the host builds and queues the next step while the device runs this one
        host, ev = stats, None
        if stats.is_cuda:
            host = stats.to("cpu", non_blocking=True)  # into pinned memory: the copy runs on the stream
            ev = torch.cuda.Event()
            ev.record()
        return self.step, epoch, lr, host, ev, denom, self.clock.take(), warm

    # ------------------------------------------------------------------------------- validate and checkpoint

    def save_draft(self, trained: dict) -> None:
        """The drafter into run/draft: every process calls it (gathering the weights is a collective under FSDP),
        rank 0 writes."""
        weights = self.ts.weights() if self.sharded else None
        if self.d.main:
            save_drafter(self.drafter, self.run / "draft", extra={"trained": trained}, tensors=weights)

    def _scores(self, s: int) -> dict:
        """The validation's scores at step `s`, with those on the target's greedy answers when there are some."""
        tc, d = self.tc, self.d
        args = (self.module, self.drafter)
        r = evaluate(*args, self.val, self.lm_head, tc.ttt_steps, d, self.multiple, tc.precision, self.sharded)
        if not math.isfinite(r["val_loss"]):  # every process sees the same sum
            self.bar.close()
            raise EyasError(f"train: the validation loss is {r['val_loss']} at step {s}: the training diverged and "
                            f"stops here, writing nothing of it; {DIVERGED}")
        if self.greedy is not None:
            g = evaluate(*args, self.greedy, self.lm_head, tc.ttt_steps, d, self.multiple, tc.precision, self.sharded,
                         rounds=True)
            r.update({"greedy_tau": g["round_tau"], "greedy_accept": g["round_accept"], "greedy_rounds": g["rounds"],
                      "greedy_tau_all": g["val_tau"], "greedy_accept_all": g["val_accept"], "greedy_acc": g["val_acc"],
                      "greedy_chain_positions": g["val_chain_positions"]})
        return r

    def validate(self, s: int) -> None:
        """Score the drafter at step `s`; the best so far (by train.best_by) goes to run/draft and ckpt/best.json."""
        if self.val is None:
            return
        r = self._scores(s)
        greedy = self.greedy is not None
        self.metrics.add({"step": s, **r})
        log(f"train: step {s} val acc {[round(a, 3) for a in r['val_acc']]} simulated acceptance {r['val_al']:.3f}; "
            f"greedy chain: acceptance {[round(a, 3) for a in r['val_accept']]}, tau {r['val_tau']:.3f} at "
            f"K={len(r['val_accept'])}" + (f"; on the target's greedy answers: acceptance "
                                          f"{[round(a, 3) for a in r['greedy_accept']]}, tau {r['greedy_tau']:.3f} "
                                          f"over {r['greedy_rounds']} decoding rounds ({r['greedy_tau_all']:.3f} "
                                          f"averaged over every position)" if greedy else ""))
        if r[self.best_key] > self.best.get(self.best_key, -1.0):
            self.best = {"by": self.best_key, "val_al": r["val_al"], "val_acc": r["val_acc"], "val_tau": r["val_tau"],
                         "val_accept": r["val_accept"], "step": s,
                         **({k: r[k] for k in ("greedy_tau", "greedy_accept", "greedy_rounds", "greedy_tau_all")}
                            if greedy else {})}
            self.save_draft({"step": s, **r})
            if self.d.main:
                atomic_write_json(ckpt_dir(self.run) / "best.json", self.best)

    def checkpoint(self, s: int) -> None:
        save_checkpoint(self.run, self.ts, {"step": s, "epoch": s // self.spe, "best": self.best,
                                            "fingerprint": self.fp, "total": self.total}, main=self.d.main)
        self.d.barrier()

    # ---------------------------------------------------------------------------------------------- fit

    def _due(self, s: int, every: int) -> bool:
        return s % (every or self.spe) == 0  # 0: at each epoch's end

    def fit(self, on_step=None) -> dict:
        """Train to the last step; the run's summary (also train/summary.json). on_step: called with the step number
        after each optimizer step."""
        tc, d = self.tc, self.d
        if d.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d.device)
        self.bar = progress(total=self.total, initial=self.step, desc="train", unit="step",
                            **({} if d.main else {"disable": True}))
        self.clock = PhaseClock(d.device)  # where each steady step's time goes
        steps = StepLog(self.metrics, self.bar, self.clock, tc.ttt_steps)
        t0 = time.perf_counter()
        warm_steps = min(5, max(0, (self.total - self.step) // 4))  # steady-state rate leaves out compilation, warm-up
        pending: list[tuple] = []  # a step whose statistics are still on their way to the host (LAG_STATS)
        self.module.train()
        step_sleep = float(os.environ.get("EYAS_DEBUG_STEP_SLEEP", "0"))  # tests: make a run slow enough to kill
        stop = StopRequest(d.world == 1)
        with stop:
            while self.step < self.total:
                rec = self.train_step(warm_steps > 0)
                step = self.step
                warm_steps = max(0, warm_steps - 1)
                while pending:
                    steps.finish(pending.pop(0))
                stopping = stop.requested  # (read once: a signal after this line is seen at the next step)
                evals = self._due(step, tc.eval_every) or step == self.total
                saves = self._due(step, tc.save_every) or step == self.total or bool(stopping)
                # (a profiled run, with on_step, lags as well, as an unprofiled one does)
                if LAG_STATS and not (evals or saves or step_sleep):
                    pending.append(rec)
                else:
                    steps.finish(rec)
                if evals:
                    self.validate(step)
                if saves:
                    self.checkpoint(step)
                if evals or saves:
                    steps.last_done = time.perf_counter()  # the next step's time starts here, not at the last's end
                if on_step is not None:
                    on_step(step)
                if stopping and step < self.total:
                    self.bar.close()
                    log(f"train: stopped by {stopping} at step {step} of {self.total}; the checkpoint there is saved: "
                        f"run the same command again to go on")
                    raise stop.interrupt(stopping)
                if step_sleep:
                    time.sleep(step_sleep)
        self.bar.close()
        return self._summary(steps, time.perf_counter() - t0)

    def _summary(self, steps: StepLog, wall: float) -> dict:
        """The drafter kept (the best, or the last without a validation split), curves.png and train/summary.json."""
        d, run, best, step = self.d, self.run, self.best, self.step
        peak = torch.cuda.max_memory_allocated(d.device) if d.device.type == "cuda" else 0
        if best["step"] < 0:  # no validation split: keep the last drafter
            self.save_draft({"step": step})
        elif d.main and not (run / "draft" / "model.safetensors").exists():
            restore_best_draft(run, self.drafter, best)
        self.metrics.close(run / "train" / "curves.png")
        features = self.train.features
        summary = {"steps": step, "total_steps": self.total, "processes": d.world, "device": str(d.device),
                   **steps.rates(wall),
                   "feature_cache": features.cache_stats() if hasattr(features, "cache_stats") else None,
                   "feature_warm": self.warm,
                   "peak_memory": human_bytes(peak) if peak else None, "best": best,
                   # times the caching allocator found no free block, returned its cache and asked the driver again
                   # (each a device sync): a cause to rule out when the speed drifts with the GPU memory near full
                   "cuda_alloc_retries": torch.cuda.memory_stats(d.device).get("num_alloc_retries", 0) if peak else None,
                   "step_time_split": time_shares(self.clock.totals()),
                   "loss": loss_state(d.device, self.tc.compile_loss),
                   "step_graph": self.stepper.state if self.stepper is not None
                   else (f"eager: {self.graph_why}" if self.graph_why else "off"),
                   "drafter_step": drafter_state(self.drafter, d.device, self.tc.compile_drafter),
                   "draft": str(run / "draft"), "curves": str(run / "train" / "curves.png"),
                   # the target's weights this process holds: its head alone with stored features, else the whole
                   "target_held": "head" if hasattr(self.target, "bytes_held") else "whole",
                   "target_bytes_held": target_bytes_held(self.target)}
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
