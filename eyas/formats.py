"""Drafter formats eyas reads: its own folder, SGLang/SpecForge's EAGLE-3 layout, vLLM's speculators format and the
original EAGLE-3 layout (config.json + safetensors or pytorch_model.bin). What each engine's files hold is written
up in docs/serving.md; eyas.export writes the engines' formats.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from .aux_layers import check_drafter_aux_layers, config_aux_ids, eyas_aux_ids, int_list
from .draft import Eagle3Drafter, load_drafter
from .draft_config import (NON_FINITE, DraftConfig, check_fits, check_tensors, is_eyas_config, read_config,
                           read_safetensors, shapes_of)
from .rope import check_rope_scaling, without_served_mscale
from .variants import from_speculators
from .util import DAMAGED, EyasError, json_kind, read_json, refuse_non_finite

VLLM_MODEL_TYPE = "eagle3"  # speculators_model_type of the drafters eyas reads and writes


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    """A drafter folder's weights: the files its index (model.safetensors.index.json) names, else
    model.safetensors, else (only where it has neither) every *.safetensors file; the same for pytorch_model*.bin
    where it has no safetensors. A stray weights file beside the ones a folder names (an earlier export's, say) is
    not read: merged in, it could replace a tensor. A tensor found in two files is refused."""
    for main, pattern, reader in (("model.safetensors", "*.safetensors", read_safetensors),
                                  ("pytorch_model.bin", "pytorch_model*.bin", _read_bin)):
        files, index = _weight_files(path, main, pattern)
        if not files:
            continue
        sd: dict[str, torch.Tensor] = {}
        source: dict[str, Path] = {}
        for f in files:
            part = reader(f)
            refuse_non_finite(part, str(f), NON_FINITE)
            for k, v in part.items():
                if k in sd:
                    raise EyasError(f"{path}: tensor '{k}' is in both {source[k].name} and {f.name}, so which one the "
                                    f"drafter holds is not known: remove the file that does not belong to it")
                sd[k], source[k] = v, f
        for k, name in (index or {}).items():
            if k not in sd or source[k].name != name:
                raise EyasError(f"{path / (main + '.index.json')}: names {name} as the file of tensor '{k}', which "
                                f"that file does not hold; {DAMAGED}")
        return sd
    raise EyasError(f"{path}: no weights found (*.safetensors or pytorch_model.bin)")


def _weight_files(path: Path, main: str, pattern: str) -> tuple[list[Path], dict | None]:
    """The weights files of one kind a folder names, and its index's tensor -> file map where it has an index."""
    index_file = path / (main + ".index.json")
    if index_file.is_file():
        raw = read_json(index_file)
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) and v and Path(v).name == v for v in wm.values()):
            raise EyasError(f"{index_file}: expected a 'weight_map' object of tensor name -> file name in this "
                            f"folder; {DAMAGED}")
        files = [path / n for n in sorted(set(wm.values()))]
        for f in files:
            if not f.is_file():
                raise EyasError(f"{index_file}: names {f.name}, which is not in {path}; {DAMAGED}")
        return files, wm
    if (path / main).is_file():
        return [path / main], None
    return sorted(p for p in path.glob(pattern) if p.is_file()), None


