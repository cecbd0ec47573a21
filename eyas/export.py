"""Export an eyas drafter for SGLang and vLLM, and import drafters from those formats and from
the original EAGLE layout.

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

import json
from pathlib import Path

import torch

from .draft import DraftConfig, Eagle3Drafter, check_fits, load_drafter
from .util import EyasError, atomic_path, atomic_write_json, log

FORMATS = ("sglang", "vllm")
# SGLang's later draft layers (BasicDecoderLayer in llama_eagle3.py, commit 03d5a77) restart the residual from the
# previous layer's MLP output and norm with hidden_norm: another network than vLLM's (and eyas') plain Llama layers
SGLANG_MULTI_LAYER = ("a drafter of {n} decoder layers cannot be served by SGLang: its LlamaForCausalLMEagle3 runs "
                      "the layers after the first differently (they drop the residual stream), so it would not "
                      "compute what was trained; export it for vLLM (export.formats=[\"vllm\"])")
SGLANG_ARCH = "LlamaForCausalLMEagle3"
VLLM_MODEL_TYPE = "eagle3"
# hub ids of the presets, written as the verifier a served drafter belongs to
PRESET_HUB_IDS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
                  "qwen-coder-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}
PRESET_ARCHS = {"smollm2": "LlamaForCausalLM", "qwen-coder-0.5b": "Qwen2ForCausalLM", "tiny": "LlamaForCausalLM"}


# ----------------------------------------------------------------------------- tensors

def expected_tensors(c: DraftConfig, include_embeddings: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor an eyas drafter checkpoint holds (eyas/SGLang names) -> (shape, kind), where
    kind is 'float', 'int64' or 'bool'."""
    H, q = c.hidden_size, c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    t = {
        "fc.weight": ((H, len(c.aux_layers) * c.target_hidden_size), "float"),
        "midlayer.input_layernorm.weight": ((H,), "float"),
        "midlayer.hidden_norm.weight": ((H,), "float"),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * H), "float"),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * H), "float"),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * H), "float"),
        "midlayer.self_attn.o_proj.weight": ((H, q), "float"),
        "midlayer.post_attention_layernorm.weight": ((H,), "float"),
        "midlayer.mlp.gate_proj.weight": ((c.intermediate_size, H), "float"),
        "midlayer.mlp.up_proj.weight": ((c.intermediate_size, H), "float"),
        "midlayer.mlp.down_proj.weight": ((H, c.intermediate_size), "float"),
        "norm.weight": ((H,), "float"),
        "lm_head.weight": ((c.draft_vocab_size, H), "float"),
        "d2t": ((c.draft_vocab_size,), "int64"),
        "t2d": ((c.target_vocab_size,), "bool"),
    }
    for i in range(1, c.num_hidden_layers):  # a multi-layer drafter's plain layers (vLLM's layers.<i>)
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": ((H,), "float"),
                  p + "self_attn.q_proj.weight": ((q, H), "float"), p + "self_attn.k_proj.weight": ((kv, H), "float"),
                  p + "self_attn.v_proj.weight": ((kv, H), "float"), p + "self_attn.o_proj.weight": ((H, q), "float"),
                  p + "post_attention_layernorm.weight": ((H,), "float"),
                  p + "mlp.gate_proj.weight": ((c.intermediate_size, H), "float"),
                  p + "mlp.up_proj.weight": ((c.intermediate_size, H), "float"),
                  p + "mlp.down_proj.weight": ((H, c.intermediate_size), "float")})
    if include_embeddings:
        t["embed_tokens.weight"] = ((c.target_vocab_size, H), "float")
    return t


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype == torch.int64:
        return "int64"
    return "float" if dtype.is_floating_point else str(dtype).replace("torch.", "")


def check_tensors(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], c: DraftConfig, where: str,
                  include_embeddings: bool = False) -> None:
    """Refuse a checkpoint with a missing, misshapen or mistyped tensor, naming it."""
    problems = []
    for name, (shape, kind) in expected_tensors(c, include_embeddings).items():
        if name not in shapes:
            problems.append(f"tensor '{name}' is missing")
            continue
        got_shape, got_dtype = shapes[name]
        if tuple(got_shape) != shape:
            problems.append(f"tensor '{name}' has shape {list(got_shape)}, expected {list(shape)}")
        elif _kind(got_dtype) != kind:
            problems.append(f"tensor '{name}' has dtype {str(got_dtype).replace('torch.', '')}, expected {kind}")
    if problems:
        raise EyasError(f"{where}: " + "; ".join(problems))


def _shapes_of(sd: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}


