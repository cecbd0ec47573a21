"""A drafter's description and the files that hold it, without the model: DraftConfig (config.json), the tensors
an eyas drafter folder holds (model.safetensors) and their checks, read from the files' headers where the model is
not needed (docs/design.md, "Drafter layout").
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from .aux_layers import check_drafter_aux_layers
from .rope import check_rope_scaling, target_rope
from .variants import VARIANTS, check_variants, variant_tensors
from .util import DAMAGED, EyasError, is_int, json_kind, read_json

EYAS_FORMAT = 1  # config.json's `eyas_format` in the drafter folders save_drafter writes
# a drafter whose weights hold NaN or Inf: refused when written or read (it drafts nothing a target accepts, and
# evaluated it would still pass as lossless)
NON_FINITE = ("the drafter's weights diverged or the file is damaged: train it again (with a lower train.lr or "
              "train.grad_clip if the training diverged), or restore the folder from a copy")


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layers: list[int]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    target_num_layers: int = 0
    target: dict = field(default_factory=dict)  # the target's identity (name, sha256, ...)
    num_hidden_layers: int = 1  # decoder layers: the first reads the embedding and the hidden state, the rest plain
    # the rope kind and its settings as the engines read them (eyas.rope); None: plain rope of rope_theta
    rope_scaling: dict | None = None
    # the speculators format's drafter variants (its Eagle3SpeculatorConfig flags, same names and meaning):
    norm_before_residual: bool = False  # the first layer's residual is hidden_norm(h), not h
    norm_before_fc: bool = False        # one RMSNorm over concat(aux) before fc (`input_norm`)
    fc_norm: bool = False               # an RMSNorm on each aux state before fc (`fc_norm.<i>`)
    norm_output: bool = False           # the state fed back is norm(h''), the one lm_head reads
    layer_type: str = "llama"           # decoder layer: llama, or qwen3 (RMSNorm on each q and k head)

    @classmethod
    def from_target(cls, target, draft_vocab_size: int, intermediate_size: int = 0,
                    num_layers: int = 1, variants: dict | None = None) -> "DraftConfig":
        """A drafter for `target`; `variants`: DraftConfig's variant fields to set (norm_before_residual, ...)."""
        c = target.config
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        if getattr(c, "kv_lora_rank", None) and getattr(c, "v_head_dim", None):
            # MLA (DeepSeek-V3, Kimi-K2): its head_dim is the rope part of a query head alone; the drafter's Llama
            # layer takes whole heads of the value width over the hidden size instead (DeepSeek-V3: 56 of 128)
            head_dim = c.v_head_dim
            heads = kv_heads = max(1, c.hidden_size // head_dim)
        theta, rope_scaling = target_rope(c, f"target '{getattr(target, 'name', '?')}'")
        return cls(hidden_size=c.hidden_size, intermediate_size=intermediate_size or c.intermediate_size,
                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                   target_hidden_size=c.hidden_size, target_vocab_size=c.vocab_size,
                   draft_vocab_size=min(draft_vocab_size, c.vocab_size), aux_layers=list(target.aux_layers),
                   rms_norm_eps=c.rms_norm_eps, rope_theta=float(theta),
                   max_position_embeddings=c.max_position_embeddings, target_num_layers=c.num_hidden_layers,
                   target=target.identity(), num_hidden_layers=int(num_layers), rope_scaling=rope_scaling,
                   **check_variants(variants or {}, "drafter variants"))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "drafter config") -> "DraftConfig":
        """From a saved config (a drafter folder's config.json, a checkpoint's state), each field checked for its
        type: a damaged or hand-edited file is refused naming `where` and the field, where it would otherwise fail
        deep inside torch, or compare "64" with 64."""
        if not isinstance(d, dict):
            raise EyasError(f"{where}: expected a JSON object of drafter settings, got {json_kind(d)}; {DAMAGED}")
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for f in fields(cls):
            if f.name not in known:
                if f.default is MISSING and f.default_factory is MISSING:
                    raise EyasError(f"{where}: field '{f.name}' is missing; {DAMAGED}")
                continue
            v = known[f.name]
            if f.name == "aux_layers":
                check_drafter_aux_layers(v, where, field="aux_layers")
            elif f.name == "rope_scaling":
                known[f.name] = check_rope_scaling(v, where)
            elif f.name in VARIANTS:
                continue  # checked together below (some exclude others)
            elif f.name == "target":
                if not isinstance(v, dict):
                    raise EyasError(f"{where}: field 'target' must be an object, got {json_kind(v)}; {DAMAGED}")
            elif f.name in _FLOAT_FIELDS:
                if not _is_number(v) or not v > 0:
                    raise EyasError(f"{where}: field '{f.name}' must be a positive number, got {json_kind(v)}; "
                                    f"{DAMAGED}")
                known[f.name] = float(v)
            elif not is_int(v) or v < (0 if f.name == "target_num_layers" else 1):
                want = "a whole number, 0 or more" if f.name == "target_num_layers" else "a positive whole number"
                raise EyasError(f"{where}: field '{f.name}' must be {want}, got {json_kind(v)}; {DAMAGED}")
        check_variants({k: known[k] for k in VARIANTS if k in known}, where)
        return cls(**known)


