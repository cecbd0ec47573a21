"""The drafter's rotary position embedding, of each kind the engines serve in an EAGLE-3 draft layer.

The drafter is a Llama decoder layer of its own (its own head_dim), so its rope is what SGLang's and vLLM's Llama
layer builds from the drafter's exported `rope_theta` + `rope_scaling` (`get_rope`), not the target's attention:

* default, linear, llama3: static frequencies, the same in transformers and both engines.
* dynamic: the engines compute one static table at `max_position_embeddings * factor` (transformers instead
  recomputes per call from the longest position); the drafter uses the engines' table, from transformers' own
  dynamic function at that length.
* yarn: the engines' Llama layer reads factor, original_max_position_embeddings, beta_fast and beta_slow and scales
  cos/sin by 0.1·ln(factor) + 1; it ignores DeepSeek's `mscale` / `mscale_all_dim` (those belong to MLA's
  `deepseek_yarn`) and always truncates the correction range. So an MLA target's yarn settings are carried over
  without them, and transformers' yarn function then gives the engines' scale.
* longrope: short factors below original_max_position_embeddings, long ones from there (per position: the cos/sin
  of a position does not depend on the others in its batch), scaled by the factor max_position_embeddings /
  original_max_position_embeddings as the engines compute it.

The frequencies come from transformers' rope functions (`ROPE_INIT_FUNCTIONS`), never re-derived here.
`DraftConfig.rope_scaling` holds the settings in the engines' spelling (rope_type plus that kind's keys; None for
default), which is what export writes and import reads back.
"""
from __future__ import annotations

import math

import torch

from .util import EyasError, log

KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# each kind's settings as the drafter keeps them and the engines read them: required keys, then optional ones
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings"),
             "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}
_OPTIONAL = {"yarn": {"beta_fast": 32.0, "beta_slow": 1.0}}
# settings a target may carry that a Llama draft layer in the engines does not read: left out of the drafter's
_DROPPED = {"yarn": ("mscale", "mscale_all_dim", "attention_factor", "truncate"),
            "longrope": ("factor", "attention_factor")}
_IGNORED = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def _per_layer_type(params: dict) -> dict:
    """A config whose rope settings are per attention kind (Gemma 3: {"full_attention": {...}, "sliding_attention":
    {...}}): the full-attention ones, since the drafter's layer attends over the whole sequence."""
    if params and all(isinstance(v, dict) for v in params.values()):
        return params.get("full_attention") or next(iter(params.values()))
    return params


def target_rope(config, where: str = "target") -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a drafter for a target with this (text) config; an EyasError naming the
    setting where the target's rope is one eyas cannot give its drafter."""
    raw = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = _per_layer_type(dict(raw)) if isinstance(raw, dict) else {}
    theta = float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)
    kind = params.get("rope_type") or params.get("type") or "default"
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise EyasError(f"{where}: partial_rotary_factor={partial} (rope on part of each head) is not supported by "
                        f"the eyas drafter, whose draft layer rotates whole heads")
    if "mrope_section" in params or kind in ("mrope", "3D"):
        raise EyasError(f"{where}: multimodal rope (rope_type {kind!r}, mrope_section "
                        f"{params.get('mrope_section')}) is not supported by the eyas drafter: its positions are 3-D "
                        f"and the engines feed a draft layer those only for multimodal requests")
    if kind == "dynamic" and "alpha" in params:
        raise EyasError(f"{where}: dynamic rope with alpha={params['alpha']} has no transformers rope function; the "
                        f"eyas drafter supports rope_type " + ", ".join(KINDS))
    scaling = {k: v for k, v in params.items() if k not in _IGNORED}
    if kind == "default":
        return theta, None
    if kind in ("longrope", "yarn", "llama3") and "original_max_position_embeddings" not in scaling:
        omp = getattr(config, "original_max_position_embeddings", None)
        if omp is not None:
            scaling["original_max_position_embeddings"] = omp
    if kind == "yarn" and scaling.get("factor") is None and scaling.get("original_max_position_embeddings"):
        scaling["factor"] = config.max_position_embeddings / scaling["original_max_position_embeddings"]
    dropped = {k: scaling.pop(k) for k in _DROPPED.get(kind, ()) if k in scaling}
    if dropped:
        log(f"{where}: the drafter's {kind} rope leaves out {dropped}: settings of the target's own attention that "
            f"SGLang's Llama draft layer does not read (vLLM's reads truncate, defaulting to SGLang's only behaviour), "
            f"so the drafter trains with what both engines serve")
    return theta, check_rope_scaling({"rope_type": kind, **scaling}, where, "rope_parameters.")


