"""The target's head alone: its input embedding, final norm and output layer (`lm_head`, or the embedding where the
two are tied), read by name straight from its safetensors files (through model.safetensors.index.json where the
checkpoint is sharded, so only the shards holding them are opened), never its decoder layers. That is all a
trainer on stored features needs of the target: the embedding for the drafter, the draft vocabulary's rows of
`lm_head` for the target's logits over them from the stored final hidden state (the full-vocabulary argmax is
stored with the features), the norm to start the drafter's own from. An untied `lm_head` is read only when asked
for, whole or those rows alone (through safetensors slices, a bounded chunk at a time).

Checkpoints name these tensors by their model's layout: `model.embed_tokens.weight` and `lm_head.weight` in a
plain causal LM, `language_model.model.embed_tokens.weight` / `language_model.lm_head.weight` or
`model.language_model.embed_tokens.weight` under a multimodal wrapper. The embedding is the one tensor named
`embed_tokens` (or `wte`, `tok_embeddings`, `word_embeddings`) outside any numbered layer and any vision or audio
tower; the final norm sits beside it; the head is the `lm_head` (or `output`) outside any layer, nearest to it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from .config import TargetConfig
from .target import _pick_device, _pick_dtype, load_target, text_config
from .target_source import gguf_to_hf
from .target_spec import header_tensors, load_spec
from .util import EyasError, log

EMBED_NAMES = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings")
NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm")
HEAD_NAMES = ("lm_head", "output")
# towers of a multimodal checkpoint whose tensors are never the text model's head
TOWERS = re.compile(r"(^|\.)(vision|visual|vision_tower|vision_model|vision_encoder|audio|audio_tower|"
                    r"multi_modal_projector|mm_projector|image_newline)(\.|$)")


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
    for c in (text_config(config), config):
        v = getattr(c, "tie_word_embeddings", None)
        if v is not None:
            return bool(v)
    return True  # transformers' default


class HeadRows(nn.Module):
    """Some rows of the target's output layer (the draft vocabulary's): its logits over those token ids alone.
    `ids` [n] long, sorted: the rows' token ids; `vocab_size`: the rows of the whole layer."""

    def __init__(self, ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, vocab_size: int):
        super().__init__()
        self.register_buffer("ids", ids.to(device=weight.device, dtype=torch.long), persistent=False)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class TargetHead:
    """The embedding, final norm and output layer of a target, with its description (a TargetSpec: name, identity,
    tokenizer, config... are the spec's). Stands in for eyas.target.Target wherever only these are used.
    `read_head(ids)` -> (weight, bias or None) reads the output layer where it is not the embedding: its rows `ids`
    (lm_head_rows) or all of them (ids None, lm_head), each when first asked for, so a trainer that needs only the
    draft vocabulary's rows never holds the rest."""

    def __init__(self, spec, embed: torch.Tensor, norm: torch.Tensor | None, read_head=None, names: tuple = (),
                 head_vocab: int = 0):
        self.spec = spec
        self.head_vocab = head_vocab or embed.shape[0]  # the output layer's rows
        self.names = names  # the tensors' names in the checkpoint: (embedding, norm, head)
        self._embed = nn.Embedding.from_pretrained(embed, freeze=True)
        self._norm = norm
        self._read_head = read_head
        self._head: nn.Module | None = None
        self._rows: HeadRows | None = None
        if read_head is None:  # tied: the output layer is the embedding
            self._head = nn.Linear(embed.shape[1], embed.shape[0], bias=False, device="meta", dtype=embed.dtype)
            self._head.weight = self._embed.weight

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
        """The whole output layer (read from the checkpoint the first time)."""
        if self._head is None:
            w, b = self._read_head(None)
            self._head = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta", dtype=w.dtype)
            self._head.weight = nn.Parameter(w, requires_grad=False)
            if b is not None:
                self._head.bias = nn.Parameter(b, requires_grad=False)
            self._rows = None  # any rows held are the whole layer's now
        return self._head

    def lm_head_rows(self, ids: torch.Tensor) -> nn.Module:
        """The output layer's rows of the sorted token ids `ids` alone (a HeadRows, read once), where the layer is
        not held whole already; else the whole layer (a tied one is the embedding, held anyway)."""
        if self._head is not None:
            return self._head
        ids = torch.as_tensor(ids, dtype=torch.long).cpu()
        if self._rows is None or not torch.equal(self._rows.ids.cpu(), ids):
            if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
                raise EyasError("the draft vocabulary's token ids are not sorted ascending and distinct")
            w, b = self._read_head(ids)
            self._rows = HeadRows(ids, w, b, self.head_vocab)
        return self._rows

    def final_norm_weight(self) -> torch.Tensor | None:
        return self._norm

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held, once (a tied head is the embedding)."""
        held = [self._embed.weight, self._norm]
        for m in (self._head, self._rows):
            if m is not None:
                held += [m.weight, m.bias]
        out = {id(t): t for t in held if t is not None}
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


def draft_rows(target, ids: torch.Tensor) -> nn.Module:
    """The target's output layer as far as the draft vocabulary `ids` needs it: its rows alone (HeadRows) where
    the target holds its head alone, else the whole layer (a loaded model's, or a tied one: the embedding)."""
    rows = getattr(target, "lm_head_rows", None)
    return rows(ids) if rows is not None else target.lm_head()


def head_for_labels(target, ids: torch.Tensor, features) -> nn.Module:
    """What the trainer's labels (eyas.train.ttt.target_labels) read of the target's output layer: the draft vocabulary's
    rows where every feature set in `features` carries the target's top token (its full-vocabulary argmax, stored
    by extraction), else the whole layer, which that argmax needs."""
    old = [f for f in features if f is not None and not getattr(f, "carries_top", True)]
    if old and hasattr(target, "lm_head_rows"):
        log(f"train: the features in {getattr(old[0], 'dir', 'the run')} do not carry the target's top token "
            f"(extracted by an older eyas): reading the target's whole output layer to compute it; extract them "
            f"again to hold only the draft vocabulary's rows")
        return target.lm_head()
    return draft_rows(target, ids)


def needs_whole_target(cfg) -> str:
    """Why training `cfg` runs the target's decoder layers, in words; "" where its head is all it needs (stored
    features, no greedy validation answers to make)."""
    if cfg.train.online and not cfg.features.from_vllm:  # from vLLM, the head norms and ranks the engine's states
        return "its features are computed online (train.online)"
    if cfg.train.greedy_val > 0:
        return ("the target answers validation prompts greedily (train.greedy_val; --greedy-val 0 trains holding "
                "its head alone)")
    return ""


def load_for_training(cfg, tcfg: TargetConfig, spec=None):
    """What the trainer holds of the target: the whole model where it runs its layers (needs_whole_target), else
    its head alone (TargetHead)."""
    why = needs_whole_target(cfg)
    if why:
        log(f"train: loading the whole target: {why}")
        return load_target(tcfg)
    return load_target_head(tcfg, spec)


def _check_float(path: Path, name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point() or t.element_size() == 1:  # int8/fp8 weights need their scales, not read here
        raise EyasError(f"{path}: tensor {name} is stored as {str(t.dtype).replace('torch.', '')}, a quantized "
                        f"format; eyas reads the target's embedding, norm and head in 16 or 32 bits")


def _path(files: dict[str, Path], name: str) -> Path:
    path = files[name]
    if not path.is_file():
        raise EyasError(f"target weights: {path.name} (which holds {name}) is not in {path.parent}")
    return path


def _damaged(path: Path, name: str, e: Exception) -> EyasError:
    return EyasError(f"{path}: could not read tensor {name} ({type(e).__name__}: {e}); the file may be cut "
                     f"short: fetch it again")


def _read(files: dict[str, Path], name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    path = _path(files, name)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            t = f.get_tensor(name)
    except Exception as e:  # noqa: BLE001 - a damaged or cut-short shard is the user's to fetch again
        raise _damaged(path, name, e) from None
    _check_float(path, name, t)
    return t.to(device=device, dtype=dtype)


def row_spans(ids: list[int], max_rows: int, gap: int = 16) -> list[tuple[int, int]]:
    """[start, stop) row ranges covering the sorted `ids`: neighbours less than `gap` rows apart share one range
    (one read instead of several), and no range is longer than `max_rows` unless one id alone needs it."""
    spans: list[list[int]] = []
    for i in ids:
        if spans and i - spans[-1][1] < gap and i + 1 - spans[-1][0] <= max_rows:
            spans[-1][1] = i + 1
        else:
            spans.append([i, i + 1])
    return [(a, b) for a, b in spans]


def read_rows(files: dict[str, Path], name: str, ids: torch.Tensor, dtype: torch.dtype, device: torch.device,
              chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """Rows `ids` (sorted, distinct) of the 2-D tensor `name`, read through safetensors slices of at most about
    `chunk_bytes` each, so the host never holds the whole tensor -> [len(ids), columns] in dtype on device."""
    path = _path(files, name)
    idx = ids.tolist()
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            sl = f.get_slice(name)
            rows, cols = sl.get_shape()
            if idx and (idx[0] < 0 or idx[-1] >= rows):
                raise EyasError(f"{path}: tensor {name} has {rows} rows; the draft vocabulary asks for row "
                                f"{idx[-1] if idx[-1] >= rows else idx[0]}")
            out = torch.empty(len(idx), cols, dtype=dtype, device=device)
            per_row = max(1, cols * 4)  # bytes of a row at most (32-bit), before the dtype is known
            k = 0
            for a, b in row_spans(idx, max(1, chunk_bytes // per_row)):
                t = sl[a:b]
                _check_float(path, name, t)
                keep = torch.tensor([i - a for i in idx[k:k + (b - a)] if i < b], dtype=torch.long)
                out[k:k + keep.numel()].copy_(t.index_select(0, keep))
                k += keep.numel()
    except EyasError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged or cut-short shard is the user's to fetch again
        raise _damaged(path, name, e) from None
    return out


def _head_reader(files: dict[str, Path], head_n: str, dtype: torch.dtype, device: torch.device):
    """read_head for TargetHead: the output layer's weight and bias (where it has one), all rows or `ids`."""
    bias_n = head_n[:-len(".weight")] + ".bias"

    def read(ids: torch.Tensor | None):
        if ids is None:
            w = _read(files, head_n, dtype, device)
            b = _read(files, bias_n, dtype, device) if bias_n in files else None
        else:
            w = read_rows(files, head_n, ids, dtype, device)
            b = _read(files, bias_n, dtype, device)[ids.to(device)] if bias_n in files else None
        log(f"target: read {'all' if ids is None else f'{ids.numel():,}'} rows of {head_n} "
            f"({w.numel() * w.element_size() / 2**20:,.1f} MiB)")
        return w, b

    return read


def load_target_head(cfg: TargetConfig | None = None, spec=None):
    """The target's embedding, final norm and head on cfg.device in cfg.dtype (as load_target would place them),
    read from its safetensors files by name; an output layer that is not the embedding is read when first asked
    for, whole (lm_head) or the rows the caller needs (lm_head_rows). A GGUF target's come from eyas' dequantized
    cache (made first where it is missing). `spec`: the target's TargetSpec where the caller has it. -> a
    TargetHead; for a hub id, the whole Target (which has the same methods)."""
    cfg = cfg or TargetConfig()
    spec = spec or load_spec(cfg)
    folder = Path(spec.source)
    if str(spec.source).endswith(".gguf"):  # not dequantized yet: the cache holds it as safetensors
        folder, _ = gguf_to_hf(Path(spec.source), cfg)
    if not folder.is_dir():  # a hub id: transformers fetches and loads it whole
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
    read_head, head_vocab = None, 0
    if head_n != embed_n:  # its shape now, from its file's header; its weights when asked for
        shape = header_tensors(_path(files, head_n)).get(head_n)
        if shape is None or len(shape) != 2 or shape[1] != spec.hidden_size or shape[0] < spec.vocab_size:
            raise EyasError(f"{files[head_n]}: {head_n} is {shape}, not the [vocab {spec.vocab_size}, hidden "
                            f"{spec.hidden_size}] the target's config gives")
        read_head, head_vocab = _head_reader(files, head_n, dtype, device), shape[0]
    t = TargetHead(spec, embed, norm, read_head, names=(embed_n, norm_n, head_n), head_vocab=head_vocab)
    log(f"target: {cfg.name}'s head read from {folder} ({embed_n}, {norm_n or 'no final norm'}, "
        f"{'tied to the embedding' if read_head is None else head_n + ' when needed'}; "
        f"{t.bytes_held() / 2**20:,.1f} MiB), no decoder layer loaded")
    return t