def _read_bin(f: Path) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(str(f), map_location="cpu", weights_only=True)
    except Exception as e:  # pickles with code in them are refused here
        raise EyasError(f"{f}: cannot be read as plain tensors ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise EyasError(f"{f}: expected a dict of tensors, got {type(obj).__name__}")
    return obj


def detect_format(raw: dict, sd_keys) -> str:
    """'eyas', 'vllm' (speculators), 'sglang' (SGLang/SpecForge) or 'eagle' (original EAGLE)."""
    if raw.get("eyas_format") == 1:
        return "eyas"
    if "speculators_model_type" in raw:
        return "vllm"
    archs = raw.get("architectures") or []
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    if any("Eagle3" in a for a in archs) or any(k.startswith("midlayer.") for k in sd_keys):
        return "sglang"
    return "unknown"


def _refuse_unsupported(lc: dict, raw: dict, where: str, layers: int) -> None:
    problems = []
    if layers != 1 and "speculators_model_type" not in raw:
        problems.append(f"{layers} decoder layers in SGLang's layout (its later layers are not the plain Llama layers "
                        f"eyas runs; eyas reads multi-layer drafters in vLLM's speculators format)")
    if lc.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {lc['hidden_act']!r} (eyas uses silu)")
    if lc.get("attention_bias") or lc.get("mlp_bias") or raw.get("bias"):
        problems.append("biases in attention/MLP/fc (eyas drafters have none)")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(flag) and "speculators_model_type" not in raw:  # the speculators format's variants are read
            problems.append(f"{flag}=true outside the speculators format (SGLang's layout has no such setting)")
    if problems:
        raise EyasError(f"{where}: this drafter uses features eyas cannot run: " + "; ".join(problems))


def _with_defaults(lc: dict, layer_type: str) -> dict:
    """A speculators transformer_layer_config with the defaults of its model type filled in: speculators writes it
    as transformers' to_diff_dict, which leaves out every value equal to the config class's default (Qwen3's
    head_dim 128, rms_norm_eps 1e-6, ...)."""
    if layer_type == "llama":  # eyas writes every Llama field; older files relied on the defaults import used
        return lc
    full = AutoConfig.for_model(layer_type).to_dict()
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "vocab_size", "hidden_act", "attention_bias")
    out = {k: full[k] for k in keep if full.get(k) is not None}
    if "rope_scaling" not in lc and "rope_parameters" not in lc and "rope_theta" not in lc:
        out["rope_parameters"] = full.get("rope_parameters")
    return {**out, **lc}


def _engine_rope(f: "_Fields", cfg_file: Path) -> tuple[float, dict | None]:
    """The rope_theta and rope settings of an engine-format drafter config: `rope_scaling` (transformers 4's and the
    engines' spelling) or `rope_parameters` (transformers 5's, with rope_theta inside), checked by
    eyas.rope.check_rope_scaling: a kind or setting the eyas drafter does not run is refused naming it."""
    params = f.obj("rope_parameters")
    theta = f.number("rope_theta") or _Fields(params, cfg_file, f.prefix + "rope_parameters.").number(
        "rope_theta", 10000.0)
    key = "rope_scaling" if f.d.get("rope_scaling") is not None else "rope_parameters"
    scaling = f.obj(key)
    mrope = "mrope_section" in scaling
    if scaling.get("rope_type", scaling.get("type", "default")) == "default" and not mrope:
        return theta, None
    scaling = without_served_mscale(scaling, str(cfg_file), f"{f.prefix}{key}.")  # SpecForge's yarn writes them
    return theta, check_rope_scaling(scaling, str(cfg_file), f"{f.prefix}{key}.")


class _Fields:
    """An engine config's fields, each read with its type checked: a damaged or hand-edited value is refused naming
    the file and the field (as `prefix` + key: `transformer_layer_config.hidden_size`), not turned into a number
    that is not what the file says ("64" read as 64) or left to fail inside torch."""

    def __init__(self, d: dict, cfg_file: Path, prefix: str = ""):
        self.d, self.cfg_file, self.prefix = d, cfg_file, prefix

    def _bad(self, key: str, want: str, v) -> EyasError:
        return EyasError(f"{self.cfg_file}: field '{self.prefix}{key}' must be {want}, got {json_kind(v)}; {DAMAGED}")

    def whole(self, key: str, default=None, minimum: int = 1) -> int:
        """A whole number >= minimum, or `default` where the field is absent or null (an EyasError without one)."""
        v = self.d.get(key)
        if v is None:
            if default is None:
                raise EyasError(f"{self.cfg_file}: field '{self.prefix}{key}' is missing; {DAMAGED}")
            return default
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise self._bad(key, "a positive whole number" if minimum == 1 else f"a whole number >= {minimum}", v)
        return v

    def number(self, key: str, default=None) -> float | None:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise self._bad(key, "a positive number", v)
        return float(v)

    def obj(self, key: str) -> dict:
        """An object field (absent or null: empty)."""
        v = self.d.get(key)
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise self._bad(key, "an object", v)
        return v

    def ids(self, key: str) -> list[int] | None:
        v = self.d.get(key)
        if v is None:
            return None
        if not int_list(v):
            raise self._bad(key, "a list of layer ids", v)
        return v