def check_checkpoint(path: str | Path) -> DraftConfig:
    """Check an eyas drafter folder's tensors against its config without building the model."""
    from safetensors import safe_open

    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    for f in (cfg_file, weights):
        if not f.exists():
            raise EyasError(f"{f}: not found (is {path} a trained eyas drafter folder? run `eyas train` first)")
    c = DraftConfig.from_dict(_read_json(cfg_file))
    dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
          "BOOL": torch.bool, "I32": torch.int32}
    shapes = {}
    with safe_open(str(weights), framework="pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            shapes[k] = (tuple(sl.get_shape()), dt.get(sl.get_dtype(), torch.float32))
    check_tensors(shapes, c, str(weights))
    return c


# ----------------------------------------------------------------------------- aux-layer ids

def engine_aux_ids(aux_layers: list[int], fmt: str, num_layers: int = 0) -> list[int]:
    """The ids to write into an engine's config so that it captures the same residual streams the
    drafter was trained on (eyas id i = the stream entering decoder layer i = HF hidden_states[i])."""
    _check_format(fmt)
    for a in aux_layers:
        # both engines capture inside their decoder loop, before layer i runs, and add the
        # residual there: the embedding output (i=0) and the final pre-norm state (i=N) are not reachable
        if a < 1 or (num_layers and a >= num_layers):
            raise EyasError(f"aux layer {a} cannot be served: SGLang and vLLM capture the stream entering "
                            f"decoder layers 1..{num_layers - 1 if num_layers else 'N-1'}; "
                            f"retrain with target.aux_layers inside that range")
    return [a - 1 for a in aux_layers] if fmt == "sglang" else list(aux_layers)


def eyas_aux_ids(ids: list[int], fmt: str) -> list[int]:
    """Inverse of engine_aux_ids."""
    _check_format(fmt)
    return [int(i) + 1 for i in ids] if fmt == "sglang" else [int(i) for i in ids]


def config_aux_ids(raw: dict) -> list[int] | None:
    """The aux layers (eyas ids) an engine-format drafter config records: SGLang's nested
    `eagle_config["eagle_aux_hidden_state_layer_ids"]`, else a top-level `eagle_aux_hidden_state_layer_ids`, read as
    vLLM reads it (as-is); None where it records none."""
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return eyas_aux_ids(nested, "sglang")
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    return eyas_aux_ids(top, "vllm") if top else None


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise EyasError(f"export format {fmt!r} is not one of {', '.join(FORMATS)}")


# ----------------------------------------------------------------------------- export

def _llama_fields(c: DraftConfig, dtype: torch.dtype) -> dict:
    """The decoder-layer fields both engines build the draft layer from, written explicitly."""
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.num_hidden_layers,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
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
    """Write `drafter` in an engine's format: out_dir/config.json + out_dir/model.safetensors."""
    from safetensors.torch import save_file

    _check_format(fmt)
    if num_speculative_tokens < 1:
        raise EyasError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    c = drafter.config
    if fmt == "sglang" and c.num_hidden_layers > 1:
        raise EyasError(SGLANG_MULTI_LAYER.format(n=c.num_hidden_layers))
    sd = drafter.trainable_state_dict(include_embeddings=include_embeddings)
    check_tensors(_shapes_of(sd), c, "drafter", include_embeddings)
    n_layers = c.target_num_layers or int(c.target.get("num_layers", 0) or 0)
    ids = engine_aux_ids(list(c.aux_layers), fmt, n_layers)
    dtype = sd["fc.weight"].dtype
    eyas_meta = {"format": fmt, "aux_layers": list(c.aux_layers), "target": c.target,
                 "target_num_layers": n_layers}
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
            "transformer_layer_config": {**_llama_fields(c, dtype), "architectures": ["LlamaForCausalLM"]},
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            # vLLM's speculators adapter defaults norm_before_residual to True when it is absent;
            # the eyas drafter keeps the un-normed hidden state as the residual, so say so
            "norm_before_residual": False,
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
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
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "model.safetensors") as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"format": "pt", "eyas_export": fmt})
    atomic_write_json(out / "config.json", config)  # last: a folder with config.json is complete
    return out


def verifier_name(target_cfg) -> str:
    return PRESET_HUB_IDS.get(target_cfg.name, target_cfg.name)


def verifier_architectures(target_cfg) -> list[str] | None:
    """The target's transformers architecture for the export's verifier metadata: known for the
    presets, read from config.json for an HF folder, else unknown (None)."""
    if target_cfg.name in PRESET_ARCHS:
        return [PRESET_ARCHS[target_cfg.name]]
    cfg_file = Path(target_cfg.name).expanduser() / "config.json"
    if cfg_file.is_file():
        archs = _read_json(cfg_file).get("architectures")
        if isinstance(archs, list) and archs:
            return [str(a) for a in archs]
    return None


