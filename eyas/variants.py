"""Drafter variants of the speculators format (its Eagle3SpeculatorConfig flags and decoder-layer type): what
DraftConfig holds, the tensors each adds, and how each engine format says them.

* norm_before_residual: the first layer's residual is hidden_norm(h) instead of h.
* norm_before_fc: one RMSNorm (`input_norm`) over concat(aux) before fc (gpt-oss style).
* fc_norm: one RMSNorm per aux state (`fc_norm.<i>`) before the concat and fc; not with norm_before_fc.
* norm_output: the state fed back to the next step is norm(h''), the one lm_head reads.
* layer_type qwen3: Qwen3's decoder layer, an RMSNorm (`self_attn.q_norm` / `k_norm`) over each q and k head
  before rope (speculators: transformer_layer_config.model_type = "qwen3").

speculators 0.9.0 (models/eagle3/config.py) defaults every flag to false and its layer to Qwen3Config; vLLM's
speculators adapter reads an absent norm_before_residual as true. SGLang's LlamaForCausalLMEagle3 has none of
these: it is refused there.
"""
from __future__ import annotations

import json

from .util import EyasError

FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
VARIANTS = FLAGS + ("layer_type",)
LAYER_TYPES = ("llama", "qwen3")
LAYER_ARCHS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def check_variants(v: dict, where: str) -> dict:
    """Drafter variant settings checked (each flag true or false, a layer type eyas builds, norm_before_fc and
    fc_norm not both, as speculators refuses them together); refused naming `where` and the field."""
    for k, x in v.items():
        if k == "layer_type":
            if x not in LAYER_TYPES:
                raise EyasError(f"{where}: field 'layer_type' must be one of {', '.join(LAYER_TYPES)}, got "
                                f"{json.dumps(x, default=str)}")
        elif k not in VARIANTS:
            raise EyasError(f"{where}: '{k}' is not a drafter variant ({', '.join(VARIANTS)})")
        elif not isinstance(x, bool):
            raise EyasError(f"{where}: field '{k}' must be true or false, got {json.dumps(x, default=str)}")
    if v.get("norm_before_fc") and v.get("fc_norm"):
        raise EyasError(f"{where}: norm_before_fc and fc_norm are two ways to norm fc's input; choose one")
    return dict(v)


def variant_tensors(c) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors a DraftConfig's variants add (eyas names, the speculators format's too, `layers.0.` read for
    `midlayer.`) -> (shape, kind)."""
    n, Ht = len(c.aux_layers), c.target_hidden_size
    t: dict[str, tuple[tuple[int, ...], str]] = {}
    if c.norm_before_fc:
        t["input_norm.weight"] = ((n * Ht,), "float")
    if c.fc_norm:
        t.update({f"fc_norm.{i}.weight": ((Ht,), "float") for i in range(n)})
    if c.layer_type == "qwen3":
        for p in ["midlayer."] + [f"layers.{i}." for i in range(1, c.num_hidden_layers)]:
            t[p + "self_attn.q_norm.weight"] = ((c.head_dim,), "float")
            t[p + "self_attn.k_norm.weight"] = ((c.head_dim,), "float")
    return t


def sglang_refusal(c) -> str | None:
    """Why SGLang cannot serve this drafter's variants (None: it can)."""
    used = [f for f in FLAGS if getattr(c, f)] + ([f"layer_type {c.layer_type!r}"] if c.layer_type != "llama" else [])
    if not used:
        return None
    return (f"SGLang's LlamaForCausalLMEagle3 has no {', '.join(used)} (its draft layer is Llama's, with the "
            f"un-normed residual, fc on the raw aux states and the pre-norm state fed back), so it would not compute "
            f"what was trained; export this drafter for vLLM (export.formats=[\"vllm\"])")


def speculators_fields(c) -> dict:
    """The speculators config's top-level flags for these variants (every one written: vLLM reads an absent
    norm_before_residual as true)."""
    return {f: bool(getattr(c, f)) for f in FLAGS}


def from_speculators(raw: dict, lc: dict, cfg_file) -> dict:
    """DraftConfig's variant fields from a speculators-format config (its top-level flags, absent ones as vLLM
    reads them, and transformer_layer_config.model_type); a layer type or flag value eyas cannot run is refused
    naming the field."""
    v = {}
    for f in FLAGS:
        x = raw.get(f, f == "norm_before_residual")  # vLLM: absent norm_before_residual is true, the rest false
        if not isinstance(x, bool):
            raise EyasError(f"{cfg_file}: field '{f}' must be true or false, got {json.dumps(x, default=str)}")
        v[f] = x
    mt = lc.get("model_type", "llama")
    if mt not in LAYER_TYPES:
        raise EyasError(f"{cfg_file}: transformer_layer_config.model_type {mt!r} is a decoder layer eyas does not "
                        f"build (it runs {', '.join(LAYER_TYPES)})")
    v["layer_type"] = mt
    return check_variants(v, str(cfg_file))
