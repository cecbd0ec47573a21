"""The drafter a training starts from: a fresh one (its head from the target's, fc scaled to the aux layers), or the
one --finetune-from names."""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import Config
from ..draft import NON_FINITE, DraftConfig, Eagle3Drafter, build_drafter, check_fits, read_safetensors
from ..formats import import_drafter
from ..target_head import HeadRows, draft_rows
from ..util import EyasError, log, read_json, refuse_non_finite


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
    state = read_json(p / "state.json")
    c = DraftConfig.from_dict(state["draft_config"])
    check_fits(c, target, str(p))
    d = Eagle3Drafter(c, target.embed_tokens().weight.detach().float())
    weights = read_safetensors(p / "model.safetensors")
    refuse_non_finite(weights, str(p / "model.safetensors"), NON_FINITE)
    d.load_state_dict(weights, strict=False)
    return d
