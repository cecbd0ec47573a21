"""The train stage as `eyas train` and the pipeline run it: the settings checked, the processes and the target set
up, what earlier stages make (tokens, the draft vocabulary) made where a standalone `eyas train` finds none, then the
trainer."""
from __future__ import annotations

import random
from dataclasses import replace

import torch

from ..config import Config, check_settings
from ..data.prepare import check_tokenize_settings, ensure_tokens
from ..rope import target_rope
from ..target_head import load_for_training
from ..vocab import ensure_vocab
from .checkpoint import precheck_checkpoint
from .dist import dist_setup
from .trainer import Trainer


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
    """Train the drafter of run directory `cfg.out` and write the best drafter to `<run>/draft/`; the run's summary.
    The run's tokens and vocabulary are made first where they are missing (ensure_tokens, ensure_vocab: the pipeline
    has made them by then; a standalone `eyas train` is told when they are made), after a checkpoint of another run
    is refused. on_step: called with the step number after each optimizer step (a profiler's schedule,
    bench/bench_train.py --profile-steps)."""
    tc = cfg.train
    check_train_settings(cfg)
    d = dist_setup(cfg.target.device)
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
    return Trainer(cfg, d, target).fit(on_step)
