"""What eyas knows of a target without its weights: its config (the text model's, under a multimodal wrapper's
`text_config`), its tokenizer, its identity and aux layers, read from config.json and the tokenizer files (a GGUF
file: its header, or eyas' dequantized cache of it where that exists). Tokenize, vocab, the pipeline's preflight,
`eyas target`, `eyas data` and export need nothing more, so a target whose weights are large, or not on this
machine at all, passes them in seconds without a GPU. Only the stages that run the decoder layers (regen, feature
capture, online training, eval) load the whole model (eyas.target.load_target); the trainer on stored features
reads the embedding, final norm and head alone (eyas.target_head).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .aux_layers import check_aux_layers, default_aux_layers
from .config import TargetConfig
from .target import (TargetShape, _load_error, _pick_device, _pick_dtype, _tokenizer_from, find_eot_ids,
                     text_config)
from .target_source import (PRESET_GGUF, _quiet_transformers, _why, file_sha256, find_preset_gguf, gguf_cache_dir,
                            resolve_source)
from .util import EyasError, human_bytes


@dataclass(frozen=True)
class TargetSpec(TargetShape):
    """A target described, weights not loaded. Same names as eyas.target.Target for what the two share, and the
    same identity(), so either can be handed to the stages that only read these."""
    name: str
    source: str  # the folder (or hub id) holding config.json and the tokenizer; a GGUF file not yet dequantized
    sha256: str
    aux: tuple[int, ...]
    config: Any  # the text model's config (a multimodal wrapper's text_config)
    top_config: Any  # the config as config.json gives it (the wrapper, for a multimodal target)
    tokenizer: Any
    eot: tuple[int, ...]
    device: str = "cpu"  # where load_target would place the model, and in which dtype
    dtype: str = "float32"
    weights: dict | None = None  # weight_summary() of the source folder; None for a hub id or a GGUF file

    @property
    def aux_layers(self) -> list[int]:
        return list(self.aux)

    @property
    def eot_token_ids(self) -> list[int]:
        return list(self.eot)

    def describe(self) -> dict:
        c, w = self.config, self.weights or {}
        return {
            "name": self.name, "source": self.source,
            "architecture": (getattr(self.top_config, "architectures", None) or ["?"])[0],
            "model_type": c.model_type, "layers": self.num_layers, "hidden_size": self.hidden_size,
            "intermediate_size": getattr(c, "intermediate_size", None),
            "attention_heads": c.num_attention_heads, "kv_heads": getattr(c, "num_key_value_heads", None),
            "vocab_size": self.vocab_size, "chat_template": self.has_chat_template,
            "eot_tokens": [self.tokenizer.convert_ids_to_tokens(i) for i in self.eot],
            "aux_layers": self.aux_layers, "default_aux_layers": default_aux_layers(self.num_layers),
            "dtype": self.dtype, "device": self.device, "parameters": w.get("parameters"),
            "weights": (f"{w['files']} file(s), {human_bytes(w['bytes'])}, {w['present']} on this machine"
                        if w else None),
            "sha256": self.sha256,
        }


def header_tensors(path: Path) -> dict[str, list[int]]:
    """The tensors a safetensors file holds, by name, with their shapes: its JSON header alone is read."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > 100_000_000:
                raise ValueError(f"a header of {n:,} bytes")
            head = json.loads(f.read(n))
        return {k: v["shape"] for k, v in head.items() if k != "__metadata__"}
    except (OSError, ValueError, struct.error, KeyError, TypeError) as e:
        raise EyasError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def weight_summary(folder: Path) -> dict:
    """The safetensors files a folder holds or its index names: how many, how many are here, their bytes, and the
    parameters they hold where every one is here (each file's header only is read)."""
    index = folder / "model.safetensors.index.json"
    files: list[str] = []
    total = 0
    if index.is_file():
        try:
            data = json.loads(index.read_text())
            files = sorted(set(data["weight_map"].values()))
            total = int((data.get("metadata") or {}).get("total_size") or 0)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise EyasError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    present = [f for f in files if (folder / f).is_file()]
    if not total:
        total = sum((folder / f).stat().st_size for f in present)
    params = None
    if files and len(present) == len(files):
        params = 0
        for f in present:
            for shape in header_tensors(folder / f).values():
                n = 1
                for d in shape:
                    n *= d
                params += n
    return {"files": len(files), "present": len(present), "bytes": total, "parameters": params}