def check_export_settings(cfg) -> None:
    """Refuse export formats eyas does not write (the pipeline checks this before its first stage)."""
    if not cfg.export.formats:
        raise EyasError("export.formats is empty: name at least one of sglang, vllm")
    for f in cfg.export.formats:
        _check_format(f)


def run_export(cfg) -> dict:
    """`eyas export`: <run>/draft -> <run>/export/{sglang,vllm}/."""
    run = Path(cfg.out)
    check_export_settings(cfg)
    draft_dir = run / "draft"
    check_checkpoint(draft_dir)
    target = None
    if cfg.export.include_embeddings:
        from .target import load_target

        target = load_target(cfg.target)
    drafter = load_drafter(draft_dir, target=target)
    formats = list(cfg.export.formats)
    out = {}
    if drafter.config.num_hidden_layers > 1 and "sglang" in formats:  # the run's default asks for both formats
        log("export: skipping sglang, " + SGLANG_MULTI_LAYER.format(n=drafter.config.num_hidden_layers))
        formats = [f for f in formats if f != "sglang"]
    for f in formats:
        p = export_drafter(drafter, run / "export" / f, f, verifier_name(cfg.target),
                           include_embeddings=cfg.export.include_embeddings, num_speculative_tokens=cfg.eval.k,
                           verifier_architectures=verifier_architectures(cfg.target))
        log(f"exported the drafter for {f}: {p}")
        out[f] = str(p)
    return {"formats": list(out), "export": out, "aux_layers": list(drafter.config.aux_layers),
            "engine_aux_ids": {f: engine_aux_ids(list(drafter.config.aux_layers), f,
                                                 drafter.config.target_num_layers) for f in formats}}


# ----------------------------------------------------------------------------- import

def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise EyasError(f"{path}: line {e.lineno}: invalid JSON ({e.msg})") from None


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(str(f)))
        return sd
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        sd = {}
        for f in bins:
            try:
                obj = torch.load(str(f), map_location="cpu", weights_only=True)
            except Exception as e:  # pickles with code in them are refused here
                raise EyasError(f"{f}: cannot be read as plain tensors ({type(e).__name__}: {e})") from None
            if not isinstance(obj, dict):
                raise EyasError(f"{f}: expected a dict of tensors, got {type(obj).__name__}")
            sd.update(obj)
        return sd
    raise EyasError(f"{path}: no weights found (*.safetensors or pytorch_model.bin)")


def detect_format(raw: dict, sd_keys) -> str:
    """'eyas', 'vllm' (speculators), 'sglang' (SGLang/SpecForge) or 'eagle' (original EAGLE)."""
    if raw.get("eyas_format") == 1:
        return "eyas"
    if "speculators_model_type" in raw:
        return "vllm"
    archs = raw.get("architectures") or []
    if any("Eagle3" in a for a in archs) or any(k.startswith("midlayer.") for k in sd_keys):
        return "sglang"
    return "unknown"


def _refuse_unsupported(lc: dict, raw: dict, where: str) -> None:
    problems = []
    layers = int(lc.get("num_hidden_layers", 1))
    if layers != 1 and "speculators_model_type" not in raw:
        problems.append(f"{layers} decoder layers in SGLang's layout (its later layers are not the plain Llama layers "
                        f"eyas runs; eyas reads multi-layer drafters in vLLM's speculators format)")
    elif layers < 1:
        problems.append(f"{layers} decoder layers")
    if lc.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {lc['hidden_act']!r} (eyas uses silu)")
    if lc.get("attention_bias") or lc.get("mlp_bias") or raw.get("bias"):
        problems.append("biases in attention/MLP/fc (eyas drafters have none)")
    rope = lc.get("rope_scaling") or lc.get("rope_parameters") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        problems.append(f"rope type {rope.get('rope_type', rope.get('type'))!r} (eyas supports plain RoPE)")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(flag):
            problems.append(f"{flag}=true (eyas' drafter does not do this)")
    if problems:
        raise EyasError(f"{where}: this drafter uses features eyas cannot run: " + "; ".join(problems))


