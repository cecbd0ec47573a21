"""The EAGLE-3 drafter (Llama-style), as docs/design.md describes it.

    h   = fc(concat(aux_0, aux_1, aux_2))           # 3·H_t -> H   (first step only)
    x   = concat(input_layernorm(embed(tok)), hidden_norm(h))         # 2H
    h'  = h + o_proj(attn(q(x), k(x), v(x)))
    h'' = h' + mlp(post_attention_layernorm(h'))    # fed back as the next step's h
    logits = lm_head(norm(h''))                     # over the draft vocabulary

With `num_hidden_layers` L > 1 (vLLM's multi-layer EAGLE-3), layers 1..L-1 follow the first as plain pre-norm
Llama layers over H (q/k/v take input_layernorm(h), no embedding, no hidden_norm), named `layers.<i>.*`, and the
last layer's output is what is fed back and normed into the logits.

Parameter names follow the EAGLE/SGLang layout (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`) so a checkpoint is that format already. Attention is a function the caller passes in
(`attend(q, k, v) -> out`): plain causal attention by default, the training-time-test pattern in
`ttt.py`, cached attention in `decode.py`. The model code never mentions caches or TTT.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from safetensors.torch import save_file

from .aux_layers import check_drafter_aux_layers
from .draft_config import (EYAS_FORMAT, NON_FINITE, DraftConfig, check_fits, check_tensors, read_eyas_config,
                           read_safetensors, shapes_of)
from .engine.fastlm import compiled, fuse_linears, held_fusion, llama_rms_norm
from .rope import RopeFrequencies
from .util import DAMAGED, EyasError, atomic_path, refuse_non_finite, writing

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    one_kernel = False  # Eagle3Drafter.fuse sets it on each norm for decoding (llama_rms_norm's one_kernel)

    def forward(self, x):
        return llama_rms_norm(x, self.weight, self.eps, one_kernel=self.one_kernel)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


def causal_attend(q, k, v):
    """Plain causal attention with grouped KV heads. q [B,h,T,d], k/v [B,kv,T,d]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    def __init__(self, c: DraftConfig, width: int = 2):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(width * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(width * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(width * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        if c.layer_type == "qwen3":  # Qwen3's attention: an RMSNorm over each q and k head before rope
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x, cos, sin, attend: Attend):
        return self.out(attend(*self.qkv(x, cos, sin)))

    def qkv(self, x, cos, sin):
        """q [B,h,T,d], k and v [B,kv,T,d], rope applied to q and k."""
        B, T, _ = x.shape
        c = self.c
        nh, nkv = c.num_attention_heads, c.num_key_value_heads
        qkv = _fused(self, ("q_proj", "k_proj", "v_proj"))
        qk_norm = "q_norm" in self._modules
        if qkv is not None:  # one product, and rope on q and k at once (Eagle3Drafter.fuse)
            y = F.linear(x, qkv).view(B, T, nh + 2 * nkv, c.head_dim).transpose(1, 2)
            if qk_norm:
                q, k = self.q_norm(y[:, :nh]), self.k_norm(y[:, nh:nh + nkv])
                return apply_rope(q, cos, sin), apply_rope(k, cos, sin), y[:, nh + nkv:]
            qk = apply_rope(y[:, :nh + nkv], cos, sin)
            return qk[:, :nh], qk[:, nh:], y[:, nh + nkv:]
        q = self.q_proj(x).view(B, T, nh, c.head_dim)
        k = self.k_proj(x).view(B, T, nkv, c.head_dim)
        v = self.v_proj(x).view(B, T, nkv, c.head_dim).transpose(1, 2)
        if qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v

    def out(self, o):
        """The attention's output [B,h,T,d] through o_proj: [B,T,H]."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        gu = _fused(self, ("gate_proj", "up_proj"))
        if gu is not None:
            gate, up = F.linear(x, gu).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _fused(module: nn.Module, names: tuple[str, ...]) -> torch.Tensor | None:
    """The fused weight of these projections while Eagle3Drafter.fuse has them on and each projection's
    weight is still a view of it (a later .to() or load_state_dict makes new tensors: then None, and the
    projections run apart)."""
    # inside torch.compile the separate projections (their weights are views of the fused one): the fused weight's
    # check reads storage pointers, which a compiled graph cannot
    if not module.__dict__.get("_eyas_fuse_on") or torch.compiler.is_compiling():
        return None
    held = held_fusion([getattr(module, n) for n in names])
    return held[0] if held is not None and held[1] is None else None


class MidLayer(nn.Module):
    """The drafter's decoder layer. The first (`first`) reads concat(input_layernorm(embed), hidden_norm(h)); the
    later ones of a multi-layer drafter are plain Llama layers over input_layernorm(h)."""

    def __init__(self, c: DraftConfig, first: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, width=2 if first else 1)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)
        self.first = first
        self.norm_before_residual = first and c.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, attend: Attend):
        return self.post(hidden, attend(*self.pre(embeds, hidden, cos, sin)))

    def pre(self, embeds, hidden, cos, sin):
        """Everything before the attention: its q, k and v (`embeds` is not read by a later layer)."""
        if self.first:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        else:
            x = self.input_layernorm(hidden)
        return self.self_attn.qkv(x, cos, sin)

    def post(self, hidden, o):
        """Everything after it, from its output o and the layer's input hidden: the layer's output."""
        residual = self.hidden_norm(hidden) if self.norm_before_residual else hidden
        h = residual + self.self_attn.out(o)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    def __init__(self, c: DraftConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = c
        # from transformers' rope function, here rather than at the first forward, which torch.compile may trace;
        # not a buffer: the checkpoint does not hold it
        self.__dict__["_rope_freqs"] = RopeFrequencies(c.head_dim, c.num_attention_heads, c.rope_theta,
                                                       c.max_position_embeddings, c.rope_scaling)
        if c.hidden_size != c.target_hidden_size:
            raise EyasError(f"drafter hidden size {c.hidden_size} must equal the target's {c.target_hidden_size} "
                            f"(the drafter reads the target's token embeddings)")
        self.embed_tokens = nn.Embedding(c.target_vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        if embed_weight is not None:
            self.set_embeddings(embed_weight)
        self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        if c.norm_before_fc:  # speculators' names: input_norm over concat(aux), fc_norm.<i> over aux state i
            self.input_norm = RMSNorm(len(c.aux_layers) * c.target_hidden_size, c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in c.aux_layers)
        if c.num_hidden_layers < 1:
            raise EyasError(f"a drafter needs at least one decoder layer, got num_hidden_layers={c.num_hidden_layers}")
        self.midlayer = MidLayer(c)
        if c.num_hidden_layers > 1:  # named layers.1.* ... as vLLM names them (it calls the first layers.0)
            self.layers = nn.ModuleDict({str(i): MidLayer(c, first=False) for i in range(1, c.num_hidden_layers)})
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.target_vocab_size, dtype=torch.bool))
        self.set_vocab(torch.arange(c.draft_vocab_size))

    def set_embeddings(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise EyasError(f"target embedding has shape {tuple(weight.shape)}, drafter expects "
                            f"{tuple(self.embed_tokens.weight.shape)}")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """draft_ids: the target ids of the draft vocabulary, sorted ascending."""
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long).to(self.d2t.device)
        if draft_ids.numel() != self.config.draft_vocab_size:
            raise EyasError(f"draft vocabulary has {draft_ids.numel()} ids, drafter expects {self.config.draft_vocab_size}")
        self.d2t.copy_(draft_ids - torch.arange(draft_ids.numel(), device=draft_ids.device))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft-vocabulary entry."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """cos and sin [B, 1, T, head_dim] of the drafter's rope (its kind: eyas.rope) at these positions."""
        return self.__dict__["_rope_freqs"].cos_sin(position_ids, dtype)

    def fuse(self, max_len: int) -> None:
        """For decoding, after the drafter has its device and dtype: q/k/v and gate/up each as one product
        (the modules' weights become views of the fused ones: no memory added), cos/sin for positions
        0..max_len-1 as a table that forward(rope_table=True) indexes, instead of computing them per step, and
        each RMSNorm as one fused kernel in the drafter's dtype (as FastLM.norm_one_kernel does for the target:
        one rounding after the weight instead of HF's two, 3 kernels fewer a norm; training keeps HF's steps)."""
        self._norms_one_kernel(True)
        for layer in self.decoder_layers():
            attn, mlp = layer.self_attn, layer.mlp
            for mod, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
                if fuse_linears([getattr(mod, n) for n in names]) is not None:
                    mod.__dict__["_eyas_fuse_on"] = True
        pos = torch.arange(max_len, device=self.lm_head.weight.device)[None]
        cos, sin = self.rope(pos, self.lm_head.weight.dtype)  # [1, 1, max_len, hd]
        self.__dict__["_rope_table"] = (cos[0, 0], sin[0, 0])

    def unfuse(self) -> None:
        """Undo fuse(): the projections run apart and cos/sin are computed per step (the weights stay views
        of the fused tensors, which is harmless)."""
        for layer in self.decoder_layers():
            for mod in (layer.self_attn, layer.mlp):
                mod.__dict__.pop("_eyas_fuse_on", None)
        self._norms_one_kernel(False)
        self.__dict__.pop("_rope_table", None)

    def decoder_layers(self) -> list[MidLayer]:
        """The decoder layers in order: midlayer, then layers.1 ... of a multi-layer drafter."""
        more = self._modules.get("layers")
        return [self.midlayer] + (list(more.values()) if more is not None else [])

    def _norms_one_kernel(self, on: bool) -> None:
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.one_kernel = on

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                attend: Attend | list = causal_attend, rope_table: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter step over a sequence.

        input_ids [B,T]: the token at t+1 (the one after the position `hidden` describes);
        hidden [B,T,3·H_t] (target aux states: fc is applied) or [B,T,H] (fed-back drafter state);
        attend: the attention, or one per decoder layer (a list) where there are several (a callable alone is
        used only for causal_attend, which keeps no state, or a one-layer drafter);
        rope_table: look cos/sin up in the table fuse() built (positions must be below its max_len);
        returns (next hidden [B,T,H] before the final norm, draft-vocab logits [B,T,V_d])."""
        attends = self.attends(attend)
        if self.__dict__.get("_eyas_compiled") and input_ids.shape[1] <= self.COMPILED_MAX_T:
            # each part one compiled graph (decoding: Decoder.compile_drafter)
            hidden, q, k, v = compiled(_pre_attention)(self, input_ids, hidden, position_ids, rope_table)
            for i in range(1, len(attends)):
                hidden, q, k, v = compiled(_between_layers)(self, i, hidden, attends[i - 1](q, k, v), position_ids,
                                                            rope_table)
            return compiled(_post_attention)(self, hidden, attends[-1](q, k, v))
        hidden, q, k, v = self.pre_attention(input_ids, hidden, position_ids, rope_table)
        for i in range(1, len(attends)):
            hidden, q, k, v = self.between_layers(i, hidden, attends[i - 1](q, k, v), position_ids, rope_table)
        return self.post_attention(hidden, attends[-1](q, k, v))

    def attends(self, attend) -> list:
        """One attention per decoder layer from forward's `attend`."""
        n = self.config.num_hidden_layers
        if isinstance(attend, (list, tuple)):
            if len(attend) != n:
                raise ValueError(f"{len(attend)} attentions for a drafter of {n} decoder layers")
            return list(attend)
        if n > 1 and attend is not causal_attend:
            raise ValueError(f"a drafter of {n} decoder layers needs one attention per layer (a list), each with its "
                             f"own keys")
        return [attend] * n

    # calls of at most this many tokens run compiled when `_eyas_compiled` is set (draft steps and a round's
    # catch-up over K+1 tokens); prefills, one shape each, stay eager
    COMPILED_MAX_T = 16

    def pre_attention(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                      rope_table: bool = False):
        """forward up to the attention: (the layer's input hidden [B,T,H], q, k, v). With post_attention, a
        step in two parts that hold no state, so each can be compiled whole while the attention (which keeps
        the keys of the steps before) runs between them (`train.compile_drafter`)."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(self.fc_input(hidden))
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        cos, sin = self._cos_sin(position_ids, hidden, rope_table)
        return (hidden, *self.midlayer.pre(embeds, hidden, cos, sin))

    def fc_input(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states [.., 3·H_t] as fc reads them: normed first where norm_before_fc or fc_norm."""
        if "input_norm" in self._modules:
            return self.input_norm(aux)
        if "fc_norm" in self._modules:
            return torch.cat([n(a) for n, a in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return aux

    def _cos_sin(self, position_ids, hidden, rope_table: bool):
        table = self.__dict__.get("_rope_table") if rope_table else None
        if table is not None and table[0].dtype == hidden.dtype and table[0].device == hidden.device:
            return table[0][position_ids][:, None], table[1][position_ids][:, None]
        return self.rope(position_ids, hidden.dtype)

    def between_layers(self, i: int, hidden: torch.Tensor, o: torch.Tensor, position_ids: torch.Tensor | None = None,
                       rope_table: bool = False):
        """A multi-layer drafter's step from layer i-1's attention output o (and that layer's input hidden) to
        layer i's attention: (layer i's input hidden, q, k, v). Stateless, like pre_attention."""
        h = self.decoder_layers()[i - 1].post(hidden, o)
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1)
        cos, sin = self._cos_sin(position_ids, h, rope_table)
        return (h, *self.decoder_layers()[i].pre(None, h, cos, sin))

    def post_attention(self, hidden: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forward after the last layer's attention: (next hidden, draft-vocab logits) from that layer's input
        hidden (pre_attention's, or between_layers') and the attention's output o."""
        h = self.decoder_layers()[-1].post(hidden, o)
        if self.config.norm_output:  # the normed state is both what lm_head reads and what is fed back
            h = self.norm(h)
            return h, self.lm_head(h)
        return h, self.lm_head(self.norm(h))

    FROZEN = "embed_tokens.weight"  # the target's embedding: shared, never trained or saved with the drafter

    def trainable_names(self) -> set[str]:
        """The names trainable_state_dict saves (weights and vocabulary buffers; not the frozen embedding)."""
        return set(self.state_dict()) - {self.FROZEN}

    def trainable_state_dict(self, include_embeddings: bool = False) -> dict[str, torch.Tensor]:
        sd = self.state_dict()
        if not include_embeddings:
            sd.pop(self.FROZEN, None)
        return {k: v.detach().contiguous() for k, v in sd.items()}


def _pre_attention(drafter: Eagle3Drafter, input_ids, hidden, position_ids, rope_table):
    """Eagle3Drafter.pre_attention as a function of the drafter (one compiled form for every call)."""
    return drafter.pre_attention(input_ids, hidden, position_ids, rope_table)


def _between_layers(drafter: Eagle3Drafter, i, hidden, o, position_ids, rope_table):
    """Eagle3Drafter.between_layers as a function of the drafter."""
    return drafter.between_layers(i, hidden, o, position_ids, rope_table)


def _post_attention(drafter: Eagle3Drafter, hidden, o):
    """Eagle3Drafter.post_attention as a function of the drafter."""
    return drafter.post_attention(hidden, o)


def build_drafter(target, draft_vocab_size: int, draft_ids: torch.Tensor | None = None,
                  intermediate_size: int = 0, num_layers: int = 1, variants: dict | None = None) -> Eagle3Drafter:
    cfg = DraftConfig.from_target(target, draft_vocab_size, intermediate_size, num_layers, variants)
    d = Eagle3Drafter(cfg, target.embed_tokens().weight.detach().float())
    if draft_ids is not None:
        d.set_vocab(draft_ids)
    return d


def save_drafter(drafter: Eagle3Drafter, out_dir: str | Path, extra: dict | None = None,
                 tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """eyas' own drafter folder: config.json (DraftConfig + `extra`) and model.safetensors (the drafter's
    trainable_state_dict, or `tensors` in its place: the full weights gathered from sharded processes)."""
    out = Path(out_dir)
    weights = out / "model.safetensors"
    sd = tensors if tensors is not None else drafter.trainable_state_dict()
    sd = {k: v.detach().cpu().contiguous() for k, v in sd.items()}
    refuse_non_finite(sd, f"{weights}: not written", NON_FINITE)
    config = {"eyas_format": EYAS_FORMAT, "architecture": "Eagle3Drafter", **drafter.config.to_dict(), **(extra or {})}
    with writing(out):
        out.mkdir(parents=True, exist_ok=True)
    # both files written in full before either replaces the folder's own: a failed write (a full disk) leaves the
    # old pair as it was
    needed = sum(v.numel() * v.element_size() for v in sd.values())
    with atomic_path(weights, needed) as tmp_w, atomic_path(out / "config.json") as tmp_c:
        with writing(weights, needed):
            save_file(sd, str(tmp_w), metadata={"format": "eyas-eagle3"})
        tmp_c.write_text(json.dumps(config, indent=2, default=str) + "\n", encoding="utf-8")
    return out


def load_drafter(path: str | Path, target=None, device=None) -> Eagle3Drafter:
    """Load an eyas drafter folder (as written by save_drafter). With `target`, the target's
    embedding is attached and the shapes are checked against it. A damaged folder (a config field
    missing or of the wrong type, weights cut short or not matching the config) is refused naming
    the file, before anything is built."""
    path = Path(path)
    c = read_eyas_config(path)
    if target is not None:
        check_drafter_aux_layers(c.aux_layers, path / "config.json", target, field="aux_layers")
        check_fits(c, target, str(path))
    weights = path / "model.safetensors"
    sd = read_safetensors(weights)
    refuse_non_finite(sd, str(weights), NON_FINITE)
    # load_state_dict(strict=False) still raises on a misshapen tensor, with torch's traceback: checked first
    check_tensors(shapes_of(sd), c, f"{weights} (against config.json)", include_embeddings=Eagle3Drafter.FROZEN in sd,
                  hint=DAMAGED)
    d = Eagle3Drafter(c, target.embed_tokens().weight.detach().float() if target is not None else None)
    missing, unexpected = d.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != d.FROZEN]
    if missing or unexpected:
        raise EyasError(f"{path}/model.safetensors: missing tensors {missing}, unexpected {unexpected}")
    return d.to(device) if device is not None else d
