"""Export an eyas drafter for SGLang and vLLM (eyas.formats reads these formats back, and the original EAGLE layout).

What each engine reads (names, config keys, aux-layer id semantics) is written up, with the
engine file and version it was read from, in docs/serving.md. In short:

* SGLang (`LlamaForCausalLMEagle3`): HF-Llama-style config.json plus `draft_vocab_size`,
  `target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`; SGLang adds 1 to each
  configured id and captures the stream *entering* that decoder layer, so it gets eyas id - 1.
  Weights keep eyas' own names (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`).
* vLLM (speculators `eagle3` config): `transformer_layer_config` + top-level `draft_vocab_size`,
  `target_hidden_size`, norm flags, `eagle_aux_hidden_state_layer_ids` (used as-is: the stream
  entering that layer, = eyas' convention) and `speculators_config` (proposal method, verifier).
  Weights name the decoder layer `layers.0.*` instead of `midlayer.*`; a multi-layer drafter's later layers are
  `layers.<i>.*` in both eyas and vLLM (SGLang runs its later layers differently, so it gets one-layer drafters only).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from .aux_layers import FORMATS, check_aux_layers, check_drafter_aux_layers, check_format, engine_aux_ids
from .config import check_settings
from .draft import Eagle3Drafter, load_drafter
from .draft_config import (NON_FINITE, DraftConfig, check_checkpoint, check_fits, check_tensors, read_config,
                           shapes_of)
from .formats import VLLM_MODEL_TYPE
from .fresh_folder import fresh_folder
from .target_head import load_target_head
from .target_spec import load_spec
from .variants import LAYER_ARCHS, sglang_refusal, speculators_fields
from .serve_target import serve_target
from .util import EyasError, atomic_path, atomic_write_json, log, read_json, refuse_non_finite, writing

# SGLang's later draft layers (BasicDecoderLayer in llama_eagle3.py, commit 03d5a77) restart the residual from the
# previous layer's MLP output and norm with hidden_norm: another network than vLLM's (and eyas') plain Llama layers
SGLANG_MULTI_LAYER = ("a drafter of {n} decoder layers cannot be served by SGLang: its LlamaForCausalLMEagle3 runs "
                      "the layers after the first differently (they drop the residual stream), so it would not "
                      "compute what was trained; export it for vLLM (export.formats=[\"vllm\"])")
SGLANG_ARCH = "LlamaForCausalLMEagle3"
PRESET_ARCHS = {"smollm2": "LlamaForCausalLM", "qwen-coder-0.5b": "Qwen2ForCausalLM",
                "qwen-coder-1.5b": "Qwen2ForCausalLM", "tiny": "LlamaForCausalLM"}


# ----------------------------------------------------------------------------- export

def _llama_fields(c: DraftConfig, dtype: torch.dtype) -> dict:
    """The decoder-layer fields both engines build the draft layer from, written explicitly."""
    return {
        "model_type": c.layer_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.num_hidden_layers,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        # rope_type and that kind's settings as both engines' get_rope reads them (and transformers 4 and 5)
        "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.target_vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }


def export_drafter(drafter: Eagle3Drafter, out_dir: str | Path, fmt: str, target_name_or_path: str,
                   include_embeddings: bool = False, num_speculative_tokens: int = 3,
                   verifier_architectures: list[str] | None = None) -> Path:
    """Write `drafter` in an engine's format: out_dir/config.json + out_dir/model.safetensors, and nothing else
    (the folder is written anew and swapped in whole: see eyas.fresh_folder)."""
    from safetensors.torch import save_file

    check_format(fmt)
    if num_speculative_tokens < 1:
        raise EyasError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    c = drafter.config
    if fmt == "sglang" and c.num_hidden_layers > 1:
        raise EyasError(SGLANG_MULTI_LAYER.format(n=c.num_hidden_layers))
    if fmt == "sglang" and sglang_refusal(c):
        raise EyasError(f"this drafter cannot be served by SGLang: {sglang_refusal(c)}")
    sd = drafter.trainable_state_dict(include_embeddings=include_embeddings)
    check_tensors(shapes_of(sd), c, "drafter", include_embeddings)
    n_layers = c.target_num_layers or int(c.target.get("num_layers", 0) or 0)
    ids = engine_aux_ids(list(c.aux_layers), fmt, n_layers)
    dtype = sd["fc.weight"].dtype
    # serve_target: the target to serve the drafter with (a hub id, or the folder of the weights it trained on)
    eyas_meta = {"format": fmt, "aux_layers": list(c.aux_layers), "target": c.target,
                 "target_num_layers": n_layers, "serve_target": target_name_or_path}
    if fmt == "sglang":
        tensors = dict(sd)
        config = {"architectures": [SGLANG_ARCH], **_llama_fields(c, dtype),
                  "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
                  "eyas": eyas_meta}
    else:
        tensors = {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v for k, v in sd.items()}
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": VLLM_MODEL_TYPE,
            "transformer_layer_config": {**_llama_fields(c, dtype), "architectures": [LAYER_ARCHS[c.layer_type]]},
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            # the variants' flags, each written: vLLM's speculators adapter reads an absent norm_before_residual
            # as true (eyas.variants)
            **speculators_fields(c),
            "embed_requires_grad": False,
            "eagle_aux_hidden_state_layer_ids": ids,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target_name_or_path,
                             "architectures": list(verifier_architectures or ["LlamaForCausalLM"])},
            },
            "eyas": eyas_meta,
        }
    out = Path(out_dir)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    refuse_non_finite(tensors, f"{out / 'model.safetensors'}: not written", NON_FINITE)
    needed = sum(v.numel() * v.element_size() for v in tensors.values())
    with fresh_folder(out, _check_replaceable) as folder:
        # (atomic_path also gives it a plain file's mode; a full disk is named as the export's file)
        with atomic_path(folder / "model.safetensors", needed) as tmp, writing(out / "model.safetensors", needed):
            save_file(tensors, str(tmp), metadata={"format": "pt", "eyas_export": fmt})
        atomic_write_json(folder / "config.json", config)
    return out


# ----------------------------------------------------------------------------- refusing a folder

def _check_replaceable(out: Path) -> None:
    """Refuse to write over something that is not a drafter export: the export replaces the whole folder."""
    if not out.exists():
        return
    if not out.is_dir():
        raise EyasError(f"{out}: exists and is not a folder; the export writes a folder there: move it away, or "
                        f"export elsewhere")
    try:
        raw = read_config(out / "config.json") if (out / "config.json").is_file() else {}
    except EyasError:  # a damaged earlier export: judged by its files below
        raw = {}
    if isinstance(raw.get("eyas"), dict) and raw["eyas"].get("format") in FORMATS:
        return
    foreign = sorted(p.name for p in out.iterdir() if not (p.is_file() and p.suffix in (".json", ".safetensors")))
    if foreign:
        raise EyasError(f"{out}: holds {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}, which is not a "
                        f"drafter export, and the export replaces the whole folder: move them away, or export "
                        f"elsewhere")


def verifier_architectures(target_cfg) -> list[str] | None:
    """The target's transformers architecture for the export's verifier metadata: known for the
    presets, read from config.json for an HF folder, else unknown (None)."""
    if target_cfg.name in PRESET_ARCHS:
        return [PRESET_ARCHS[target_cfg.name]]
    cfg_file = Path(target_cfg.name).expanduser() / "config.json"
    if cfg_file.is_file():
        raw = read_json(cfg_file)
        archs = raw.get("architectures") if isinstance(raw, dict) else None
        if isinstance(archs, list) and archs:
            return [str(a) for a in archs]
    return None


def check_export_settings(cfg) -> None:
    """Refuse export formats eyas does not write, and a draft length the vLLM config cannot propose (the pipeline
    checks this before its first stage)."""
    if not cfg.export.formats:
        raise EyasError("export.formats is empty: name at least one of sglang, vllm")
    for f in cfg.export.formats:
        check_format(f)
    # eval.k is written as the vLLM config's speculative_tokens (vLLM's num_speculative_tokens)
    check_settings(cfg, (("eval.k", cfg.eval.k >= 1, "at least 1 (the exported vLLM config proposes that many "
                                                       "draft tokens per target forward)"),))


def export_target(tcfg, c: DraftConfig, cfg_file: Path) -> SimpleNamespace:
    """The target named by `tcfg` as check_fits reads it (name, hidden size, vocabulary, layers, aux layers), from
    its config alone: the export needs no weights of it (a large target would take minutes to load). Its aux layers
    are the user's target.aux_layers where given, else the drafter's own (`c`, from `cfg_file`), which the export
    writes for the engines to capture."""
    spec = load_spec(replace(tcfg, aux_layers=[]))  # the aux layers are checked below, against the drafter's too
    t = SimpleNamespace(name=tcfg.name, hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
                        num_layers=spec.num_layers, aux_layers=[])
    if tcfg.aux_layers:
        t.aux_layers = check_aux_layers(list(tcfg.aux_layers), t.num_layers)
    else:
        t.aux_layers = check_drafter_aux_layers(list(c.aux_layers), cfg_file, t, field="aux_layers")
    return t


def run_export(cfg) -> dict:
    """`eyas export`: <run>/draft -> <run>/export/{sglang,vllm}/."""
    run = Path(cfg.out)
    check_export_settings(cfg)
    draft_dir = run / "draft"
    c = check_checkpoint(draft_dir)
    # the drafter must fit the target it is exported for, which the engines will feed it: the export names that
    # target as the verifier, and a drafter of another width or vocabulary would load there and fail, or run wrong
    fit = export_target(cfg.target, c, draft_dir / "config.json")
    check_fits(c, fit, str(draft_dir))
    trained_for = c.target.get("name")
    if trained_for and trained_for != cfg.target.name:
        log(f"export: the drafter in {draft_dir} was trained with target '{trained_for}'; exporting it for "
            f"'{cfg.target.name}', whose shapes it fits")
    formats = list(cfg.export.formats)
    if c.num_hidden_layers > 1 and "sglang" in formats:  # the run's default asks for both formats
        log("export: skipping sglang, " + SGLANG_MULTI_LAYER.format(n=c.num_hidden_layers))
        formats = [f for f in formats if f != "sglang"]
    if sglang_refusal(c) and "sglang" in formats:
        log("export: skipping sglang, " + sglang_refusal(c))
        formats = [f for f in formats if f != "sglang"]
    for f in formats:  # every layer the engines would capture exists in this target, before anything is written
        engine_aux_ids(list(c.aux_layers), f, fit.num_layers)
    target = None
    if cfg.export.include_embeddings:  # the embedding read from the target's files, no decoder layer
        target = load_target_head(replace(cfg.target, aux_layers=list(fit.aux_layers)))
    drafter = load_drafter(draft_dir, target=target)
    serve = serve_target(cfg, run)  # <run>/export/target for a target eyas dequantized, else the target's name
    archs = verifier_architectures(replace(cfg.target, name=serve) if Path(serve).is_dir() else cfg.target)
    out = {}
    for f in formats:
        p = export_drafter(drafter, run / "export" / f, f, serve,
                           include_embeddings=cfg.export.include_embeddings, num_speculative_tokens=cfg.eval.k,
                           verifier_architectures=archs)
        log(f"exported the drafter for {f}: {p}")
        out[f] = str(p)
    for f in FORMATS:  # an export this call did not rewrite may hold an earlier drafter: said, not removed
        if f not in out and (run / "export" / f / "config.json").exists():
            why = "not in export.formats" if f not in cfg.export.formats else f"{f} does not serve this drafter"
            log(f"export: {run / 'export' / f} is an earlier export, not written this time ({why}); it may hold an "
                f"earlier drafter than {draft_dir}")
    return {"formats": list(out), "export": out, "serve_target": serve, "aux_layers": list(drafter.config.aux_layers),
            "engine_aux_ids": {f: engine_aux_ids(list(drafter.config.aux_layers), f,
                                                 drafter.config.target_num_layers) for f in formats}}
