"""Speculative decoding with EAGLE-2 dynamic draft trees (eyas.tree): the drafter grows a tree, the target verifies
all of it in one forward with a tree attention mask, and the caches keep the accepted path.

One round, with L tokens committed (as in eyas.decode: the target has processed positions 0..L-2, the last token
x[L-1] is the tree's root; the drafter's cache holds positions 0..L-2 and its last output predicts token L):

    grow     level 1 from the drafter's last output; each later level runs the drafter once over the frontier's
             topk nodes (position L-3+level), each node attending to the drafter's cache below L-1 and to its own
             ancestors' keys, held apart from the cache (siblings share a position)
    verify   the target over the root and the tokens-1 kept nodes, written to cache slots L-1.. in node order,
             roped at position L-1+depth, each attending to the slots before L-1 and to its ancestors' slots
    accept   greedy: the longest path whose tokens are the target's argmax, then the argmax after it; sampled: the
             point-mass rejection walk of eyas.tree.accept_sample (lossless in distribution)
    commit   the accepted nodes' keys and values move to consecutive slots L..L+a-1 (the root's stays at L-1), and
             the drafter's cache is rebuilt at positions L-1..L-1+depth from the target's aux states along the path
             (entries past the accepted length are stale and masked by position, as in the chain's round)

Greedy tree decoding gives exactly plain greedy decoding's tokens. Both target engines run it: eyas' FastLM (a tree
mask path in its forward) and transformers' StaticCache (a 4-D additive mask). Targets with sliding-window layers
are refused. A greedy round has no host sync until its packed result is read, so on a GPU with `compile` it runs as
one CUDA graph per span of attended cache slots (checked against eager runs, as the chain's); a sampled round walks
the tree on the host and runs eagerly. A greedy round's time is reported as verify time, as a fused chain round's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .decode import Decoder, Generation, _commit, _emitted, probs_from_logits
from .engine.runners import FastTargetRunner
from .tree import Tree, TreeSpec, accept_greedy, accept_sample, grow_tree
from .util import EyasError, PhaseClock


class TreeDraftAttend:
    """The attention of one drafter layer while a tree grows: the frontier's keys and values go to a buffer of one
    slot per grown node (not to the cache, where siblings would share a position's slot); a node attends to the
    cache's committed slots (below `committed`) and to its ancestors' buffer slots (itself included)."""

    def __init__(self, dcache, nodes: int):
        self.dc = dcache
        shape = (1, dcache.k.shape[1], nodes, dcache.k.shape[3])
        self.k = torch.zeros(shape, device=dcache.k.device, dtype=dcache.k.dtype)
        self.v = torch.zeros_like(self.k)
        self.committed = 0  # cache slots every node sees (L-1)
        self.upto = dcache.max_len  # a host bound above `committed`
        self.nodes: torch.Tensor | None = None  # the frontier's node ids of the current call
        self.anc: torch.Tensor | None = None  # [grown, grown] ancestor-or-self

    def __call__(self, q, k, v):
        at = self.nodes
        self.k.index_copy_(2, at, k.to(self.k.dtype))
        self.v.index_copy_(2, at, v.to(self.v.dtype))
        n = self.upto
        seen = (self.dc.slots[:n] < self.committed)[None].expand(at.shape[0], n)
        mask = torch.cat([seen, self.anc[at]], dim=1)  # [frontier, n + grown]
        mask[:, n].fill_(False)  # node 0 is the root: its drafter entry is the cache's slot L-2, already in `seen`
        keys = torch.cat([self.dc.k[:, :, :n], self.k], dim=2).to(q.dtype)
        vals = torch.cat([self.dc.v[:, :, :n], self.v], dim=2).to(q.dtype)
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=self.dc.gqa)


def _target_tree_forward(runner, ids, positions, slot0: torch.Tensor, anc, upto: int):
    """The target over a tree's tokens ids [1, N] roped at positions [N], written to cache slots slot0..slot0+N-1
    (slot0 [1], on the device), with anc [N, N] the mask among them -> (logits [1, N, V], aux [1, N, 3H])."""
    if isinstance(runner, FastTargetRunner):
        return runner.lm.forward(ids, slot0, want_aux=True, upto=upto, tree=(positions, anc))
    # transformers' StaticCache writes slots slot0.. (its length pointer) and takes a ready 4-D additive mask
    N = ids.shape[1]
    runner.set_length(slot0[0])
    rel = torch.arange(runner.max_len, device=ids.device) - slot0
    vis = (rel < 0)[None] | (anc[:, rel.clamp(0, N - 1)] & (rel < N)[None])
    dtype = runner.model.dtype
    mask = torch.zeros(vis.shape, device=ids.device, dtype=dtype).masked_fill_(~vis, torch.finfo(dtype).min)
    out = runner.model(input_ids=ids, position_ids=positions[None], past_key_values=runner.cache,
                       attention_mask=mask[None, None], use_cache=True)
    aux = torch.cat([runner._grab[a] for a in runner.target.aux_layers], dim=-1)
    return out.logits, aux


def _keep_path(runner, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Move the target's cache entries at slots src [n] to slots dst [n] in every layer (read before written)."""
    if isinstance(runner, FastTargetRunner):  # [2, layers, B, Hkv, slots, D]: every layer at once
        kv = runner.lm.kv
        kv.index_copy_(4, dst, kv.index_select(4, src))
        return
    pairs = [(layer.keys, layer.values) for layer in runner.cache.layers if getattr(layer, "is_initialized", 0)]
    for k, v in pairs:
        for c in (k, v):
            c.index_copy_(2, dst, c.index_select(2, src))


def sliding_window_layers(model) -> bool:
    """Whether any of the target's layers attends within a sliding window (a tree's verify does not handle them)."""
    c = model.config
    if any(t != "full_attention" for t in (getattr(c, "layer_types", None) or [])):
        return True
    return bool(getattr(c, "sliding_window", None)) and getattr(c, "use_sliding_window", True) is not False


class TreeDecoder(Decoder):
    """Decoder whose speculative rounds draft an EAGLE-2 dynamic tree (`tree`, an eyas.tree.TreeSpec) instead of a
    chain; plain decoding (speculative=False) is the Decoder's. `k` is the tree's depth, so a Generation's
    `accepted` counts and every per-position statistic are per level of the tree."""

    def __init__(self, target, drafter, tree: TreeSpec, temperature: float = 0.0, top_p: float = 1.0,
                 max_len: int = 2048, compile: bool = False, seed: int = 0, engine: str = "auto",
                 fuse_drafter: bool = True):
        tree.check()
        if sliding_window_layers(target.model):
            raise EyasError(f"eval.tree: target '{target.name}' has sliding-window attention layers, which tree "
                            f"verification does not handle; evaluate it with a chain (eval.k, no eval.tree)")
        super().__init__(target, drafter, k=tree.depth, temperature=temperature, top_p=top_p, max_len=max_len,
                         compile=compile, seed=seed, engine=engine, fused=False, fuse_drafter=fuse_drafter)
        self.tree = tree
        if self.drafter is not None:
            self.tattends = [TreeDraftAttend(dc, 1 + tree.grown) for dc in self.dcaches]

    def _call(self, name: str, *args, upto: int):
        """Decoder._call, plus "tree": the greedy tree round (_tree_round_fwd), one CUDA graph per span of attended
        cache slots under `compile`."""
        if name != "tree":
            return super()._call(name, *args, upto=upto)
        if self.graphs.enabled:
            return self.graphs.run(f"tree@{upto}", lambda *a: self._tree_round_fwd(*a, upto=upto), *args)
        return self._tree_round_fwd(*args, upto=upto)

    @property
    def span(self) -> int:
        """Cache slots a round writes from the root's, L-1: the verified nodes, and the drafter's rerun."""
        return max(self.tree.tokens, self.tree.depth + 1)

    @property
    def round_slots(self) -> int:
        return self.span + 1

    @property
    def verify_tokens(self) -> int:
        return self.tree.tokens

    def _verify_end(self, p: int) -> int:
        return p + self.span

    def generate_like_verify(self, prompt_ids, max_new_tokens: int = 256, stop_ids=()) -> Generation:
        """Plain decoding with its steps shaped as the tree's verify: the tree's N tokens a call, and on eyas'
        forward with FastLM.tree_paths (each node attending as a batch row of its own) the steps' attention row by
        row too (FastLM.rowwise_verify); untimed, without CUDA graphs (their steps would be captured otherwise), but
        with the prompt's prefill padded as the tree's run pads it under graphs (Decoder.prefill_padded): a prefill of
        another length rounds the prompt's keys and values otherwise."""
        lm = getattr(self.runner, "lm", None)
        rowwise = lm is not None and lm.tree_paths
        was_rowwise, was_graphs, was_padded = (lm.rowwise_verify if rowwise else None), self.graphs.enabled, \
            self.graph_prefill
        if rowwise:
            lm.rowwise_verify = True
        self.graph_prefill = self.prefill_padded
        self.graphs.enabled = False
        try:
            return super().generate_like_verify(prompt_ids, max_new_tokens, stop_ids)
        finally:
            if rowwise:
                lm.rowwise_verify = was_rowwise
            self.graphs.enabled, self.graph_prefill = was_graphs, was_padded

    def _launch(self, state, speculative: bool, bound: int):
        """Decoder._launch, with a greedy tree round for the speculative launches (Decoder._pipelined queues the
        next round before the host reads the last one, as for the chain's fused rounds)."""
        if not speculative:
            return super()._launch(state, speculative, bound)
        packed, h, lg, pos = self._call("tree", *state, upto=self._upto(self._verify_end(bound - 1)))
        return (packed[-1:], h, lg, pos), packed

    def step_calls(self, plain: bool = True, speculative: bool = True) -> list[tuple]:
        """Decoder.step_calls' plain steps and prefills, and (greedy, eyas' forward) the tree round of every span."""
        calls = super().step_calls(plain, False)  # no chain rounds, but the speculative prefills
        calls += [c for c in super().step_calls(False, speculative) if c[0] == "prefill_spec"]
        if self.engine != "fast" or not speculative or self.drafter is None or self.temperature != 0:
            return calls
        c, dev = self.drafter.config, self.device
        tok = torch.zeros(1, dtype=torch.long, device=dev)
        h = torch.zeros(1, 1, c.hidden_size, device=dev, dtype=self.dtype)
        lg = torch.zeros(1, c.draft_vocab_size, device=dev, dtype=self.dtype)
        for u in sorted({self._upto(e) for e in range(1, self.max_len + 1)}):
            calls.append(("tree", (tok, h, lg, self._pos(max(0, u - self.span), 1)), u))
        return calls

    # -- one round -------------------------------------------------------------------------------
    def _draft_logp(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's log-probabilities over its vocabulary, at the eval's temperature and top-p when sampling."""
        if self.temperature == 0:
            return torch.log_softmax(logits.float(), -1)
        return probs_from_logits(logits, self.temperature, self.top_p).log()

    def grow(self, last: torch.Tensor, h_last: torch.Tensor, logits_last: torch.Tensor, pos0: torch.Tensor,
             upto: int) -> Tree:
        """The round's tree from the root last [1] at position pos0 [1] (= L-1) and the drafter's last output (hidden
        [1, 1, H], logits [1, Vd], at position L-2); drafter calls attend to `upto` cache slots (a host bound above
        L-1). No host sync."""
        spec = self.tree
        k = spec.topk
        hid = torch.zeros(1 + spec.grown, h_last.shape[-1], device=self.device, dtype=h_last.dtype)
        hid[1:1 + k] = h_last[0, -1]  # the hidden state each node is fed when it is expanded
        for ta in self.tattends:
            ta.committed, ta.upto = pos0, upto
        d2t = self.drafter.d2t

        def expand(frontier, tokens, level, anc):
            for ta in self.tattends:
                ta.nodes, ta.anc = frontier, anc
            pos = (pos0 + (level - 1)).expand(frontier.shape[0])[None]  # a level-l node is fed at L-2+l
            h, lg = self.drafter(tokens[None], hid[frontier][None], pos, attend=self.tattends, rope_table=True)
            base = 1 + k + (level - 1) * k * k  # where grow_tree puts these nodes' children
            hid[base:base + k * k] = h[0].repeat_interleave(k, 0)
            return self._draft_logp(lg[0])

        return grow_tree(spec, last, self._draft_logp(logits_last[0]), expand, lambda i: i + d2t[i])

    def _verify_tree(self, tree: Tree, pos0: torch.Tensor, upto: int):
        """The target over the tree's nodes at slots pos0.. -> (logits [N, V], aux [1, N, 3H])."""
        logits, aux = _target_tree_forward(self.runner, tree.tokens[None], pos0 + tree.depth, pos0, tree.anc, upto)
        return logits[0], aux

    def _commit_path(self, tree: Tree, aux, a, path, nxt, pos0: torch.Tensor, upto: int):
        """After acceptance (a [] accepted levels, path [D] their nodes, nxt [] the next token): the path's keys and
        values to consecutive target slots (those past it are stale slots, harmless), and the drafter rerun at
        positions L-1..L-1+D over the path's tokens then nxt, with the target's aux states at the root and the path
        -> (the drafter's hidden [1, 1, H] and logits [1, Vd] at the last emitted token's predecessor). No sync."""
        D = self.tree.depth
        ar = torch.arange(D + 1, device=self.device)
        _keep_path(self.runner, pos0 + path, pos0 + ar[1:])
        feed = torch.cat([tree.tokens[path], nxt.view(1)])
        feed = torch.where(ar == a, nxt, feed)[None]
        at = torch.cat([torch.zeros(1, dtype=torch.long, device=self.device), path])
        h, dl = self._drafter_fwd(feed, aux[:, at], pos0 + ar, upto)
        i = a.view(1, 1, 1)
        return h.gather(1, i.expand(1, 1, h.shape[-1])), dl.gather(1, i.expand(1, 1, dl.shape[-1]))[:, 0]

    def _tree_round_fwd(self, last, h_last, logits_last, pos0, upto: int):
        """One greedy tree round with no host sync (a CUDA graph under `compile`), from the root last [1] at
        position pos0 [1]: grow, verify, accept, commit. -> (packed [D+2] = accepted count, the path's D tokens (past
        the count: filler), the next token; the drafter's hidden [1, 1, H] and logits [1, Vd] for the next round;
        its pos0 [1])."""
        tree = self.grow(last, h_last, logits_last, pos0, upto)
        logits, aux = self._verify_tree(tree, pos0, upto)
        a, path, nxt = accept_greedy(tree, logits, self.tree.depth)
        h, dl = self._commit_path(tree, aux, a, path, nxt, pos0, upto)
        return torch.cat([a.view(1), tree.tokens[path], nxt.view(1)]), h, dl, pos0 + a + 1

    def _sampled_round(self, last, h_last, logits_last, pos0, upto: int, clock: PhaseClock):
        """One sampled tree round (eager: accept_sample walks the tree on the host) -> as _tree_round_fwd's."""
        t0 = clock.start()
        tree = self.grow(last, h_last, logits_last, pos0, upto)
        clock.stop("draft", t0)
        t0 = clock.start()
        logits, aux = self._verify_tree(tree, pos0, upto)
        p = probs_from_logits(logits, self.temperature, self.top_p)
        a, nodes, nxt = accept_sample(tree, p, self.generator)
        path = torch.zeros(self.tree.depth, dtype=torch.long, device=self.device)
        path[:a] = torch.tensor(nodes, dtype=torch.long, device=self.device)
        a_t, nxt_t = torch.tensor(a, device=self.device), torch.tensor(nxt, device=self.device)
        clock.stop("verify", t0)
        t0 = clock.start()
        h, dl = self._commit_path(tree, aux, a_t, path, nxt_t, pos0, upto)
        clock.stop("draft", t0)
        return torch.cat([a_t.view(1), tree.tokens[path], nxt_t.view(1)]), h, dl, pos0 + a + 1

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int = 256, stop_ids=(), speculative: bool = True) -> Generation:
        """As Decoder.generate, with tree rounds when `speculative`."""
        if not speculative:
            return super().generate(prompt_ids, max_new_tokens, stop_ids, speculative=False)
        run, first, h_last, logits_last = self._begin(prompt_ids, max_new_tokens, stop_ids, True, self.round_slots,
                                                      f" + a tree of {self.tree.tokens}")
        gen, out, stop, clock = run.gen, run.gen.tokens, run.stop, run.clock
        L = gen.prompt_tokens + 1
        state = (first.view(1), h_last, logits_last, self._pos(L - 1, 1))
        if self.temperature == 0:  # greedy: each round launched from the last one's device outputs
            if len(out) < max_new_tokens and out[-1] not in stop:
                self._pipelined(gen, out, L, state, True, max_new_tokens, stop, clock)
            return self._finish(run)
        while len(out) < max_new_tokens and out[-1] not in stop:
            res = self._sampled_round(*state, upto=self._upto(L - 1 + self.span), clock=clock)
            packed, h_last, logits_last, pos0 = res
            a, new = _emitted(packed.tolist())  # the round's one host sync
            gen.accepted.append(a)
            gen.target_forwards += 1
            state = (packed[-1:], h_last, logits_last, pos0)
            if _commit(out, new, stop, max_new_tokens):
                break
            L += len(new)
        return self._finish(run)
