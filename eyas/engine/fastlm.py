"""A fast batched forward with a static KV cache for Llama-family targets (Llama, Mistral, Qwen2, Qwen3,
Qwen3-MoE; see SUPPORTED_TYPES) for regeneration, speculative decoding and greedy validation.

It reuses the loaded HF model's own modules and weights (embedding, norms, q/k/v/o projections with
their biases, MLPs, rotary embedding, lm_head) and implements only rope application, the cache and
attention, so a decode step is a handful of kernels per layer with no `repeat_kv` copy and no host
synchronisation (it can be captured in a CUDA graph).

Cache and positions: per layer, k and v are [B, Hkv, max_len, D]; slot s of row b holds the token at
position s of that row. A forward over ids [b, T] with start positions pos [b] writes slots
pos[b]..pos[b]+T-1 of its rows, and a query at position p attends to slots 0..p of its own row. There
is no length pointer: rolling a row back is free (later slots are masked by position until they are
overwritten), and the right padding of a batched prefill is harmless (its slots lie past the row's
true length, where nothing looks before they are overwritten). Callers keep pos[b] + T <= max_len.

Row groups: a batch whose rows hold contexts of very different lengths can split its rows into
groups (`FastLM.groups`, contiguous row ranges); a forward over all rows then takes one `upto` per
group and each group attends only to its own bound, so short rows do not pay for the longest one.

Query heads and KV heads: a one-token step folds the query heads that share a KV head into the query length
(q [b, Hkv, rep*T, D]): a view at T = 1, and keys and values are read once. At T > 1 that fold and its way
back are a copy each per layer (60 in SmolLM2's 4-token verify), so a short multi-token call (a speculative
verify, up to GQA_MAX_T tokens) passes q as a view of the projection ([b, H, T, D]) with SDPA's enable_gqa
instead: no copy, one cache layout for both, and half the kernels of the folded step; at T = 1 the fold
costs nothing. Prefills (one_off) keep the fold.

Aux states follow eyas.target: aux id i < N is the residual stream entering decoder layer i, id N the
stream after the last layer, before the final norm.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..device_map import devices_of, is_split
from ..util import EyasError, compile_failure, log

# model types whose forward is exactly what FastLM computes: unscaled embeddings; per layer
# x + o_proj(attn(rope(qn(q_proj(n))), rope(kn(k_proj(n))), v_proj(n))) with n = input_layernorm(x), qn and kn the
# identity or (Qwen3) the per-head RMSNorms q_norm/k_norm, then x + mlp(post_attention_layernorm(x)); final norm;
# lm_head. The MLP is the model's own module (Qwen3-MoE's sparse block included), its gate/up fused where it is a
# plain gated MLP. Other families with the same module names differ in ways the layout does not show (Gemma scales
# embeddings, Granite residuals, StableLM and Phi ropes part of each head; Gemma2 soft-caps), so they are refused
# by type.
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")  # q_norm/k_norm on each head, before rope (transformers' Qwen3Attention)
# rope types whose cos/sin depend on the position only (a fixed inv_freq, times the rotary module's
# attention_scaling, which its forward applies): FastLM calls the model's own rotary module. dynamic and longrope
# change inv_freq with the sequence length, so they are refused, as is any type not checked against transformers
STATIC_ROPES = ("default", "linear", "llama3", "yarn")


def layer_windows(model) -> list[int | None]:
    """Each decoder layer's sliding attention window (None: full attention), as transformers applies it: a query at
    position p sees keys at p - window < s <= p. Qwen2/Qwen3 set it per layer (self_attn.sliding_window, from
    use_sliding_window and layer_types); Mistral's attention reads config.sliding_window in every layer."""
    c = model.config
    if getattr(c, "model_type", None) == "mistral":
        return [getattr(c, "sliding_window", None)] * len(model.model.layers)
    return [getattr(layer.self_attn, "sliding_window", None) for layer in model.model.layers]


def supported(model) -> tuple[bool, str]:
    """(True, "") when FastLM reproduces `model`'s forward exactly, else (False, why not)."""
    c = model.config
    arch = (getattr(c, "architectures", None) or [type(model).__name__])[0]
    mt = getattr(c, "model_type", "?")
    if is_split(model):
        return False, (f"{arch} is split over {', '.join(sorted(devices_of(model)))} (target.device_map); FastLM runs "
                       f"a model on one device")
    if mt not in SUPPORTED_TYPES:
        return False, (f"{arch} (model_type '{mt}') is not an architecture FastLM implements "
                       f"(it runs {', '.join(SUPPORTED_TYPES)})")
    if mt in QK_NORM_TYPES and any(llama_norm_eps(getattr(layer.self_attn, n, None)) is None
                                   for layer in model.model.layers for n in ("q_norm", "k_norm")):
        return False, f"{arch}: an attention layer lacks the RMSNorm q_norm/k_norm its model type has"
    for i, w in enumerate(layer_windows(model)):
        if w is not None and not (isinstance(w, int) and w >= 1):
            return False, f"{arch}: layer {i} has sliding window {w!r}; FastLM takes a whole number >= 1 or none"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if not isinstance(rope, str) or rope not in STATIC_ROPES:
        why = ("changes with the sequence length" if isinstance(rope, str) and ("dynamic" in rope or rope == "longrope")
               else "is not one FastLM has been checked against")
        return False, (f"{arch}: rope type {rope!r} {why}, which FastLM does not implement "
                       f"(it runs {', '.join(STATIC_ROPES)})")
    return True, ""