def import_drafter(path: str | Path, target=None) -> Eagle3Drafter:
    """Load a drafter from an eyas folder, an SGLang/SpecForge EAGLE-3 folder, a vLLM speculators
    folder or an original EAGLE-3 folder (config.json + safetensors or pytorch_model.bin). With
    `target`, the target's embedding is attached and the drafter is refused if it does not fit."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir() or not cfg_file.exists():
        raise EyasError(f"{path}: not a drafter folder (no config.json)")
    raw = _read_json(cfg_file)
    if raw.get("eyas_format") == 1:
        return load_drafter(path, target=target)
    sd = _load_weights(path)
    fmt = detect_format(raw, sd.keys())
    if fmt == "unknown":
        raise EyasError(f"{path}: not a recognised EAGLE-3 drafter layout (no speculators_model_type, no "
                        f"Eagle3 architecture, no midlayer.* weights)")
    where = str(path)
    if fmt == "vllm":
        if raw.get("speculators_model_type") != VLLM_MODEL_TYPE:
            raise EyasError(f"{cfg_file}: speculators_model_type is {raw.get('speculators_model_type')!r}; "
                            f"eyas imports only 'eagle3'")
        lc = raw.get("transformer_layer_config")
        if not isinstance(lc, dict):
            raise EyasError(f"{cfg_file}: field 'transformer_layer_config' is missing")
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        aux = eyas_aux_ids(ids, "vllm") if ids else None
    else:
        lc = raw
        aux = config_aux_ids(raw)
    _refuse_unsupported(lc, raw, where)

    # normalise weight names to eyas' own
    norm: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.startswith("model."):
            k = k[len("model."):]
        if k.startswith("layers.0."):
            k = "midlayer." + k[len("layers.0."):]
        if k.startswith("verifier_"):
            continue
        norm[k] = v

    hidden = int(lc["hidden_size"]) if "hidden_size" in lc else None
    if hidden is None:
        raise EyasError(f"{cfg_file}: field 'hidden_size' is missing")
    heads = int(lc.get("num_attention_heads", 0)) or None
    if heads is None:
        raise EyasError(f"{cfg_file}: field 'num_attention_heads' is missing")
    vocab = lc.get("vocab_size") or (norm["t2d"].numel() if "t2d" in norm else None)
    draft_vocab = raw.get("draft_vocab_size") or lc.get("draft_vocab_size") or (
        norm["lm_head.weight"].shape[0] if "lm_head.weight" in norm else None)
    if vocab is None or draft_vocab is None:
        raise EyasError(f"{cfg_file}: cannot tell the vocabulary sizes (vocab_size / draft_vocab_size)")
    target_hidden = int(raw.get("target_hidden_size") or lc.get("target_hidden_size") or hidden)
    if aux is None:
        if target is None:
            raise EyasError(f"{cfg_file}: the aux-layer ids are not recorded; pass the target so its default "
                            f"[2, N//2, N-3] can be used")
        aux = list(target.aux_layers)  # engines and EAGLE then use [2, N//2, N-3] of the target
    rope = lc.get("rope_parameters") or {}
    theta = float(lc.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    c = DraftConfig(hidden_size=hidden, intermediate_size=int(lc.get("intermediate_size", 0)),
                    num_attention_heads=heads, num_key_value_heads=int(lc.get("num_key_value_heads") or heads),
                    head_dim=int(lc.get("head_dim") or hidden // heads), target_hidden_size=target_hidden,
                    target_vocab_size=int(vocab), draft_vocab_size=int(draft_vocab), aux_layers=list(aux),
                    rms_norm_eps=float(lc.get("rms_norm_eps", 1e-6)), rope_theta=theta,
                    max_position_embeddings=int(lc.get("max_position_embeddings", 8192)),
                    target_num_layers=int((raw.get("eyas") or {}).get("target_num_layers", 0) or 0),
                    target=dict((raw.get("eyas") or {}).get("target") or {}),
                    num_hidden_layers=int(lc.get("num_hidden_layers", 1)))
    if target is not None:
        check_fits(c, target, where)
        c.target, c.target_num_layers = target.identity(), target.num_layers
    elif c.hidden_size != c.target_hidden_size:
        raise EyasError(f"{where}: drafter hidden size {c.hidden_size} differs from its target's "
                        f"{c.target_hidden_size}; eyas drafters share the target's embedding width")
    if "d2t" not in norm:
        if c.draft_vocab_size != c.target_vocab_size:
            raise EyasError(f"{where}: tensor 'd2t' is missing and the draft vocabulary ({c.draft_vocab_size}) "
                            f"is smaller than the target's ({c.target_vocab_size})")
        norm["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)
    if "t2d" not in norm:  # rebuilt from d2t
        t2d = torch.zeros(c.target_vocab_size, dtype=torch.bool)
        t2d[norm["d2t"].long() + torch.arange(norm["d2t"].numel())] = True
        norm["t2d"] = t2d
    norm["d2t"], norm["t2d"] = norm["d2t"].long(), norm["t2d"].bool()
    has_embed = "embed_tokens.weight" in norm
    check_tensors(_shapes_of(norm), c, where, include_embeddings=has_embed)
    d = Eagle3Drafter(c, target.embed_tokens().weight.detach().float() if target is not None else None)
    if target is not None:
        norm.pop("embed_tokens.weight", None)
    missing, unexpected = d.load_state_dict(norm, strict=False)
    missing = [m for m in missing if m != "embed_tokens.weight"]
    if missing or unexpected:
        raise EyasError(f"{where}: missing tensors {missing}, unexpected {unexpected}")
    return d