def import_drafter(path: str | Path, target=None) -> Eagle3Drafter:
    """Load a drafter from an eyas folder, an SGLang/SpecForge EAGLE-3 folder, a vLLM speculators
    folder or an original EAGLE-3 folder (config.json + safetensors or pytorch_model.bin). With
    `target`, the target's embedding is attached and the drafter is refused if it does not fit."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir() or not cfg_file.exists():
        raise EyasError(f"{path}: not a drafter folder (no config.json)")
    raw = read_config(cfg_file)
    if is_eyas_config(raw, cfg_file):  # a format number this eyas does not know is refused there
        return load_drafter(path, target=target)
    sd = _load_weights(path)
    fmt = detect_format(raw, sd.keys())
    if fmt == "unknown":
        raise EyasError(f"{path}: not a recognised EAGLE-3 drafter layout (no speculators_model_type, no "
                        f"Eagle3 architecture, no midlayer.* weights)")
    where = str(path)
    norm = _eyas_names(sd)
    c = _engine_config(raw, fmt, cfg_file, norm, target)
    if target is not None:
        check_fits(c, target, where)
        c.target, c.target_num_layers = target.identity(), target.num_layers
    elif c.hidden_size != c.target_hidden_size:
        raise EyasError(f"{where}: drafter hidden size {c.hidden_size} differs from its target's "
                        f"{c.target_hidden_size}; eyas drafters share the target's embedding width")
    _vocab_maps(norm, c, where)
    has_embed = "embed_tokens.weight" in norm
    check_tensors(shapes_of(norm), c, where, include_embeddings=has_embed)
    d = Eagle3Drafter(c, target.embed_tokens().weight.detach().float() if target is not None else None)
    if target is not None:
        norm.pop("embed_tokens.weight", None)
    missing, unexpected = d.load_state_dict(norm, strict=False)
    missing = [m for m in missing if m != "embed_tokens.weight"]
    if missing or unexpected:
        raise EyasError(f"{where}: missing tensors {missing}, unexpected {unexpected}")
    return d


def _eyas_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An engine-format drafter's weights under eyas' own names (`layers.0.` is `midlayer.`; no `model.` prefix, no
    verifier tensors)."""
    norm: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.startswith("model."):
            k = k[len("model."):]
        if k.startswith("layers.0."):
            k = "midlayer." + k[len("layers.0."):]
        if k.startswith("verifier_"):
            continue
        norm[k] = v
    return norm


def _layer_fields(raw: dict, fmt: str, cfg_file: Path) -> tuple[dict, _Fields, dict, list[int] | None, str]:
    """Where an engine config keeps its decoder layer's fields (vLLM: transformer_layer_config; SGLang: the top
    level), those fields, the speculators variants, the aux layers it records (eyas ids) and the field naming them."""
    top = _Fields(raw, cfg_file)
    if fmt == "vllm":
        if raw.get("speculators_model_type") != VLLM_MODEL_TYPE:
            raise EyasError(f"{cfg_file}: speculators_model_type is {raw.get('speculators_model_type')!r}; "
                            f"eyas imports only 'eagle3'")
        lc = raw.get("transformer_layer_config")
        if not isinstance(lc, dict):
            raise EyasError(f"{cfg_file}: field 'transformer_layer_config' is missing")
        variants = from_speculators(raw, lc, cfg_file)
        lc = _with_defaults(lc, variants["layer_type"])
        ids = top.ids("eagle_aux_hidden_state_layer_ids")
        aux = eyas_aux_ids(ids, "vllm") if ids else None
        return lc, _Fields(lc, cfg_file, "transformer_layer_config."), variants, aux, "eagle_aux_hidden_state_layer_ids"
    nested = _Fields(top.obj("eagle_config"), cfg_file, "eagle_config.").ids("eagle_aux_hidden_state_layer_ids")
    top.ids("eagle_aux_hidden_state_layer_ids")
    aux = config_aux_ids(raw)  # the ids checked above
    aux_field = ("eagle_config.eagle_aux_hidden_state_layer_ids, each + 1 as SGLang reads them" if nested
                 else "eagle_aux_hidden_state_layer_ids")
    return raw, top, {}, aux, aux_field


