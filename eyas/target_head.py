"""The target's head alone: its input embedding, final norm and output layer (`lm_head`, or the embedding where the
two are tied), read by name straight from its safetensors files (through model.safetensors.index.json where the
checkpoint is sharded, so only the shards holding them are opened), never its decoder layers. That is all a
trainer on stored features needs of the target: the embedding for the drafter, `lm_head` for the target's logits
from the stored final hidden state, the norm to start the drafter's own from.

Checkpoints name these tensors by their model's layout: `model.embed_tokens.weight` and `lm_head.weight` in a
plain causal LM, `language_model.model.embed_tokens.weight` / `language_model.lm_head.weight` or
`model.language_model.embed_tokens.weight` under a multimodal wrapper. The embedding is the one tensor named
`embed_tokens` (or `wte`, `tok_embeddings`, `word_embeddings`) outside any numbered layer and any vision or audio
tower; the final norm sits beside it; the head is the `lm_head` (or `output`) outside any layer, nearest to it.
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import torch
from torch import nn

from .config import TargetConfig
from .util import EyasError, log

EMBED_NAMES = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings")
NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm")
HEAD_NAMES = ("lm_head", "output")
# towers of a multimodal checkpoint whose tensors are never the text model's head
TOWERS = re.compile(r"(^|\.)(vision|visual|vision_tower|vision_model|vision_encoder|audio|audio_tower|"
                    r"multi_modal_projector|mm_projector|image_newline)(\.|$)")


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


def tensor_files(folder: Path) -> dict[str, Path]:
    """Where each tensor of a checkpoint folder is: its index's weight_map, else the headers of its files."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise EyasError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    out: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({k: f for k in header_tensors(f)})
    if not out:
        raise EyasError(f"target folder {folder} holds no safetensors weights (model.safetensors, or shards with "
                        f"model.safetensors.index.json)")
    return out


def _split(name: str) -> tuple[str, str] | None:
    """(prefix, module) of a `<prefix><module>.weight` name outside numbered layers and towers, else None."""
    if not name.endswith(".weight") or TOWERS.search(name) or any(p.isdigit() for p in name.split(".")):
        return None
    stem = name[:-len(".weight")]
    prefix, _, module = stem.rpartition(".")
    return (prefix + "." if prefix else ""), module


def head_names(names, tied: bool, where: str = "the checkpoint") -> tuple[str, str | None, str]:
    """(embedding, final norm or None, output layer) tensor names among a checkpoint's `names`; the output layer is
    the embedding's name where the checkpoint has no head of its own and the config ties the two."""
    parts = {n: s for n in names if (s := _split(n))}
    embeds = [n for n, (_, m) in parts.items() if m in EMBED_NAMES]
    if len(embeds) != 1:
        raise EyasError(f"{where}: cannot tell the target's input embedding: " +
                        (f"{len(embeds)} tensors could be it ({', '.join(sorted(embeds))})" if embeds else
                         f"no tensor named like {', '.join(f'*.{e}.weight' for e in EMBED_NAMES)}"))
    embed = embeds[0]
    base = parts[embed][0]
    norm = next((base + m + ".weight" for m in NORM_NAMES if base + m + ".weight" in parts), None)
    heads = [n for n, (p, m) in parts.items() if m in HEAD_NAMES and base.startswith(p) and n != embed]
    heads.sort(key=lambda n: -len(parts[n][0]))  # the nearest to the embedding's module
    if heads:
        return embed, norm, heads[0]
    if not tied:
        raise EyasError(f"{where}: the target's output layer is not tied to its embedding (tie_word_embeddings is "
                        f"off) but no tensor is named like *.lm_head.weight")
    return embed, norm, embed


def is_tied(config) -> bool:
    """Whether the output layer shares the embedding's weight: the text config's tie_word_embeddings where it says,
    else the wrapper's."""
    from .target import text_config

    for c in (text_config(config), config):
        v = getattr(c, "tie_word_embeddings", None)
        if v is not None:
            return bool(v)
    return True  # transformers' default


class TargetHead:
    """The embedding, final norm and output layer of a target, with its description (a TargetSpec: name, identity,
    tokenizer, config... are the spec's). Stands in for eyas.target.Target wherever only these are used."""

    def __init__(self, spec, embed: torch.Tensor, norm: torch.Tensor | None, head: torch.Tensor | None,
                 head_bias: torch.Tensor | None = None, names: tuple = ()):
        self.spec = spec
        self.names = names  # the tensors' names in the checkpoint: (embedding, norm, head)
        self._embed = nn.Embedding.from_pretrained(embed, freeze=True)
        self._norm = norm
        self._head = nn.Linear(embed.shape[1], embed.shape[0], bias=head_bias is not None,
                               device="meta", dtype=embed.dtype)
        self._head.weight = self._embed.weight if head is None else nn.Parameter(head, requires_grad=False)
        if head_bias is not None:
            self._head.bias = nn.Parameter(head_bias, requires_grad=False)

    def __getattr__(self, name):  # what the spec knows (name, sha256, config, tokenizer, identity(), ...)
        if name == "spec":
            raise AttributeError(name)
        return getattr(self.spec, name)

    @property
    def device(self) -> torch.device:
        return self._embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._embed.weight.dtype

    def embed_tokens(self) -> nn.Module:
        return self._embed

    def lm_head(self) -> nn.Module:
        return self._head

    def final_norm_weight(self) -> torch.Tensor | None:
        return self._norm

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held, once (a tied head is the embedding)."""
        out = {id(t): t for t in (self._embed.weight, self._norm, self._head.weight, self._head.bias)
               if t is not None}
        return list(out.values())

    def bytes_held(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def target_bytes_held(target) -> int:
    """The bytes of the target's weights a process holds: the head's where only that is loaded, else the whole
    model's."""
    if isinstance(target, TargetHead):
        return target.bytes_held()
    model = getattr(target, "model", None)
    if model is None:
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters())


