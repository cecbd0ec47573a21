"""How much device memory a transformers `generate` call on the target takes, from the target's config alone, and the
largest batch (and prefill chunk) that fits a budget: the generate engine sizes each of its batches with it.

The estimate follows transformers' own forward, tensor by tensor, for one decoder layer at its widest moment (a layer's
transients are freed before the next layer runs), and adds what lives across layers: the KV cache of every layer, the
residual stream and the logits. A MoE layer on transformers' default `grouped_mm` experts copies every token's hidden
state once per chosen expert and weights the experts' outputs in fp32, so at a wide hidden size its transient is
tokens x top_k x hidden_size x 12 bytes in bf16, larger than its intermediate activations (tokens x top_k x
moe_intermediate_size x 4 x 2 bytes). MLA targets (DeepSeek-V3, Kimi) cache the compressed latents and expand every
cached token's keys and values again at each forward. Parts are over-counted rather than left out: an estimate
too high costs speed, one too low an out-of-memory error.
"""
from __future__ import annotations

import dataclasses

import torch

from ..util import human_bytes, mem_available

FP32 = 4  # bytes of the fp32 copies transformers makes (norms, router weights, logits)
MIN_CHUNK = 64  # the shortest prefill chunk a plan uses before it takes fewer rows


def _reader(config):
    """A getter over a config object or dict (a multimodal wrapper's text config where it has one); a value given
    per layer (a list) reads as its largest."""
    if isinstance(config, dict):
        config = config.get("text_config") or config
    else:
        get_text = getattr(config, "get_text_config", None)
        config = get_text() if callable(get_text) else config

    def get(key: str, default=None):
        # a config object's attributes, so that its aliases (attribute_map) read too
        v = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(v, (list, tuple)):
            v = max(v, default=None)
        return default if v is None else v
    return get