def _engine_config(raw: dict, fmt: str, cfg_file: Path, norm: dict[str, torch.Tensor], target) -> DraftConfig:
    """The DraftConfig an engine-format config describes, its sizes read from the weights where it leaves them out,
    its aux layers the target's default where it records none."""
    lc, f, variants, aux, aux_field = _layer_fields(raw, fmt, cfg_file)
    top = _Fields(raw, cfg_file)
    layers = f.whole("num_hidden_layers", default=1)
    _refuse_unsupported(lc, raw, str(cfg_file.parent), layers)
    hidden = f.whole("hidden_size")
    heads = f.whole("num_attention_heads")
    vocab = f.whole("vocab_size", default=0) or (norm["t2d"].numel() if "t2d" in norm else None)
    draft_vocab = (top.whole("draft_vocab_size", default=0) or f.whole("draft_vocab_size", default=0)
                   or (norm["lm_head.weight"].shape[0] if "lm_head.weight" in norm else None))
    if vocab is None or draft_vocab is None:
        raise EyasError(f"{cfg_file}: cannot tell the vocabulary sizes (vocab_size / draft_vocab_size)")
    target_hidden = top.whole("target_hidden_size", default=0) or f.whole("target_hidden_size", default=hidden)
    if aux is not None:
        check_drafter_aux_layers(aux, cfg_file, target, field=aux_field)
    elif target is None:
        raise EyasError(f"{cfg_file}: the aux-layer ids are not recorded; pass the target so its default "
                        f"[2, N//2, N-3] can be used")
    else:
        aux = list(target.aux_layers)  # engines and EAGLE then use [2, N//2, N-3] of the target
    theta, rope_scaling = _engine_rope(f, cfg_file)
    meta = _Fields(top.obj("eyas"), cfg_file, "eyas.")
    return DraftConfig(hidden_size=hidden, intermediate_size=f.whole("intermediate_size"),
                       num_attention_heads=heads, num_key_value_heads=f.whole("num_key_value_heads", default=heads),
                       head_dim=f.whole("head_dim", default=max(1, hidden // heads)), target_hidden_size=target_hidden,
                       target_vocab_size=vocab, draft_vocab_size=draft_vocab, aux_layers=list(aux),
                       rms_norm_eps=f.number("rms_norm_eps", 1e-6), rope_theta=theta,
                       max_position_embeddings=f.whole("max_position_embeddings", default=8192),
                       target_num_layers=meta.whole("target_num_layers", default=0, minimum=0),
                       target=dict(meta.obj("target")),
                       num_hidden_layers=layers, rope_scaling=rope_scaling, **variants)


def _vocab_maps(norm: dict[str, torch.Tensor], c: DraftConfig, where: str) -> None:
    """Fill in `d2t` (absent: the draft vocabulary is the target's) and `t2d` (absent: rebuilt from d2t) in eyas'
    dtypes."""
    if "d2t" not in norm:
        if c.draft_vocab_size != c.target_vocab_size:
            raise EyasError(f"{where}: tensor 'd2t' is missing and the draft vocabulary ({c.draft_vocab_size}) "
                            f"is smaller than the target's ({c.target_vocab_size})")
        norm["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)
    norm["d2t"] = norm["d2t"].long()
    if "t2d" not in norm and tuple(norm["d2t"].shape) == (c.draft_vocab_size,):  # rebuilt from d2t
        ids = norm["d2t"] + torch.arange(c.draft_vocab_size)
        if c.draft_vocab_size and not (0 <= int(ids.min()) and int(ids.max()) < c.target_vocab_size):
            raise EyasError(f"{where}: tensor 'd2t' maps draft ids outside the target's vocabulary of "
                            f"{c.target_vocab_size}; {DAMAGED}")
        norm["t2d"] = torch.zeros(c.target_vocab_size, dtype=torch.bool)
        norm["t2d"][ids] = True
    if "t2d" in norm:
        norm["t2d"] = norm["t2d"].bool()