def needs_whole_target(cfg) -> str:
    """Why training `cfg` runs the target's decoder layers, in words; "" where its head is all it needs (stored
    features, no greedy validation answers to make)."""
    if cfg.train.online:
        return "its features are computed online (train.online)"
    if cfg.train.greedy_val > 0:
        return ("the target answers validation prompts greedily (train.greedy_val; --greedy-val 0 trains holding "
                "its head alone)")
    return ""


def load_for_training(cfg, tcfg: TargetConfig, spec=None):
    """What the trainer holds of the target: the whole model where it runs its layers (needs_whole_target), else
    its head alone (TargetHead)."""
    from .target import load_target

    why = needs_whole_target(cfg)
    if why:
        log(f"train: loading the whole target: {why}")
        return load_target(tcfg)
    return load_target_head(tcfg, spec)


def _read(files: dict[str, Path], name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    from safetensors import safe_open

    path = files[name]
    if not path.is_file():
        raise EyasError(f"target weights: {path.name} (which holds {name}) is not in {path.parent}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            t = f.get_tensor(name)
    except Exception as e:  # noqa: BLE001 - a damaged or cut-short shard is the user's to fetch again
        raise EyasError(f"{path}: could not read tensor {name} ({type(e).__name__}: {e}); the file may be cut "
                        f"short: fetch it again") from None
    if not t.is_floating_point() or t.element_size() == 1:  # int8/fp8 weights need their scales, not read here
        raise EyasError(f"{path}: tensor {name} is stored as {str(t.dtype).replace('torch.', '')}, a quantized "
                        f"format; eyas reads the target's embedding, norm and head in 16 or 32 bits")
    return t.to(device=device, dtype=dtype)


def load_target_head(cfg: TargetConfig | None = None, spec=None):
    """The target's embedding, final norm and head on cfg.device in cfg.dtype (as load_target would place them),
    read from its safetensors files by name. A GGUF target's come from eyas' dequantized cache (made first where
    it is missing). `spec`: the target's TargetSpec where the caller has it. -> a TargetHead; for a hub id, the
    whole Target (which has the same methods)."""
    from .target import _pick_device, _pick_dtype, gguf_to_hf
    from .target_spec import load_spec

    cfg = cfg or TargetConfig()
    spec = spec or load_spec(cfg)
    folder = Path(spec.source)
    if str(spec.source).endswith(".gguf"):  # not dequantized yet: the cache holds it as safetensors
        folder, _ = gguf_to_hf(Path(spec.source), cfg)
    if not folder.is_dir():  # a hub id: transformers fetches and loads it whole, as before
        from .target import load_target

        log(f"target: {cfg.name} is a hub id, not a local folder: loading the whole model (its head alone is read "
            f"from a local folder: download it and give its path)")
        return load_target(cfg)
    device = _pick_device(cfg.device)
    dtype = _pick_dtype(cfg.dtype, device)
    files = tensor_files(folder)
    embed_n, norm_n, head_n = head_names(files, is_tied(spec.top_config), where=str(folder))
    embed = _read(files, embed_n, dtype, device)
    if tuple(embed.shape) != (spec.vocab_size, spec.hidden_size) and not (
            embed.shape[1] == spec.hidden_size and embed.shape[0] >= spec.vocab_size):
        raise EyasError(f"{files[embed_n]}: {embed_n} is {list(embed.shape)}, not the [vocab {spec.vocab_size}, "
                        f"hidden {spec.hidden_size}] the target's config gives")
    norm = _read(files, norm_n, dtype, device) if norm_n else None
    head = _read(files, head_n, dtype, device) if head_n != embed_n else None
    bias_n = head_n[:-len(".weight")] + ".bias"
    bias = _read(files, bias_n, dtype, device) if head_n != embed_n and bias_n in files else None
    t = TargetHead(spec, embed, norm, head, bias, names=(embed_n, norm_n, head_n))
    log(f"target: {cfg.name}'s head read from {folder} ({embed_n}, {norm_n or 'no final norm'}, "
        f"{'tied to the embedding' if head is None else head_n}; {t.bytes_held() / 2**20:,.1f} MiB), "
        f"no decoder layer loaded")
    return t
