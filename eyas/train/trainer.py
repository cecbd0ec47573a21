"""The trainer: one training run over a run directory's tokens and vocabulary, step by step, with validation and
checkpoints (eyas/train/__init__.py tells how the processes share a step and what the run directory holds)."""
from __future__ import annotations

import contextlib
import math
import os
import random
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import Config, check_settings
from ..data.prepare import check_tokenize_settings, ensure_tokens, load_tokens, tokens_dir
from ..draft import save_drafter
from ..features import OnlineFeatures, feature_cache_budget, host_cache_budget, train_step_bytes
from ..rope import target_rope
from ..target_head import head_for_labels, load_for_training, target_bytes_held
from ..util import EyasError, PhaseClock, atomic_write_json, human_bytes, log, progress
from ..vocab import ensure_vocab, load_vocab
from .batches import Data, ReadAhead, make_features
from .checkpoint import (DIVERGED, StopRequest, TrainState, ckpt_dir, fingerprint, load_checkpoint,
                         precheck_checkpoint, restore_best_draft, save_checkpoint)
from .dist import dist_setup
from .drafter_init import initial_drafter, scale_fc_init
from .greedyval import greedy_val_set
from .metrics import Metrics, time_shares
from .stepgraph import AccumGraph, StepGraph, graph_unfit
from .steps import TTTModule, autocast, lr_factor, step_generator
from .ttt import StepStats, drafter_compile_on, drafter_state, loss_state, target_labels
from .validate import evaluate

# tests: train.cuda_graph's step (static buffers, the graphs' bodies) on a CPU, run eagerly; the variable lets a
# test under torchrun ask for it
GRAPH_ON_CPU = os.environ.get("EYAS_DEBUG_GRAPH_ON_CPU") == "1"
LAG_STATS = True  # read a step's statistics one step later, so the host never waits for the device between steps


def check_train_settings(cfg: Config) -> None:
    """Refuse train settings out of range, and the tokenize stage's (which `eyas train` runs when the run has no
    tokens), naming the key, before anything is tokenized or trained."""
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
