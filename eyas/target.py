"""Targets: load a causal LM (preset, GGUF file, HF folder or hub id, found by eyas.target_source), describe it, and
capture the hidden states an EAGLE-3 drafter is trained on.

Aux-layer convention (docs/design.md): aux id i means the residual stream *entering* decoder layer i,
which is `output_hidden_states[i]` in transformers (index 0 is the embedding output). The final
state is the output of the model's last norm; `lm_head(final)` gives the target logits.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .aux_layers import check_aux_layers, default_aux_layers
from .config import TargetConfig
from .device_map import parse_device_map
from .engine.fastlm import llama_norm_eps, llama_rms_norm, one_off_kernels
from .target_source import _quiet_transformers, _why, cache_root, resolve_source
from .util import EyasError


class TargetShape:
    """What a loaded target (Target) and its weight-free description (target_spec.TargetSpec) read alike from the
    text model's config and the tokenizer."""

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def identity(self) -> dict:
        """What makes features, vocab maps and drafters belong to this target."""
        return {"name": self.name, "sha256": self.sha256, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "aux_layers": self.aux_layers}


@dataclass
class Target(TargetShape):
    """A loaded target model plus what eyas needs to know about it."""
    model: Any
    tokenizer: Any
    name: str
    source: str
    sha256: str
    aux_layers: list[int]
    eot_token_ids: list[int] = field(default_factory=list)

    @property
    def config(self):
        """The text model's config: a multimodal wrapper's `text_config` (Gemma 3, Qwen-VL, Kimi-K2.5), else the
        model's own."""
        return text_config(self.model.config)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def describe(self) -> dict:
        c = self.config
        arch = (self.model.config.architectures or [type(self.model).__name__])[0]
        return {
            "name": self.name, "source": self.source, "architecture": arch,
            "model_type": c.model_type, "layers": self.num_layers, "hidden_size": self.hidden_size,
            "intermediate_size": getattr(c, "intermediate_size", None),
            "attention_heads": c.num_attention_heads, "kv_heads": getattr(c, "num_key_value_heads", None),
            "vocab_size": self.vocab_size, "chat_template": self.has_chat_template,
            "eot_tokens": [self.tokenizer.convert_ids_to_tokens(i) for i in self.eot_token_ids],
            "aux_layers": self.aux_layers, "default_aux_layers": default_aux_layers(self.num_layers),
            "dtype": str(self.dtype).replace("torch.", ""), "device": str(self.device),
            "parameters": sum(p.numel() for p in self.model.parameters()), "sha256": self.sha256,
        }

    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def lm_head(self) -> torch.nn.Module:
        """The output layer: target logits = lm_head(final hidden state)."""
        return self.model.get_output_embeddings()

    def final_norm_weight(self) -> torch.Tensor | None:
        """The weight of the norm that makes the final hidden state (None where the model has none)."""
        norm = getattr(self.model.get_decoder(), "norm", None)
        return getattr(norm, "weight", None)

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, norm: str = "hf") -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill forward; returns (aux [B,T,3H] = the residual streams entering the aux layers,
        concatenated in aux-layer order; final [B,T,H] = after the last norm). norm: "hf" (the model's own
        RMSNorm modules) or "one_kernel" (each as one fused kernel in the model's dtype, as eyas' decoder)."""
        return capture_hidden(self.model, self.aux_layers, input_ids, attention_mask, position_ids, norm=norm)


def text_config(config):
    """The config of the text model in `config`: transformers' get_text_config() (a multimodal wrapper's
    `text_config`), else `config` itself."""
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def decoder_layers(model) -> torch.nn.ModuleList:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return base.layers


# Captures (extraction, online features) run batches of ever new shapes (length-sorted, cut by a token budget).
# On a GPU, cuDNN's attention builds a plan for each new shape, which costs far more host time than the call
# itself, so a first pass over new shapes runs much slower than a repeated one. So captures take the attention
# kernels that need no plan (fastlm's one-off choice); False keeps
# torch's default choice (bench/bench_extract.py compares the two).
CAPTURE_WITHOUT_CUDNN = True


@contextlib.contextmanager
def norms_one_kernel(model, on: bool = True):
    """Within: each of the model's RMSNorm modules runs as one fused kernel in the input's dtype
    (fastlm.llama_rms_norm's one_kernel, the rounding of eyas' decoder) instead of HF's steps."""
    if not on:
        yield
        return
    mods = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and llama_norm_eps(m) is not None]
    for m in mods:
        m.forward = functools.partial(lambda mod, x: llama_rms_norm(x, mod.weight, mod.variance_epsilon,
                                                                    one_kernel=True), m)
    try:
        yield
    finally:
        for m in mods:
            del m.forward  # the class's forward again