_FALLBACK_LOGGED: set = set()


def fast_engine_runs(model, where: str) -> bool:
    """supported(model)[0] for a caller that picks its engine automatically (`where` names it: regen, the decoder,
    greedy validation): when FastLM cannot run the target, one log line per caller and reason and process says the
    target falls back to transformers (no static cache of eyas' own, no CUDA graphs: slower) and why."""
    ok, why = supported(model)
    if not ok and (where, why) not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add((where, why))
        log(f"{where}: the target runs on transformers, not on eyas' fast engine (FastLM: static cache, CUDA graphs), "
            f"so it is slower: {why}")
    return ok


# attention kernels for a call whose shape is seen once (a batched prompt prefill): every kernel that takes
# an additive mask except cuDNN's, which builds a plan per new shape (planning costs far more than the call on
# a shape seen once). Fixed-shape steps (decode, verify: CUDA graphs) keep the default choice, where cuDNN's
# plan is paid once and its kernel is the fastest.
def one_off_kernels(device: torch.device, on: bool = True):
    """The attention-kernel choice for a call whose shape is seen once, as a context manager: on a GPU (and
    when `on`), every kernel but cuDNN's; elsewhere, no change."""
    if not on or device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, one_kernel: bool = False) -> torch.Tensor:
    """Llama's RMSNorm steps (normalize in fp32, round to x's dtype, times the weight) through torch's fused
    kernel: fewer kernels than the spelled-out formula. one_kernel (when weight and x share a dtype): the fused
    kernel in that dtype with the weight inside, one kernel instead of four; it accumulates in fp32 too but
    rounds once, after the weight, so bf16 results can differ from HF's in the last bit."""
    if one_kernel and weight.dtype == x.dtype:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


_compiled_flex = None  # flex attention compiled for FastLM.flex_decode (FastLM._flex_attention)

SPAN = 256  # cache slots are attended in multiples of this (few distinct shapes to capture as graphs)


