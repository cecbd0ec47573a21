"""The attention of the training-time test: at step j, query position t attends to the step-0 keys at positions <= t
of its own packed sequence and to the keys of steps 1..j at position t only. On CUDA flex-attention with block masks
(the last step's made from the documents' bounds, the earlier steps' cut from it); elsewhere per document, or one
dense boolean SDPA mask."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


def ttt_mask_mod(doc: torch.Tensor, n: int):
    """mask_mod(b, h, q, kv) over the keys of steps 0..j concatenated (kv = step·n + position)."""
    def mask_mod(b, h, q_idx, kv_idx):
        step = kv_idx // n
        p = kv_idx - step * n
        causal = (step == 0) & (doc[q_idx] == doc[p]) & (p <= q_idx)
        return causal | ((step > 0) & (p == q_idx))
    return mask_mod


def ttt_dense_mask(doc: torch.Tensor, step: int) -> torch.Tensor:
    """Boolean [n, (step+1)·n]: may query position q (at TTT step `step`) see key kv?"""
    n = doc.shape[0]
    q = torch.arange(n, device=doc.device)[:, None]
    kv = torch.arange((step + 1) * n, device=doc.device)[None]
    return ttt_mask_mod(doc, n)(0, 0, q, kv)


_flex = None
# The flex block masks: the last TTT step's is made once a batch from the documents' bounds (`_last_step_mask`) and
# every earlier step's is cut from it (`_derive_mask`), a few dozen small device ops in all, where a build by
# create_block_mask costs the host milliseconds a step and, with the step number copied from the host, a wait for
# the device.
FLEX_BLOCK = 128  # the block masks' block size (create_block_mask's default)


def _compiled_flex():
    global _flex
    if _flex is None:
        _flex = torch.compile(flex_attention, dynamic=False)
    return _flex


class TTTAttend:
    """The `attend(q, k, v)` the drafter calls; remembers each step's keys and values so that
    step j attends to the keys of steps 0..j with the TTT pattern. One object per unroll.

    On CUDA (flex) the keys of the steps not run yet are zeros and the step number is a tensor, so
    every step has the same shapes and the compiled kernels are built once; the block mask skips
    the zero blocks. `doc` is each row's document, non-decreasing (pack_samples)."""

    def __init__(self, doc: torch.Tensor, backend: str = "auto", steps: int = 0, n_real: int | None = None,
                 masks: dict | None = None):
        self.doc = doc
        # flex block masks by (keys' steps, step): the layers of one unroll attend with the same pattern, so they
        # pass one dict and a two-layer drafter builds each step's mask once, not once a layer
        self.masks = {} if masks is None else masks
        self.n_real = doc.shape[0] if n_real is None else n_real  # rows past it are padding (output zeros)
        self.n = doc.shape[0]
        if backend == "auto":
            backend = "flex" if doc.is_cuda else "docs"
        self.backend = backend
        self.steps = steps
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []

    def copy(self) -> "TTTAttend":
        """The same attention with the keys and values so far (detached), to run a step aside."""
        c = TTTAttend(self.doc, self.backend, self.steps, self.n_real, self.masks)
        c.ks, c.vs = [k.detach() for k in self.ks], [v.detach() for v in self.vs]
        return c

    def __call__(self, q, k, v):
        self.ks.append(k)
        self.vs.append(v)
        j = len(self.ks) - 1
        gqa = q.shape[1] != k.shape[1]
        if self.backend == "flex":
            total = max(self.steps, j + 1)
            zeros = [k.new_zeros(k.shape)] * (total - j - 1)
            K = torch.cat(self.ks + zeros, dim=2)
            V = torch.cat(self.vs + zeros, dim=2)
            mask = self.masks.get((total, j))
            if mask is None:
                mask = self.masks[(total, j)] = _step_mask(self.doc, total, j, self.masks)
            return _compiled_flex()(q, K, V, block_mask=mask, enable_gqa=gqa)
        if self.backend == "docs":
            return self._per_document(q)
        K = k if j == 0 else torch.cat(self.ks, dim=2)
        V = v if j == 0 else torch.cat(self.vs, dim=2)
        mask = ttt_dense_mask(self.doc, j)
        return F.scaled_dot_product_attention(q, K, V, attn_mask=mask[None, None], enable_gqa=gqa)


    def _per_document(self, q):
        """The same pattern without a dense n × (j+1)·n mask: causal attention inside each packed
        sequence (cost Σ L², not n²), plus one score per earlier step at the query's own position,
        all in one softmax."""
        ks, vs = self.ks, self.vs
        rep = q.shape[1] // ks[0].shape[1]
        if rep > 1:
            ks = [k.repeat_interleave(rep, 1) for k in ks]
            vs = [v.repeat_interleave(rep, 1) for v in vs]
        scale = q.shape[-1] ** -0.5
        diag_s = torch.stack([(q * k).sum(-1) for k in ks[1:]], -1) * scale if len(ks) > 1 else None  # [B,h,n,j]
        out = torch.zeros_like(q)
        bounds = torch.nonzero(torch.diff(self.doc.long(), prepend=self.doc.new_full((1,), -1).long())).flatten().tolist()
        bounds.append(self.n)
        for a, b in zip(bounds[:-1], bounds[1:]):
            if a >= self.n_real:
                break
            L = b - a
            s = (q[:, :, a:b] @ ks[0][:, :, a:b].transpose(-1, -2)) * scale  # [B,h,L,L]
            s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=q.device).tril(), float("-inf"))
            if diag_s is not None:
                s = torch.cat([s, diag_s[:, :, a:b]], -1)
            w = torch.softmax(s, -1, dtype=torch.promote_types(s.dtype, torch.float32)).to(q.dtype)
            o = w[..., :L] @ vs[0][:, :, a:b]
            for i in range(1, len(ks)):
                o = o + w[..., L + i - 1, None] * vs[i][:, :, a:b]
            out[:, :, a:b] = o
        return out