def capture_hidden(model, aux_layers: list[int], input_ids, attention_mask=None, position_ids=None,
                   norm: str = "hf"):
    """The aux and final states in one forward pass, via pre-hooks on the aux layers (no need to
    keep every layer's output as `output_hidden_states` does). Aux id N (= the number of layers)
    is the stream after the last layer, before the norm. norm "one_kernel": the RMSNorms as eyas'
    decoder runs them (norms_one_kernel)."""
    if norm not in ("hf", "one_kernel"):
        raise EyasError(f"capture norm {norm!r}: expected 'hf' or 'one_kernel'")
    layers = decoder_layers(model)
    n = len(layers)
    grabbed: dict[int, torch.Tensor] = {}
    handles = []

    def pre_hook(idx):
        def fn(module, args, kwargs):
            hs = args[0] if args else kwargs["hidden_states"]
            grabbed[idx] = hs
        return fn

    for a in sorted(set(aux_layers)):
        if a < n:
            handles.append(layers[a].register_forward_pre_hook(pre_hook(a), with_kwargs=True))
    want_prenorm = n in aux_layers
    if want_prenorm:
        norm = model.get_decoder().norm
        handles.append(norm.register_forward_pre_hook(pre_hook(n), with_kwargs=True))
    try:
        with one_off_kernels(input_ids.device, on=CAPTURE_WITHOUT_CUDNN), norms_one_kernel(model, norm == "one_kernel"):
            out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                      position_ids=position_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    # a target split by target.device_map leaves each state on its layer's device: gathered where the input is
    final = out.last_hidden_state.to(input_ids.device)
    aux = torch.cat([grabbed[a].to(input_ids.device) for a in aux_layers], dim=-1)
    return aux, final


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise EyasError(f"target.device '{device}' is not a device: give auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EyasError(f"target.device is '{device}' but no CUDA device is available")
    return dev


def _pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def load_tokenizer(cfg: TargetConfig):
    """The target's tokenizer alone (no weights loaded): for counting and decoding tokens."""
    source, _ = resolve_source(cfg)
    return _tokenizer_from(cfg, source)


def _tokenizer_from(cfg: TargetConfig, source: str):
    """The tokenizer in `source`; one message naming the folder when transformers cannot load it."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _load_error(cfg, source, "tokenizer", e) from None


def _load_error(cfg: TargetConfig, source: str, what: str, e: BaseException) -> EyasError:
    """A target that transformers could not load, said in one message (the folder, what failed, its reason)."""
    if "trust_remote_code" in str(e) and not cfg.trust_remote_code:  # transformers' own advice names its argument
        return EyasError(f"target '{cfg.name}' ({source}) needs its own Python code to load its {what} (an auto_map "
                         f"in its config), which eyas does not run unless asked (files are data): read that code, "
                         f"and if you trust it, pass --trust-remote-code (or --set target.trust_remote_code=true)")
    local = Path(source).expanduser().is_dir()
    if not local:  # a hub id: perhaps a local path mistyped, which would have been taken for one
        return EyasError(f"could not load the {what} of target '{cfg.name}', taken as a model id on the Hugging Face "
                         f"hub since no folder {Path(source).expanduser().resolve()} exists: {_why(e)}. A local model "
                         f"is a folder with config.json, or a .gguf file: check the path")
    conf = Path(source) / "config.json"
    try:
        json.loads(conf.read_text())
        hint = (" (the folder needs tokenizer.json, or a slow tokenizer's files with sentencepiece installed)"
                if what == "tokenizer" else "")
    except (OSError, ValueError):
        hint = f" ({conf} is missing or not valid JSON)"
    return EyasError(f"could not load the {what} of target '{cfg.name}' from {source}: {_why(e)}{hint}")


def damaged_weights(source: str, e: BaseException) -> EyasError:
    """The target's weights file that safetensors could not read (`e`), found by reading each one's header, in one
    message: the file, the reason, and how to get it whole again (a GGUF's dequantized cache is made anew once
    removed)."""
    folder = Path(source).expanduser()
    bad = None
    for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        try:
            with safe_open(str(f), framework="pt") as h:
                h.keys()
        except (SafetensorError, OSError) as err:
            bad, e = f, err
            break
    where = bad or folder
    cached = cache_root() in folder.resolve().parents or (folder / "done.json").exists()
    fix = (f"delete {folder} and eyas dequantizes the GGUF file into it again" if cached
           else "copy or download the target's weights again")
    size = f" ({bad.stat().st_size:,} bytes)" if bad is not None else ""
    return EyasError(f"{where}: the target's weights cannot be read{size}: {' '.join(str(e).split())[:300]}; the "
                     f"file is cut short or damaged: {fix}")


def find_eot_ids(tokenizer, generation_config=None) -> list[int]:
    """Token ids that end an assistant turn: the special token the chat template writes right after
    an assistant message, plus the tokenizer's and generation config's EOS."""
    ids: list[int] = []
    if getattr(tokenizer, "chat_template", None):
        marker = "Zq9Xv"
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False)
            after = text[text.index(marker) + len(marker):]
            first = tokenizer(after, add_special_tokens=False).input_ids[:1]
            special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
            if first and first[0] in special:
                ids.append(first[0])
        except Exception:  # a template that cannot render this is checked elsewhere
            pass
    for e in [getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id]:
        for i in (e if isinstance(e, (list, tuple)) else [e]):
            if i is not None and i not in ids:
                ids.append(int(i))
    # a GGUF tokenizer may name <|im_start|> as EOS; a token that *starts* a turn never ends one
    start = tokenizer.convert_tokens_to_ids("<|im_start|>") if "<|im_start|>" in tokenizer.get_vocab() else None
    return [i for i in ids if i != start] or ids


def _tp_world(cfg: TargetConfig, allow_tp: bool) -> int:
    """The tensor-parallel process count (0: not tensor parallel), or a clear error where it cannot be."""
    if not cfg.tensor_parallel:
        return 0
    if not allow_tp:
        raise EyasError("target.tensor_parallel splits the target over torchrun processes for `eyas extract` only; "
                        "run the other stages without it (train from the extracted features: --no-online)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        raise EyasError("target.tensor_parallel needs several processes: run `torchrun --nproc-per-node N -m eyas "
                        "extract ... --tensor-parallel`")
    return world


def _auto_class(source: str):
    """The transformers auto class that loads `source`: AutoModelForCausalLM, or for a multimodal wrapper it does
    not map (LLaVA, Qwen2.5-VL, Qwen3-VL: their text model under text_config) AutoModelForImageTextToText, whose
    decoder (get_decoder()) is that text model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    try:
        model_type = json.loads((Path(source) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):  # a hub id, or a config the loader will name
        return AutoModelForCausalLM
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_target(cfg: TargetConfig | None = None, allow_tp: bool = False) -> Target:
    """Load the target. With cfg.tensor_parallel (only where the caller allows it: extraction under
    torchrun, the process group already initialised) every process holds a slice of each layer."""
    cfg = cfg or TargetConfig()
    _quiet_transformers()
    tp = _tp_world(cfg, allow_tp)
    source, digest = resolve_source(cfg)
    device = _pick_device(cfg.device)
    dtype = _pick_dtype(cfg.dtype, device)
    tok = _tokenizer_from(cfg, source)
    placed = {"tp_plan": "auto"} if tp else {}
    if cfg.device_map:  # split over the node's devices by transformers; placed as it loads
        if tp:
            raise EyasError("target.device_map and target.tensor_parallel both split the target: choose one")
        placed = {"device_map": parse_device_map(cfg.device_map)}
        if isinstance(placed["device_map"], dict) and "disk" in placed["device_map"].values():
            placed["offload_folder"] = str(cache_root(cfg) / "offload")  # layers read from disk as they run
    try:
        model = _auto_class(source).from_pretrained(source, dtype=dtype, trust_remote_code=cfg.trust_remote_code,
                                                    **placed)
    except OSError as e:
        raise _load_error(cfg, source, "model", e) from None
    except SafetensorError as e:  # a weights file cut short (a copy or download that stopped) or damaged
        raise damaged_weights(source, e) from None
    except (ValueError, RuntimeError, AssertionError, KeyError, TypeError) as e:
        if not tp:
            raise _load_error(cfg, source, "model", e) from None
        raise EyasError(f"target '{cfg.name}' could not be split over {tp} processes with transformers' "
                        f"tensor-parallel plan ({type(e).__name__}: {e}); its attention heads must divide "
                        f"evenly by the process count") from None
    if not placed:  # a tensor-parallel model is already placed, one slice per process; a device_map'ed one too
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    n = text_config(model.config).num_hidden_layers
    aux = check_aux_layers(cfg.aux_layers or default_aux_layers(n), n)
    return Target(model=model, tokenizer=tok, name=cfg.name, source=source, sha256=digest, aux_layers=aux,
                  eot_token_ids=find_eot_ids(tok, getattr(model, "generation_config", None)))