def without_served_mscale(d: dict, where: str, prefix: str = "rope_scaling.") -> dict:
    """A yarn drafter config's settings without `mscale` / `mscale_all_dim` where they give the cos/sin scale the
    engines serve. SpecForge cannot build yarn without both (it scales by yarn_get_mscale(factor, mscale) /
    yarn_get_mscale(factor, mscale_all_dim)), and with 1 and 0 that is 0.1·ln(factor) + 1, what SGLang's and vLLM's
    Llama draft layer apply reading neither. Other values trained another scale: refused, naming both."""
    kind = d.get("rope_type", d.get("type"))
    factor = d.get("factor")
    if kind != "yarn" or not ({"mscale", "mscale_all_dim"} & set(d)) or not _number(factor) or not factor > 0:
        return d
    ms, ms_all = d.get("mscale", 1.0), d.get("mscale_all_dim", 0.0)
    for k, v in (("mscale", ms), ("mscale_all_dim", ms_all)):
        if not _number(v):
            raise EyasError(f"{where}: {prefix}{k} must be a number, got {v!r}")

    def scale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    trained, served = scale(ms) / scale(ms_all), scale(1.0)
    if abs(trained - served) <= 1e-9 * served:
        return {k: v for k, v in d.items() if k not in ("mscale", "mscale_all_dim")}
    k = "mscale" if "mscale" in d else "mscale_all_dim"
    raise EyasError(f"{where}: {prefix}{k}={d[k]!r} is a yarn rope setting the eyas drafter does not run: mscale "
                    f"{ms} with mscale_all_dim {ms_all} scale cos/sin by {trained:.5g} (as SpecForge trains), where "
                    f"SGLang and vLLM serve {served:.5g} = 0.1·ln(factor) + 1 for a Llama draft layer")


def check_rope_scaling(d, where: str, prefix: str = "rope_scaling.") -> dict | None:
    """A drafter's rope_scaling (the engines' spelling), checked: None or default is None; a kind eyas does not run,
    a missing or mistyped setting, or one it would not honour, is refused naming it."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise EyasError(f"{where}: {prefix.rstrip('.')} must be an object or null, got {type(d).__name__}")
    kind = d.get("rope_type", d.get("type", "default"))
    if kind == "default" and not set(d) - {"rope_type", "type", "rope_theta"}:
        return None
    if kind not in KINDS:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        why = ("no SGLang or vLLM Llama draft layer serves it" if kind in ROPE_INIT_FUNCTIONS
               else "transformers has no rope function for it")
        raise EyasError(f"{where}: {prefix}rope_type {kind!r} is not supported by the eyas drafter ({why}); it "
                        f"supports " + ", ".join(KINDS))
    out: dict = {"rope_type": kind}
    for k in _REQUIRED.get(kind, ()):
        if d.get(k) is None:
            raise EyasError(f"{where}: {prefix}{k} is missing, which {kind} rope needs")
    for k, v in d.items():
        if k in ("rope_type", "type", "rope_theta"):
            continue
        if k not in _REQUIRED.get(kind, ()) and k not in _OPTIONAL.get(kind, {}):
            reads = ", ".join(_REQUIRED.get(kind, ()) + tuple(_OPTIONAL.get(kind, {}))) or "rope_theta alone"
            raise EyasError(f"{where}: {prefix}{k}={v!r} is a {kind} rope setting the eyas drafter does not run (for "
                            f"{kind} rope the engines' Llama draft layer reads {reads})")
        if k in ("short_factor", "long_factor"):
            if not isinstance(v, list) or not all(_number(x) for x in v):
                raise EyasError(f"{where}: {prefix}{k} must be a list of numbers, got {v!r}")
            out[k] = [float(x) for x in v]
        elif k == "original_max_position_embeddings":
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise EyasError(f"{where}: {prefix}{k} must be a positive whole number, got {v!r}")
            out[k] = v
        else:
            if not _number(v) or not v > 0:
                raise EyasError(f"{where}: {prefix}{k} must be a positive number, got {v!r}")
            out[k] = float(v)
    for k, default in _OPTIONAL.get(kind, {}).items():
        out.setdefault(k, default)
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class RopeFrequencies:
    """A drafter's inverse frequencies and cos/sin scale, from transformers' rope function for its settings."""

    def __init__(self, head_dim: int, num_heads: int, theta: float, max_position_embeddings: int,
                 scaling: dict | None):
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        params = {"rope_type": "default", "rope_theta": float(theta), **(scaling or {})}
        if params["rope_type"] == "longrope":  # the engines' scale factor, said explicitly (transformers asks for it)
            params["factor"] = max_position_embeddings / params["original_max_position_embeddings"]
        cfg = LlamaConfig(hidden_size=head_dim * num_heads, num_attention_heads=num_heads, head_dim=head_dim,
                          max_position_embeddings=max_position_embeddings, rope_parameters=params)
        kind = params["rope_type"]
        self.long: torch.Tensor | None = None
        self.original = 0
        if kind == "default":
            self.inv, self.scale = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
        elif kind == "dynamic":  # the engines' static table, at the longest length they serve
            self.inv, self.scale = ROPE_INIT_FUNCTIONS[kind](
                cfg, None, seq_len=int(max_position_embeddings * params["factor"]))
        elif kind == "longrope":
            self.original = int(params["original_max_position_embeddings"])
            self.inv, self.scale = ROPE_INIT_FUNCTIONS[kind](cfg, None, seq_len=None)
            self.long, _ = ROPE_INIT_FUNCTIONS[kind](cfg, None, seq_len=self.original + 1)
        else:
            self.inv, self.scale = ROPE_INIT_FUNCTIONS[kind](cfg, None)
        self.inv = self.inv.float()
        self.scale = float(self.scale)
        self._on: dict = {}

    def on(self, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The inverse frequencies (and longrope's long ones) on `device`, copied there once."""
        key = str(device)
        if key not in self._on:
            self._on[key] = (self.inv.to(device), None if self.long is None else self.long.float().to(device))
        return self._on[key]

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, 1, T, head_dim] for positions [B, T], as transformers' rotary embedding gives them."""
        inv, long = self.on(position_ids.device)
        pos = position_ids.float()[..., None]
        freqs = pos * inv
        if long is not None:
            freqs = torch.where(position_ids[..., None] >= self.original, pos * long, freqs)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]