def _block_mask(doc: torch.Tensor, total: int, j: int):
    n = doc.shape[0]
    # the step as a device tensor, so the compiled mask is one for every step; filled on the device, since a
    # tensor copied from the host makes the host wait for the device first
    jt = torch.full((), j, device=doc.device)

    def mask_mod(b, h, q_idx, kv_idx):
        step = kv_idx // n
        p = kv_idx - step * n
        causal = (step == 0) & (doc[q_idx] == doc[p]) & (p <= q_idx)
        return causal | ((step > 0) & (step <= jt) & (p == q_idx))

    return create_block_mask(mask_mod, None, None, n, total * n, device=doc.device, _compile=True)


def _step_mask(doc: torch.Tensor, total: int, j: int, masks: dict):
    """Step j's flex block mask (keys of `total` steps): cut from the last step's, which is made once into `masks`
    from the documents' bounds (`_last_step_mask`); built by create_block_mask where the steps do not start on
    block boundaries."""
    if doc.shape[0] % FLEX_BLOCK:
        return _block_mask(doc, total, j)
    last = masks.get((total, total - 1))
    if last is None:
        last = masks[(total, total - 1)] = _last_step_mask(doc, total)
    return last if j == total - 1 else _derive_mask(last, total, j)


def _ordered(dense: torch.Tensor):
    """A [rows, cols] block-level boolean matrix as flex's (count [1,1,rows], indices [1,1,rows,cols]): each row's
    listed blocks first, in ascending order. Row-major whatever `dense`'s layout (the query side is made from a
    transpose, and sort keeps its input's strides): flex's CUDA kernels step along a row of indices as if its stride
    were 1, so a transposed index tensor gives wrong key and value gradients on a GPU."""
    idx = torch.sort(dense.to(torch.int8), dim=-1, descending=True, stable=True).indices
    return dense.sum(-1, dtype=torch.int32)[None, None], idx.to(torch.int32).contiguous()[None, None]


def _last_step_mask(doc: torch.Tensor, total: int):
    """The block mask `_block_mask(doc, total, total - 1)` builds, made from the packed documents' bounds with a few
    small device ops instead of evaluating the mask at every position (create_block_mask costs the host
    milliseconds at a training batch's size). `doc` is non-decreasing (pack_samples), its length a multiple of
    FLEX_BLOCK. At step 0 a query block sees the key blocks from its first query's document start to its own, each
    of them in full where it and the query block lie in one document; each later step adds the diagonal block."""
    n, B = doc.shape[0], FLEX_BLOCK
    nb, dev = n // B, doc.device
    first, last = doc[::B].contiguous(), doc[B - 1::B].contiguous()  # the document of each block's first and last row
    start = torch.searchsorted(doc, first) // B  # the block where each query block's first document starts
    qb, kb = torch.arange(nb, device=dev)[:, None], torch.arange(nb, device=dev)[None, :]
    full0 = (kb < qb) & (first[None, :] == last[:, None])
    part0 = (kb >= start[:, None]) & (kb <= qb) & ~full0
    eye = qb == kb
    part = torch.cat([part0] + [eye] * (total - 1), dim=1)  # [nb, total·nb]
    full = torch.cat([full0] + [torch.zeros_like(eye)] * (total - 1), dim=1)
    kv_num, kv_idx = _ordered(part)
    fkv_num, fkv_idx = _ordered(full)
    q_num, q_idx = _ordered(part.T)
    fq_num, fq_idx = _ordered(full.T)
    return BlockMask(seq_lengths=(n, total * n), kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=fkv_num,
                     full_kv_indices=fkv_idx, q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=fq_num,
                     full_q_indices=fq_idx, BLOCK_SIZE=(B, B), mask_mod=ttt_mask_mod(doc, n))


def _derive_mask(last, total: int, j: int):
    """Step j's block mask from the last step's (`_last_step_mask`), which lists the same blocks
    plus one diagonal block a query block for each later step, as each query block's last partial key blocks (keys
    in ascending order, a step's keys starting on a block boundary). Dropping them is a subtraction on the key side
    and zeroing those key blocks' columns on the query side (which the backward reads); the full blocks, all at step
    0, and the mask_mod (only ever read inside the blocks listed) are shared."""
    m = copy.copy(last)
    m.kv_num_blocks = last.kv_num_blocks - (total - 1 - j)
    cols = last.q_num_blocks.shape[-1]
    keep = torch.arange(cols, device=last.q_num_blocks.device) < cols // total * (j + 1)
    m.q_num_blocks = last.q_num_blocks * keep.to(last.q_num_blocks.dtype)
    return m


# a block mask's (count, indices) pairs: key side partial and full (the forward), query side (the backward)
BLOCK_FIELDS = (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices"))


def block_lists(mask) -> dict:
    """What a block mask lists, to compare two: for each field of BLOCK_FIELDS, each row's blocks in order."""
    return {idx: [getattr(mask, idx)[0, 0, r, :int(c)].tolist()
                  for r, c in enumerate(getattr(mask, num)[0, 0].tolist())] for num, idx in BLOCK_FIELDS}