def attended_slots(end: int, max_len: int, span: int = SPAN) -> int:
    """Cache slots a step whose positions lie below `end` attends to: `end` rounded up to a multiple
    of `span`, at most max_len (less work than the whole cache, few distinct shapes)."""
    return min(max_len, -(-int(end) // span) * span)


def llama_norm_eps(module) -> float | None:
    """The epsilon of an HF Llama-style RMSNorm module (a weight and a variance_epsilon), which
    llama_rms_norm can run in its place; None for any other module."""
    eps = getattr(module, "variance_epsilon", None)
    return eps if eps is not None and isinstance(getattr(module, "weight", None), torch.Tensor) else None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope on x [b, T, h, D] with cos/sin [b, T, 1, D] (halves layout, as HF Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _norm_rotate(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 one_kernel: bool) -> torch.Tensor:
    """Qwen3's q/k path: RMSNorm over each head's D values, then rope (x [b, T, h, D])."""
    return _rotate(llama_rms_norm(x, weight, eps, one_kernel=one_kernel), cos, sin)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _add_norm(h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float, one_kernel: bool):
    """(h + d, the RMSNorm of h + d): a residual add and the norm after it."""
    h = h + d
    return h, llama_rms_norm(h, weight, eps, one_kernel=one_kernel)


def raise_recompile_limit(limit: int = 64) -> None:
    """Let torch compile each function for at least `limit` shapes (its default is 8, after which a function
    compiled with fullgraph fails and runs eagerly from then on)."""
    from torch import _dynamo

    _dynamo.config.recompile_limit = max(_dynamo.config.recompile_limit, limit)


_COMPILED: dict = {}
_EAGER: set = set()  # functions whose compiled form failed here: eager for the rest of the process


def compiled(fn):
    """fn through torch.compile (static shapes, whole graph), once per function: for FastLM.compile_elementwise,
    each compiled function one kernel where eager runs several (rope 5, add and norm 2, silu and multiply 2).
    Where compiling or running the compiled form fails (no Triton, no C compiler, an unsupported device), the
    failure is logged once and fn runs eagerly from then on: the same operations, so the same results up to
    rounding."""
    if fn not in _COMPILED:
        # one compile per shape: a process that decodes at several verify sizes, checks them (settle_norms) and
        # regenerates at several batch sizes passes torch's default of 8 shapes a function
        raise_recompile_limit()
        fast = torch.compile(fn, dynamic=False, fullgraph=True)

        def run(*args):
            if fn not in _EAGER:
                try:
                    return fast(*args)
                except Exception as e:  # noqa: BLE001 - depends on the compiler stack; eager is always correct
                    _EAGER.add(fn)
                    log(f"compiled {fn.__name__} failed ({compile_failure(e)}); running it eagerly")
            return fn(*args)

        _COMPILED[fn] = run
    return _COMPILED[fn]


_ROWS_ALIKE: dict = {}  # compiled_rows_alike's answers: (fn, the first call's shapes and dtypes, device, T) -> bool


def compiled_rows_alike(fn, make, lengths, rows: int = 256) -> bool:
    """Whether compiled(fn) gives each row of a call of T rows bit for bit what it gives that row in a call of its
    own, for each T in lengths. make(T, generator) -> fn's arguments for a call of T rows (the tensors whose dim 1
    has T entries are the rows'; the others are shared). torch.compile builds a kernel per shape, and a reduction's
    kernel may sum a row in another order at another row count; random rows (about `rows` at each T) find such a
    difference in its outputs' last bits. Answers are kept per function, shapes and device."""
    f = compiled(fn)
    g = torch.Generator().manual_seed(0)
    for T in sorted({int(t) for t in lengths} - {1}):
        first = make(T, g)
        key = (fn, T) + tuple((tuple(a.shape), a.dtype, str(a.device)) if isinstance(a, torch.Tensor) else a
                              for a in first)
        if key not in _ROWS_ALIKE:
            _ROWS_ALIKE[key] = _rows_alike(f, make, T, g, first, max(1, rows // T))
        if not _ROWS_ALIKE[key]:
            return False
    return True


def _rows_alike(f, make, T: int, g, args, calls: int) -> bool:
    for c in range(calls):
        args = args if c == 0 else make(T, g)
        full = f(*args)
        full = full if isinstance(full, tuple) else (full,)
        for t in range(T):
            one = f(*(a[:, t:t + 1].clone() if isinstance(a, torch.Tensor) and a.dim() > 1 and a.shape[1] == T
                      else a for a in args))
            one = one if isinstance(one, tuple) else (one,)
            if not all(torch.equal(x[:, t:t + 1], y) for x, y in zip(full, one)):
                return False
    return True


def held_fusion(mods: list) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The (weight, bias) fuse_linears gave these layers, while every layer's weight is still a view of it;
    None if they were never fused or have new weights since (a .to() or load_state_dict)."""
    held = getattr(mods[0], "_eyas_fused", None)
    if held is None:
        return None
    W, B = held
    off = 0
    for m in mods:
        n = m.weight.shape[0]
        if m.weight.data.data_ptr() != W[off:off + n].data_ptr() or m.weight.dtype != W.dtype:
            return None
        off += n
    return (W, B) if off == W.shape[0] else None


def fuse_linears(mods: list) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One weight (and bias) for Linear layers that read the same input, e.g. q/k/v: the rows of each
    layer's weight one after another, with each module's own weight (and bias) turned into a view of its
    rows, so the model keeps working and no memory is added. Returns (weight, bias or None), the same
    tensors when called again, or None when the layers cannot share storage (not plain nn.Linear tensors
    of one device and dtype, or biases on some only)."""
    if not all(type(m) is torch.nn.Linear for m in mods):
        return None
    ws = [m.weight.data for m in mods]
    if any(type(w) is not torch.Tensor or w.device != ws[0].device or w.dtype != ws[0].dtype or w.is_meta
           or w.shape[1] != ws[0].shape[1] for w in ws):
        return None
    has_b = [m.bias is not None for m in mods]
    if any(has_b) and not all(has_b):
        return None
    held = held_fusion(mods)
    if held is not None:
        return held
    with torch.no_grad():
        W = torch.cat(ws)
        B = torch.cat([m.bias.data for m in mods]) if all(has_b) else None
        off = 0
        for m in mods:
            n = m.weight.shape[0]
            m.weight.data = W[off:off + n]
            if B is not None:
                m.bias.data = B[off:off + n]
            off += n
    mods[0]._eyas_fused = (W, B)
    return W, B


class FastLM:
    """`model` (an HF causal LM of a type in SUPPORTED_TYPES, already on its device) with a static KV cache of
    `batch_size` rows x `max_len` slots in the model's dtype. aux_layers: ids whose states
    `forward(want_aux=True)` returns (see the module docstring for the conventions)."""
    fuse = True  # q/k/v and gate/up as one product each (bench/bench_regen.py can turn it off to compare)
    # RMSNorm through torch's fused kernel (normalize in fp32, round, times the weight: HF's rounding steps) in
    # ~4 kernels instead of ~8, so decoding and regeneration launch fewer kernels a step; False runs the model's
    # own norm modules
    fused_norm = True
    # with fused_norm: llama_rms_norm's one_kernel, one kernel a norm instead of four (the casts to fp32 and back,
    # and the weight's multiply); bf16 results can differ from HF's in the last bit. Every decoding path (plain and
    # speculative) runs the same forward, so greedy speculative decoding stays exactly lossless against plain.
    # False keeps HF's rounding steps (bench/bench_decode.py --norm 1)
    norm_one_kernel = True
    # multi-token calls of up to GQA_MAX_T tokens through SDPA's enable_gqa rather than the fold (see the module
    # docstring); False folds every call (bench/bench_decode.py --gqa 0 times it)
    gqa_steps = True
    GQA_MAX_T = 16
    # multi-token calls (verifies; not prefills) attend token by token: each token's attention is a batch row of its
    # own, shaped as a one-token step's (its query heads folded, the same cache slots), so it rounds as that step
    # does and a verify's logits equal plain decoding's where an attention kernel's rounding depends on the query
    # length (bf16: the CPU's kernels, and the GPU's beyond a few tokens)
    rowwise_verify = False
    # a tree's verify gives each node what one-token steps over its own path give: each node attends as a batch row
    # of its own (as rowwise_verify) over a copy of the cache whose tree slots hold the node's ancestors at the
    # consecutive slots plain decoding gives them (pos + depth), so the attention kernel sums the same terms in the
    # same order as plain decoding's step there. False: one call over the tree's slots under the ancestor mask, whose
    # sums run in another order where ancestors sit among cousins (bf16 logits then differ from plain decoding's
    # in the last bits, and near-ties flip)
    tree_paths = True
    # calls other than one-off prefills run rope, each residual add with the norm after it, and the MLP's
    # silu-and-multiply as torch.compile'd kernels (`compiled`): about 7 kernels fewer a layer. Off by default here
    # and per instance (the decoder sets it from Decoder.compile_elementwise, on by default on a GPU); each new call
    # shape compiles once, so prefills of varying length stay eager
    compile_elementwise = False
    # row counts whose calls must give each row what a one-row call gives (a verify's tokens; the decoder sets them
    # and calls settle_norms). Where a compiled reduction (each residual add with its norm; Qwen3's norm and rope)
    # does not at one of these counts, compile_elementwise leaves the norms of every call eager, which do: else a
    # verify's logits part from plain steps' in the last bits, and greedy speculative decoding from plain decoding
    # at near-ties
    exact_rows: tuple[int, ...] = ()
    # one-token calls (decode steps) through flex attention with a block mask made from each row's own position:
    # a row reads only its own context's blocks of FLEX_BLOCK slots, where SDPA reads every row up to the longest
    # row's bound (`upto`). In regeneration some row nearly always holds a long prompt, so most rows pay for context
    # they do not have. Off: end to end it does not beat SDPA in regeneration (bench/bench_regen.py --engine
    # static:flex=1,static compares them). Compiled on a GPU (flex attention's eager form is a slow
    # reference), eager elsewhere. Rows given as an index tensor, and row groups, keep SDPA
    flex_decode = False
    FLEX_BLOCK = 128

    def __init__(self, model, batch_size: int, max_len: int, aux_layers: list[int] | None = None):
        ok, why = supported(model)
        if not ok:
            raise EyasError(f"FastLM cannot run this target: {why}")
        if batch_size < 1 or max_len < 1:
            raise EyasError(f"FastLM needs batch_size and max_len >= 1 (got {batch_size}, {max_len})")
        self.model, self.base = model, model.model
        self.layers = list(self.base.layers)
        c = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_heads, self.n_kv = c.num_attention_heads, c.num_key_value_heads
        self.scaling = attn.scaling
        self.qk_norm = getattr(c, "model_type", None) in QK_NORM_TYPES
        # each layer's sliding window (None: full attention); layers share a mask per distinct window
        self.windows = layer_windows(model)
        self.batch_size, self.max_len = batch_size, max_len
        n = len(self.layers)
        self.aux_layers = list(aux_layers or [])
        if any(not 0 <= a <= n for a in self.aux_layers):
            raise EyasError(f"aux layers {self.aux_layers} out of range for a target with {n} layers (0..{n})")
        shape = (batch_size, self.n_kv, max_len, self.head_dim)
        # one storage for every layer's keys and values (each layer's a view), so a draft tree's accepted path moves
        # to its slots in all layers with one gather and one scatter (eyas.tree_decode._keep_path)
        self.kv = torch.zeros((2, n) + shape, device=self.device, dtype=self.dtype)
        self.k, self.v = list(self.kv[0]), list(self.kv[1])
        self.slots = torch.arange(max_len, device=self.device)
        # q/k/v and gate/up as one matrix product each (fewer kernels per layer; the model's own modules
        # become views of the fused weights, so nothing is copied); None where they cannot be fused
        self.qkv, self.gate_up = [], []
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.qkv.append(fuse_linears([a.q_proj, a.k_proj, a.v_proj]) if self.fuse else None)
            gu = None
            if self.fuse and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
                gu = fuse_linears([mlp.gate_proj, mlp.up_proj])
            self.gate_up.append(gu)
        self.groups: list[tuple[int, int]] | None = None  # see set_groups
        self._flex = None  # flex_decode's buffers, made on first use (_flex_mask)
        self.norms_compiled = True  # settle_norms' answer for exact_rows

    def settle_norms(self) -> bool:
        """Whether compile_elementwise may run the norms compiled: every compiled reduction this forward runs gives
        each row of a call of exact_rows rows what a one-row call gives (compiled_rows_alike). Sets and returns
        self.norms_compiled; call it outside CUDA graph capture (it compiles and compares, once per shape)."""
        ok = True
        if self.compile_elementwise and self.exact_rows and self.fused_norm:
            H, dt, dev = self.layers[0].input_layernorm.weight.shape[-1], self.dtype, self.device

            def rows(g, *shape):
                return torch.randn(shape, generator=g).to(dev, dt)

            checks = []
            norm = self.layers[0].input_layernorm
            if llama_norm_eps(norm) is not None:
                checks.append((_add_norm, lambda T, g: (rows(g, 1, T, H), rows(g, 1, T, H) * 0.5, norm.weight,
                                                        llama_norm_eps(norm), self.norm_one_kernel)))
            qn = getattr(self.layers[0].self_attn, "q_norm", None)
            if self.qk_norm and qn is not None and llama_norm_eps(qn) is not None:
                D = self.head_dim
                checks.append((_norm_rotate, lambda T, g: (rows(g, 1, T, self.n_heads, D), qn.weight,
                                                           llama_norm_eps(qn), rows(g, 1, T, 1, D),
                                                           rows(g, 1, T, 1, D), self.norm_one_kernel)))
            ok = all(compiled_rows_alike(fn, make, self.exact_rows) for fn, make in checks)
            if not ok and self.norms_compiled:
                log(f"compiled norms round a row otherwise in a call of {list(self.exact_rows)} rows than alone here "
                    f"(hidden size {H}): the norms run eagerly, so a verify rounds as plain steps do")
        self.norms_compiled = ok
        return ok

    def set_groups(self, bounds: list[int] | None) -> None:
        """Split the rows into contiguous groups starting at `bounds` (e.g. [0, 64] for rows 0-63 and
        64-B); None: one group. A forward over all rows may then pass one `upto` per group."""
        if bounds is None:
            self.groups = None
            return
        edges = list(bounds) + [self.batch_size]
        if edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
            raise EyasError(f"FastLM.set_groups: {bounds} does not start at 0 and rise within {self.batch_size} rows")
        self.groups = list(zip(edges, edges[1:]))

    def _norm(self, module, x: torch.Tensor) -> torch.Tensor:
        """An HF Llama-style RMSNorm module applied to x, through the fused kernel when fused_norm is on."""
        eps = llama_norm_eps(module)
        if not self.fused_norm or eps is None:
            return module(x)
        return llama_rms_norm(x, module.weight, eps, one_kernel=self.norm_one_kernel)

    def _rows(self, rows, b: int) -> torch.Tensor:
        """Row indices [b] (long, on the device) for rows=None (all), a contiguous slice or an index tensor."""
        if rows is None or isinstance(rows, slice):
            r = range(self.batch_size)[rows if rows is not None else slice(None)]
            if r.step != 1:
                raise EyasError("FastLM.forward: a slice of rows must be contiguous (step 1)")
            idx = torch.arange(r.start, r.stop, device=self.device)
        else:
            idx = rows.to(self.device, torch.long)
        if idx.shape[0] != b:
            raise EyasError(f"FastLM.forward: {b} rows of ids but rows selects {idx.shape[0]}")
        return idx

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, rows=None, last_only: bool = False,
                want_aux: bool = False, upto: int | None = None, last_idx: torch.Tensor | None = None,
                one_off: bool = False, tree: tuple[torch.Tensor, torch.Tensor] | None = None):
        """ids [b, T] at positions pos[b]..pos[b]+T-1 of the cache rows `rows` (None: all B rows in order;
        a slice; or a LongTensor [b] of row indices). Returns (logits, aux): logits [b, T, V], or [b, 1, V]
        at the last token (last_only) or at per-row token index last_idx [b] (a right-padded prefill);
        aux [b, T, len(aux_layers)*H] (want_aux) or None. upto: attend to the first `upto` slots only, a host-side bound
        that must exceed every position in this call (default max_len, the one shape for CUDA graphs); with row
        groups (set_groups) and rows=None, a tuple of one such bound per group.
        one_off: the shape of this call is unlikely to come again (a prompt prefill): on a GPU, attention
        avoids kernels that build a plan per shape.
        tree: (positions [T], anc [T, T] bool) for a draft tree's verify (one row, eyas.tree): the T tokens are
        written to slots pos..pos+T-1 but roped at `positions`, and token i attends to the slots before pos and to
        the tree slots pos+j where anc[i, j] (its ancestors and itself; with tree_paths, laid at the slots plain
        decoding gives them)."""
        with one_off_kernels(self.device, on=one_off):
            return self._forward(ids, pos, rows, last_only, want_aux, upto, last_idx, one_off, tree)

    def _use_gqa(self, T: int, one_off: bool) -> bool:
        """Whether a call of T tokens passes q unfolded with enable_gqa: short multi-token calls, not prefills,
        on a CPU or in half precision on a GPU (where cuDNN's attention takes it; other GPU kernels may not)."""
        return (self.gqa_steps and 1 < T <= self.GQA_MAX_T and not one_off and self.n_heads != self.n_kv
                and (self.device.type == "cpu" or self.dtype in (torch.bfloat16, torch.float16)))

    def _flex_mask(self, qpos: torch.Tensor):
        """flex_decode's block mask for one-token queries at positions qpos [b] (b <= batch_size rows): a row's
        blocks below its position's block are whole (no mask evaluated), the block holding its position is cut at
        it. Made from buffers owned here and written in place, so a CUDA graph replays it and the compiled
        attention sees the same mask function every call."""
        B, BS = self.batch_size, self.FLEX_BLOCK
        nblk = -(-self.max_len // BS)
        if self._flex is None:
            dev, i32 = self.device, torch.int32
            at = torch.zeros(B, dtype=torch.long, device=dev)  # each row's query position

            def visible(b, h, q_idx, kv_idx):
                return kv_idx <= at[b]

            self._flex = {"at": at, "visible": visible,
                          "full_idx": torch.arange(nblk, dtype=i32, device=dev).expand(B, 1, 1, nblk).contiguous(),
                          "part_idx": torch.zeros(B, 1, 1, nblk, dtype=i32, device=dev)}
        f, b = self._flex, qpos.shape[0]
        at = f["at"][:b]
        at.copy_(qpos)
        f["part_idx"][:b, 0, 0, 0] = (at // BS).to(torch.int32)
        full = ((at + 1) // BS).to(torch.int32).view(b, 1, 1)  # blocks wholly at or before the position
        part = ((at + 1) % BS != 0).to(torch.int32).view(b, 1, 1)  # the block cut at the position, if any
        return BlockMask.from_kv_blocks(part, f["part_idx"][:b], full, f["full_idx"][:b], BLOCK_SIZE=BS,
                                        mask_mod=f["visible"], seq_lengths=(1, self.max_len), compute_q_blocks=False)

    def _flex_attention(self):
        """flex attention as flex_decode runs it: compiled on a GPU (once a process, for every FastLM), eager
        elsewhere."""
        global _compiled_flex
        if self.device.type != "cuda":
            return flex_attention
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex

    def _parts(self, b: int, rows, upto) -> list[tuple[int, int, int]]:
        """The (first row, end row, attended slots) of each part a forward attends over: one per row group when
        `upto` gives one bound per group, else all b rows under one bound."""
        if isinstance(upto, (tuple, list)):
            if rows is not None or self.groups is None or len(upto) != len(self.groups):
                raise EyasError("FastLM.forward: one bound per row group needs set_groups and rows=None")
            return [(a, z, min(int(u), self.max_len)) for (a, z), u in zip(self.groups, upto)]
        return [(0, b, self.max_len if upto is None else min(int(upto), self.max_len))]

    def _masks(self, qpos, parts, fold: int, tree=None, wpos=None) -> dict:
        """Additive masks, shared by the layers of one window: slot s is visible to the query at position p iff
        s <= p (and p - window < s in a sliding-window layer). `fold` query rows per KV head and token (the query
        heads of one KV head folded into the query length, see the module docstring; 1 with enable_gqa).
        A tree's verify (tree, wpos: the slots written) sees the slots before the tree's and its ancestors' slots.
        -> window -> one mask [rows, 1, fold * T, upto] per part."""
        T = qpos.shape[1]
        masks: dict = {}
        for w in dict.fromkeys(self.windows):
            masks[w] = []
            for a, z, u in parts:
                if tree is not None:  # the slots before the tree's, and the tree slots of the token's ancestors
                    rel = self.slots[:u] - wpos[0, 0]
                    vis = ((rel < 0)[None] | (tree[1][:, rel.clamp(0, T - 1)] & (rel < T)[None]))[None]
                else:
                    vis = self.slots[None, None, :u] <= qpos[a:z, :, None]  # [z-a, T, u]
                if w is not None:
                    vis &= self.slots[None, None, :u] > qpos[a:z, :, None] - w
                m = torch.zeros(vis.shape, device=self.device, dtype=self.dtype).masked_fill_(~vis, float("-inf"))
                if fold > 1:
                    m = m[:, None].expand(z - a, fold, T, u).reshape(z - a, fold * T, u)
                masks[w].append(m[:, None])
        return masks

    @staticmethod
    def _path_slots(anc: torch.Tensor, depth: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """A tree's [T, T] cache slots: row i, column j holds the slot of node i's ancestor at depth j (itself at
        its own depth; past it the root's, which the node's mask hides). anc [T, T] ancestor-or-self, depth [T],
        slots [T] the tree's slots in node order. No host sync."""
        T = anc.shape[0]
        at = anc[:, :, None] & (depth[None, :, None] == torch.arange(T, device=anc.device)[None, None, :])
        return slots[(at * torch.arange(T, device=anc.device)[None, :, None]).sum(1)]

    def _sdpa(self, q, kc, vc, rows, idx, parts, masks, gqa: bool, rowwise: bool = False, paths=None):
        """SDPA of q [b, H, T, D] over one layer's cache kc, vc, part by part under its mask -> [b, H, T, D].
        Without `gqa` the query heads of one KV head are folded into the query length (q [b, Hkv, rep*T, D]);
        `rowwise` (rowwise_verify): each token's folded query a batch row of its own, over the same keys.
        paths (a tree's verify with tree_paths, one row, rowwise): (the tree's slots [T], _path_slots [T, T], the
        layer's keys and values [2, B, Hkv, slots, D]); row i's copy of them holds node i's path at the tree's
        slots."""
        b, _, T, D = q.shape
        rep = self.n_heads // self.n_kv
        if rowwise:
            q = q.view(b, self.n_kv, rep, T, D).permute(0, 3, 1, 2, 4).reshape(b * T, self.n_kv, rep, D)
        elif not gqa:
            q = q.reshape(b, self.n_kv, rep * T, D)
        outs = []
        for (a, z, u), m in zip(parts, masks):
            if rows is None or isinstance(rows, slice):  # a view, no copy
                sel = slice(a, z) if rows is None else rows
                ks, vs = kc[sel, :, :u], vc[sel, :, :u]
            else:
                ks, vs = kc[:, :, :u].index_select(0, idx), vc[:, :, :u].index_select(0, idx)
            if rowwise:  # row r's keys for each of its T tokens (one row: a stride-0 view), its mask token by token
                n = z - a
                if paths is not None:  # one row: a copy of its keys and values per node, the node's path in the tree's
                    at, ps, kv = paths  # slots (keys and values together: one copy, one gather, one write)
                    both = kv[:, a, :, :u][:, None].expand(-1, T, -1, -1, -1).contiguous()
                    both.index_copy_(3, at, kv[:, a][:, :, ps].transpose(1, 2))
                    ks, vs = both[0], both[1]
                else:
                    ks, vs = (x[:, None].expand(n, T, *x.shape[1:]).reshape(n * T, *x.shape[1:]) for x in (ks, vs))
                m = m.view(n, 1, rep, T, u).permute(0, 3, 1, 2, 4).reshape(n * T, 1, rep, u)
                outs.append(F.scaled_dot_product_attention(q[a * T:z * T], ks, vs, attn_mask=m, scale=self.scaling))
                continue
            outs.append(F.scaled_dot_product_attention(q[a:z], ks, vs, attn_mask=m, scale=self.scaling,
                                                       **({"enable_gqa": True} if gqa else {})))
        o = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
        if rowwise:  # [b*T, Hkv, rep, D] -> [b, H, T, D] (a view where SDPA wrote it contiguous, as cuDNN does)
            return o.reshape(b, T, self.n_heads, D).transpose(1, 2)
        return o if gqa else o.reshape(b, self.n_heads, T, self.head_dim)

    def _forward(self, ids, pos, rows, last_only, want_aux, upto, last_idx, one_off=False, tree=None):
        b, T = ids.shape
        idx = self._rows(rows, b)
        qpos = pos.to(self.device, torch.long)[:, None] + torch.arange(T, device=self.device)  # [b, T]
        wpos = qpos  # the slots written: the positions, except in a tree's verify
        if tree is not None:
            if b != 1 or any(self.windows) or self.groups is not None:
                raise EyasError("FastLM.forward: a tree verify takes one row, no row groups and no sliding window")
            qpos = tree[0].to(self.device, torch.long).view(1, T)
        paths = None
        if tree is not None and self.tree_paths and T > 1:
            paths = (wpos[0], self._path_slots(tree[1], qpos[0] - wpos[0, 0], wpos[0]))
        flex = (tree is None and self.flex_decode and T == 1 and not one_off and self.groups is None
                and (rows is None or isinstance(rows, slice)) and not any(self.windows))
        if flex:
            fmask, fattn = self._flex_mask(qpos[:, 0]), self._flex_attention()
        # query heads folded into the query length (no repeated keys/values), or, for short multi-token calls,
        # enable_gqa (see the module docstring); one additive mask per row group (a, z, upto) and window
        rowwise = (self.rowwise_verify and T > 1 and not one_off) or paths is not None
        gqa = self._use_gqa(T, one_off) and not rowwise
        parts = self._parts(b, rows, upto)
        # with paths each node sees the slots up to its own position, where its path now lies: a plain step's mask
        masks = {} if flex else self._masks(qpos, parts, 1 if gqa else self.n_heads // self.n_kv,
                                            None if paths is not None else tree, wpos)
        h = self.base.embed_tokens(ids)
        cos, sin = self.base.rotary_emb(h, qpos)
        cos, sin = cos[:, :, None], sin[:, :, None]  # [b, T, 1, D]
        n = len(self.layers)
        nh, nkv, D = self.n_heads, self.n_kv, self.head_dim
        grab: dict[int, torch.Tensor] = {}
        # cache[rows, :, qpos] is [b, T, Hkv, D]. On CUDA, index_put makes its index tensors contiguous when their
        # strides differ, as rows broadcast over T tokens do: once per write, two per layer (60 extra copies in a
        # SmolLM2 verify). One row index per token, built here once, has
        # qpos' strides. (A one-token call's indices already agree.)
        ri = idx[:, None] if T == 1 else torch.zeros_like(qpos).add_(idx[:, None])
        write_at = (ri, slice(None), wpos)
        ew = self.compile_elementwise and not one_off
        ew_norms = ew and self.norms_compiled
        rotate = compiled(_rotate) if ew else _rotate
        pend = None  # the last MLP's output, added to h together with the next norm (add_norm)

        def norm_rotate(x, module):
            """rope(module's RMSNorm of each head of x): Qwen3's q and k, one compiled kernel with `ew`."""
            eps = llama_norm_eps(module)
            if ew_norms and self.fused_norm and eps is not None:
                return compiled(_norm_rotate)(x, module.weight, eps, cos, sin, self.norm_one_kernel)
            return rotate(self._norm(module, x), cos, sin)

        def add_norm(h, d, module):
            """(h + d, module's norm of it): one compiled kernel with `ew` where the norm is Llama-style."""
            eps = llama_norm_eps(module)
            if ew_norms and self.fused_norm and eps is not None:
                return compiled(_add_norm)(h, d, module.weight, eps, self.norm_one_kernel)
            h = h + d
            return h, self._norm(module, h)

        for i, layer in enumerate(self.layers):
            if pend is not None:
                h, x = add_norm(h, pend, layer.input_layernorm)
            else:
                x = self._norm(layer.input_layernorm, h)
            if want_aux and i in self.aux_layers:
                grab[i] = h
            attn = layer.self_attn
            if self.qkv[i] is not None:
                qkv = F.linear(x, *self.qkv[i]).view(b, T, nh + 2 * nkv, D)
                q, k, v = qkv[:, :, :nh], qkv[:, :, nh:nh + nkv], qkv[:, :, nh + nkv:]
                if not self.qk_norm:
                    qk = rotate(qkv[:, :, :nh + nkv], cos, sin)  # rope on q and k at once
                    q, k = qk[:, :, :nh], qk[:, :, nh:]
            else:
                q, k = attn.q_proj(x).view(b, T, nh, D), attn.k_proj(x).view(b, T, nkv, D)
                v = attn.v_proj(x).view(b, T, nkv, D)
                if not self.qk_norm:
                    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            if self.qk_norm:
                q, k = norm_rotate(q, attn.q_norm), norm_rotate(k, attn.k_norm)
            kc, vc = self.k[i], self.v[i]
            kc[write_at] = k
            vc[write_at] = v
            q = q.transpose(1, 2)  # [b, H, T, D], a view
            if flex:  # every slot of the rows (the block mask skips what lies past each row's position)
                sel = slice(None) if rows is None else rows
                o = fattn(q, kc[sel], vc[sel], block_mask=fmask, scale=self.scaling, enable_gqa=nh != nkv)
            else:
                o = self._sdpa(q, kc, vc, rows, idx, parts, masks[self.windows[i]], gqa, rowwise,
                               None if paths is None else (*paths, self.kv[:, i]))
            o = o.transpose(1, 2).reshape(b, T, -1)  # with enable_gqa, a view of what cuDNN wrote
            h, x = add_norm(h, attn.o_proj(o), layer.post_attention_layernorm)
            if self.gate_up[i] is not None:
                gate, up = F.linear(x, *self.gate_up[i]).chunk(2, dim=-1)
                silu = ew and type(layer.mlp.act_fn).__name__ in ("SiLU", "SiLUActivation")
                pend = layer.mlp.down_proj(compiled(_silu_mul)(gate, up) if silu else layer.mlp.act_fn(gate) * up)
            else:
                pend = layer.mlp(x)
        h, final = add_norm(h, pend, self.base.norm)
        if want_aux and n in self.aux_layers:
            grab[n] = h
        if last_idx is not None:
            final = final.gather(1, last_idx.to(self.device, torch.long).view(b, 1, 1).expand(b, 1, final.shape[-1]))
        elif last_only:
            final = final[:, -1:]
        logits = self.model.lm_head(final)
        aux = torch.cat([grab[a] for a in self.aux_layers], dim=-1) if want_aux else None
        return logits, aux