def _spec_source(cfg: TargetConfig) -> tuple[str, str, Path | None]:
    """(folder or hub id with config.json and tokenizer, identity hash, GGUF file to read the header of or None):
    resolve_source's answer, but a GGUF file is not dequantized for it; its cache is used where it exists."""
    gguf = None
    if cfg.name in PRESET_GGUF:
        gguf = find_preset_gguf(cfg.name, cfg)
    elif Path(cfg.name).expanduser().suffix == ".gguf" and Path(cfg.name).expanduser().is_file():
        gguf = Path(cfg.name).expanduser()
    if gguf is None:
        source, digest = resolve_source(cfg)
        return source, digest, None
    gguf = gguf.resolve()
    digest = file_sha256(gguf, cfg)
    cached = gguf_cache_dir(digest, cfg)
    if (cached / "done.json").exists():
        return str(cached), digest, None
    return str(gguf), digest, gguf


def _config_of(cfg: TargetConfig, source: str, gguf: Path | None):
    from transformers import AutoConfig

    try:
        if gguf is not None:
            return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        return AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        if gguf is not None:
            raise EyasError(f"could not read the header of the GGUF file {gguf}: {_why(e)}") from None
        raise _load_error(cfg, source, "config", e) from None


def _generation_config(source: str | None, config):
    """The generation config from_pretrained gives the model: the folder's generation_config.json, else the one
    made from the model's config."""
    from transformers import GenerationConfig

    try:
        if source is None:
            raise OSError("no folder")
        return GenerationConfig.from_pretrained(source)
    except (OSError, ValueError, TypeError):
        try:
            return GenerationConfig.from_model_config(config)
        except Exception:  # noqa: BLE001 - the tokenizer's EOS is then the one used
            return None


def load_spec(cfg: TargetConfig | None = None) -> TargetSpec:
    """The target described from its config and tokenizer alone (seconds, whatever the size of its weights)."""
    from transformers import AutoTokenizer

    cfg = cfg or TargetConfig()
    _quiet_transformers()
    device = _pick_device(cfg.device)
    dtype = str(_pick_dtype(cfg.dtype, device)).replace("torch.", "")
    source, digest, gguf = _spec_source(cfg)
    top = _config_of(cfg, source, gguf)
    conf = text_config(top)
    dims = {k: getattr(conf, k, None) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
    lacking = [k for k, v in dims.items() if not isinstance(v, int)]
    if lacking:
        raise EyasError(f"target '{cfg.name}': its config ({source}) gives no {' or '.join(lacking)} (nor does a "
                        f"text_config inside it)")
    if gguf is not None:
        try:
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise EyasError(f"could not read the tokenizer in the GGUF file {gguf}: {_why(e)}") from None
        gen = _generation_config(None, top)
    else:
        tok = _tokenizer_from(cfg, source)
        gen = _generation_config(source, top)
    n = conf.num_hidden_layers
    aux = check_aux_layers(cfg.aux_layers or default_aux_layers(n), n)
    folder = Path(source)
    weights = weight_summary(folder) if gguf is None and folder.is_dir() else None
    return TargetSpec(name=cfg.name, source=source, sha256=digest, aux=tuple(aux), config=conf, top_config=top,
                      tokenizer=tok, eot=tuple(find_eot_ids(tok, gen)), device=str(device), dtype=dtype,
                      weights=weights)