@dataclasses.dataclass(frozen=True)
class ForwardCost:
    """Bytes a transformers forward of the target holds beyond its weights, per unit of work. A layer's attention and
    its MLP (or experts) run one after the other, so a forward's transient is the larger of the two."""
    kv_token: int  # the KV cache, every layer, per context token
    residual: int  # per token of this forward: the residual stream, the layer's input and its fp32 norm
    attn_token: int  # one attention layer's transient per token of this forward
    ctx_token: int  # ... and per context token (cache growth, repeated or expanded heads)
    pair: int  # ... and per (query, key) pair of a row: the attention mask, as bool and as the kernel's bias (and the
    # scores where they are materialised)
    ffn_token: int  # one MLP's or MoE layer's transient per token of this forward, the wider where a model has both
    ffn: str  # which of the two that is: "mlp" or "moe"
    logit_row: int  # per row whose logits are computed (the model's dtype, fp32 copies for sampling)

    @classmethod
    def from_config(cls, config, dtype_bytes: int, eager: bool = False, cpu: bool = False) -> ForwardCost:
        """The cost of a forward of the text model `config` (a transformers config or its dict) in a dtype of
        `dtype_bytes`. Attention materialises its scores with `eager` attention, and on a `cpu` for MLA, whose
        unequal key and value widths send sdpa to its math path there; a GPU's fused kernels never hold them."""
        get, d = _reader(config), dtype_bytes
        H, V, L = get("hidden_size"), get("vocab_size"), get("num_hidden_layers")
        heads = get("num_attention_heads")
        kv_heads = get("num_key_value_heads", heads)
        head_dim = get("head_dim") or H // heads
        scores = eager
        if get("kv_lora_rank"):  # MLA: the cache holds the latents, each forward expands every cached token
            qk = get("qk_nope_head_dim") + get("qk_rope_head_dim")
            vd = get("v_head_dim", head_dim)
            latent = get("kv_lora_rank") + get("qk_rope_head_dim")
            kv_token = L * latent * d
            ctx = d * (heads * (get("qk_nope_head_dim") + vd) + heads * qk + 2 * latent)
            attn = d * ((get("q_lora_rank") or 0) + 4 * heads * qk + 3 * heads * vd + latent + H)
            scores = eager or (cpu and qk != vd)
        else:  # the cache holds keys and values; a padded batch's sdpa repeats grouped heads
            kv_token = L * 2 * kv_heads * head_dim * d
            ctx = d * (2 * heads * head_dim + 4 * kv_heads * head_dim)
            attn = d * (6 * heads * head_dim + 4 * kv_heads * head_dim + H)
        ffn = {"mlp": d * (3 * (get("intermediate_size") or 4 * H) + H)}
        k = get("num_experts_per_tok") or 0
        if k:  # grouped_mm experts: each token's state copied k times, outputs weighted in fp32
            inter = get("moe_intermediate_size") or get("intermediate_size")
            shared = (get("n_shared_experts") or 0) * inter + (get("shared_expert_intermediate_size") or 0)
            experts = k * max(d * (H + 4 * inter), d * (3 * H + inter), H * (2 * d + 2 * FP32))
            n_experts = get("n_routed_experts") or get("num_experts") or get("num_local_experts") or 0
            ffn["moe"] = experts + 3 * FP32 * n_experts + d * 3 * shared + H * (FP32 + d)
        wider = max(ffn, key=ffn.get)
        return cls(kv_token=kv_token, residual=H * (3 * d + 2 * FP32), attn_token=attn, ctx_token=ctx,
                   pair=1 + 2 * d + (heads * (2 * FP32 + d) if scores else 0), ffn_token=ffn[wider], ffn=wider,
                   logit_row=V * (d + 4 * FP32))

    def _phases(self, rows: int, new: int, ctx: int) -> tuple[int, int]:
        """The transient bytes of one layer's attention and of its MLP (or experts) in a forward of `rows` rows,
        each `new` new tokens after which it holds `ctx` context tokens."""
        tokens = rows * new
        return (tokens * self.attn_token + rows * ctx * self.ctx_token + tokens * ctx * self.pair,
                tokens * self.ffn_token)

    def forward(self, rows: int, new: int, ctx: int, all_logits: bool = False) -> int:
        """The transient bytes of that forward; all_logits: logits for every new token (a model without
        logits_to_keep)."""
        tokens = rows * new
        return (tokens * self.residual + max(self._phases(rows, new, ctx))
                + (tokens if all_logits else rows) * self.logit_row)

    def generate(self, rows: int, width: int, max_new: int, chunk: int | None = None,
                 all_logits: bool = False) -> int:
        """The peak bytes of `model.generate` on `rows` prompts padded to `width` tokens for `max_new` new tokens,
        the prompts prefilled in chunks of `chunk` tokens (None: at once)."""
        step = min(chunk or width, width)
        ctx = width + max_new
        kv = rows * ctx * self.kv_token
        prefill = self.forward(rows, step, width, all_logits)
        decode = self.forward(rows, 1, ctx, all_logits)
        return kv + max(prefill, decode)

    def ruling(self, rows: int, new: int, ctx: int) -> str:
        """What takes the most memory in a layer of that forward, in words."""
        attn, ffn = self._phases(rows, new, ctx)
        if attn >= ffn:
            return f"attention takes {human_bytes(attn)} a layer ({human_bytes(self.ctx_token)} a context token)"
        what = "the MoE experts' activations take" if self.ffn == "moe" else "the MLP's activations take"
        return f"{what} {human_bytes(ffn)} a layer ({human_bytes(self.ffn_token)} a token)"


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    rows: int  # the prompts generated together
    chunk: int | None  # prefill chunk in tokens (None: the whole prompt at once)
    peak: int  # estimated bytes
    limited: bool  # fewer rows than asked for, or a chunked prefill, because of memory


def plan_batch(cost: ForwardCost, budget: float, widths: list[int], max_new: list[int], cap: int,
               all_logits: bool = False) -> BatchPlan | None:
    """The most prompts of `widths` (sorted, shortest first; max_new their answer limits) up to `cap` whose generate
    call fits `budget` bytes: the whole prompts at once where they fit, else prefilled in the longest chunk that fits
    (no shorter than MIN_CHUNK unless the prompt is). None where not even one prompt fits."""
    top = min(cap, len(widths))
    for rows in range(top, 0, -1):  # estimates rise with rows (the widths are sorted), so the first fit is the most
        width, new = widths[rows - 1], max(max_new[:rows])
        peak = cost.generate(rows, width, new, None, all_logits)
        if peak <= budget:
            return BatchPlan(rows, None, peak, rows < top)
        lo, hi = min(MIN_CHUNK, width), width - 1  # the longest chunk that fits, by bisection
        if cost.generate(rows, width, new, lo, all_logits) > budget:
            continue
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cost.generate(rows, width, new, mid, all_logits) <= budget else (lo, mid - 1)
        return BatchPlan(rows, lo, cost.generate(rows, width, new, lo, all_logits), True)
    return None


def free_bytes(device: torch.device) -> int:
    """Bytes this process can still take on `device`: the GPU's free memory and the blocks torch's allocator holds
    unused; on a CPU the host's available memory."""
    if device.type == "cuda":
        held = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + held
    return mem_available()


def all_logits(model) -> bool:
    """Whether `generate` computes the logits of every prompt token at prefill (a model whose forward has no
    `logits_to_keep`) rather than of the last one alone."""
    keeps = getattr(model, "_supports_logits_to_keep", None)
    return not (callable(keeps) and keeps())