_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
    t.update(variant_tensors(c))  # input_norm, fc_norm.<i>, q_norm/k_norm (eyas.variants)
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
                  include_embeddings: bool = False, hint: str = "") -> None:
    """Refuse a checkpoint with a missing, misshapen or mistyped tensor, naming it (and `hint`: what to do)."""
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
        raise EyasError(f"{where}: " + "; ".join(problems) + (f"; {hint}" if hint else ""))


def shapes_of(sd: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}


def check_fits(c: DraftConfig, target, where: str) -> None:
    """Refuse a drafter whose shapes do not fit the target, saying which."""
    problems = []
    if c.target_hidden_size != target.hidden_size:
        problems.append(f"hidden size {c.target_hidden_size} != target's {target.hidden_size}")
    if c.target_vocab_size != target.vocab_size:
        problems.append(f"vocabulary {c.target_vocab_size} != target's {target.vocab_size}")
    if len(c.aux_layers) != len(target.aux_layers):
        problems.append(f"{len(c.aux_layers)} aux layers != the target's {len(target.aux_layers)}")
    elif list(c.aux_layers) != list(target.aux_layers):
        problems.append(f"aux layers {c.aux_layers} != the target's {target.aux_layers}")
    if problems:
        raise EyasError(f"drafter {where} does not fit target '{target.name}': " + "; ".join(problems))


# ----------------------------------------------------------------------------- files

def read_eyas_config(path: Path) -> DraftConfig:
    """An eyas drafter folder's config.json as a DraftConfig, or an EyasError naming the file when it is missing,
    damaged or another format's (which eyas.formats.import_drafter reads)."""
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise EyasError(f"{cfg_file}: not found (is {path} a trained eyas drafter folder? run `eyas train` first)")
    raw = read_config(cfg_file)
    if not is_eyas_config(raw, cfg_file):
        raise EyasError(f"{cfg_file}: not an eyas drafter's config (no eyas_format): an SGLang, vLLM or EAGLE "
                        f"drafter is read by eyas.formats.import_drafter; otherwise {DAMAGED}")
    return DraftConfig.from_dict(raw, str(cfg_file))


def check_checkpoint(path: str | Path) -> DraftConfig:
    """Check an eyas drafter folder's tensors against its config without building the model."""
    path = Path(path)
    c = read_eyas_config(path)
    weights = path / "model.safetensors"
    check_tensors(safetensors_shapes(weights), c, f"{weights} (against config.json)", hint=DAMAGED)
    return c


def read_config(path: Path) -> dict:
    """A drafter folder's config.json as a JSON object, or an EyasError naming the file."""
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise EyasError(f"{path}: expected a JSON object (the drafter's settings), got {json_kind(raw)}; {DAMAGED}")
    return raw


def is_eyas_config(raw: dict, path) -> bool:
    """Whether a drafter's config.json is an eyas folder's (eyas_format). A format number this eyas does not know
    is refused: read as another layout, it would load as something it is not."""
    if "eyas_format" not in raw:
        return False
    v = raw["eyas_format"]
    if not is_int(v) or v != EYAS_FORMAT:
        raise EyasError(f"{path}: eyas_format is {json_kind(v)}, a drafter layout this version of eyas does not know "
                        f"(it reads {EYAS_FORMAT}): the folder was written by another version of eyas. Read it with "
                        f"that version, or make it again with this one")
    return True


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, or an EyasError naming the file when it is missing or damaged."""
    if not path.is_file():
        raise EyasError(f"{path}: not found; {DAMAGED}")
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise _unreadable(path, e) from None
    except OSError as e:  # no permission, an I/O error: not the file's content
        raise EyasError(f"{path}: cannot be read ({e})") from None


def _unreadable(path: Path, e: Exception) -> EyasError:
    return EyasError(f"{path}: not a readable safetensors file ({e}): it is damaged or cut short; {DAMAGED}")


def safetensors_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each tensor's (shape, dtype) in a safetensors file, read from its header alone; an EyasError naming the file
    when it is missing or damaged."""
    if not path.is_file():
        raise EyasError(f"{path}: not found; {DAMAGED}")
    dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
          "BOOL": torch.bool, "I32": torch.int32}
    shapes = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                shapes[k] = (tuple(sl.get_shape()), dt.get(sl.get_dtype(), torch.float32))
    except SafetensorError as e:
        raise _unreadable(path, e) from None
    except OSError as e:
        raise EyasError(f"{path}: cannot be read ({e})") from None
    return shapes
