"""The target a run trained on, written as a transformers folder that SGLang and vLLM can serve.

A preset or a .gguf target is dequantized by eyas (eyas.target.gguf_to_hf) and the drafter learns that model's
hidden states; the hub model of the same name holds other weights (the unquantized original), so serving the drafter
beside it would not be serving what it was trained with. `eyas export` therefore writes <run>/export/target/:
config.json, the safetensors files of exactly the weights eyas loaded (hard links to its dequantized cache where the
file system allows, else copies), generation_config.json and the tokenizer with its chat template, and names that
folder as the exported drafters' target. A target that already is a transformers folder or a hub id is named as it
is. The end-of-turn tokens are the ones eyas stops a turn at (eyas.target.find_eot_ids): a GGUF's tokenizer may
name another token as its EOS (SmolLM2's names <|im_start|>), and an engine stops at the tokenizer's EOS too.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from .fresh_folder import fresh_folder
from .target import find_eot_ids
from .target_source import PRESET_GGUF, resolve_source
from .util import EyasError, atomic_write_json, log, share, writing

MARKER = "eyas_target.json"  # what the folder was written from; also tells a target folder eyas may replace
WEIGHT_PATTERNS = ("*.safetensors", "model.safetensors.index.json")
# hub ids of the presets, written as the verifier a served drafter belongs to
PRESET_HUB_IDS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
                  "qwen-coder-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
                  "qwen-coder-1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct"}


def needs_folder(tcfg) -> bool:
    """Whether the target is one eyas builds itself (a preset, a .gguf file): only then is a folder written."""
    return tcfg.name == "tiny" or tcfg.name in PRESET_GGUF or Path(tcfg.name).suffix == ".gguf"


def write_target_folder(tcfg, out: Path) -> Path:
    """Write the target of `tcfg` into `out` as a transformers folder (see the module docstring); `out` is replaced
    whole, never left half-written."""
    from transformers import AutoTokenizer, GenerationConfig

    source, digest = resolve_source(tcfg)
    src = Path(source)
    weights = [p for pat in WEIGHT_PATTERNS for p in sorted(src.glob(pat))]
    if not (src / "config.json").is_file() or not any(p.suffix == ".safetensors" for p in weights):
        raise EyasError(f"{src}: the target's files are not complete (config.json and safetensors expected); "
                        f"delete the folder and eyas builds it again")
    tok = AutoTokenizer.from_pretrained(source)
    try:
        gen = GenerationConfig.from_pretrained(source)
    except OSError:
        gen = GenerationConfig()
    eot = find_eot_ids(tok, gen)
    with fresh_folder(out, _check_replaceable) as tmp:
        for f in [src / "config.json", *weights]:
            _link_or_copy(f, tmp / f.name, out / f.name)
        if eot:
            gen.eos_token_id = eot if len(eot) > 1 else eot[0]
            if tok.eos_token_id not in eot:  # the engines stop at the tokenizer's EOS as well
                tok.eos_token = tok.convert_ids_to_tokens(eot[0])
        with writing(out):  # a full disk named as the folder
            gen.save_pretrained(tmp)
            tok.save_pretrained(tmp)
        atomic_write_json(tmp / MARKER, {"target": tcfg.name, "source": str(src), "sha256": digest,
                                         "eos_token_ids": eot})
    log(f"export: wrote the target eyas trained with as a transformers folder for the engines: {out}")
    return out


def serve_target(cfg, run: Path) -> str:
    """The target the exports name: <run>/export/target (written here) for a preset or a .gguf target when
    export.target_folder is on, else the hub id of a preset or the target as given."""
    if not (cfg.export.target_folder and needs_folder(cfg.target)):
        return verifier_name(cfg.target)
    return str(write_target_folder(cfg.target, run / "export" / "target").resolve())


def verifier_name(target_cfg) -> str:
    return PRESET_HUB_IDS.get(target_cfg.name, target_cfg.name)


def _link_or_copy(src: Path, dst: Path, shown: Path) -> None:
    """A hard link to `src` (eyas' dequantized cache, never rewritten in place), or a copy across file systems; made
    readable as a plain file is (the cache's safetensors file is its owner's alone, which keeps an engine run as
    another user from reading it). A failed copy (a full disk) is named as `shown`."""
    try:
        os.link(src, dst)
    except OSError:
        with writing(shown, src.stat().st_size):
            shutil.copyfile(src, dst)
    share(dst)


def _check_replaceable(out: Path) -> None:
    """Refuse to replace a folder eyas did not write as a target folder."""
    if not out.exists():
        return
    if not out.is_dir() or not (out / MARKER).is_file():
        raise EyasError(f"{out}: exists and is not a target folder eyas wrote (no {MARKER}), and the export replaces "
                        f"the whole folder: move it away, or set export.target_folder=false")
