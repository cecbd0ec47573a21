"""EAGLE-2 dynamic draft trees: the tree setting, growing a tree from the drafter's probabilities, and the greedy and
sampled acceptance rules over a tree that the target verified in one pass.

A tree is grown from the root (the last committed token) for `depth` levels: the root's `topk` likeliest drafts
form level 1; at each later level the `topk` best nodes of the level before (the frontier) are expanded, each into
its `topk` likeliest children. A node's score is the product of the draft probabilities along its path (a sum of
log-probabilities here). Of all the nodes grown, the `tokens - 1` best are kept, and with the root they are what
the target verifies: a child never scores above its parent, and ties keep the parent (grown first), so the kept
nodes always form a tree. These are SGLang's `--speculative-eagle-topk`, `--speculative-num-steps` and
`--speculative-num-draft-tokens` (which counts the root).

Node 0 is the root; nodes are numbered so that every ancestor comes before its descendants. `anc[i, j]` says node j
is node i's ancestor or node i itself: the target's tree attention mask among the verified tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .util import EyasError


@dataclass(frozen=True)
class TreeSpec:
    """A dynamic tree's shape: each expanded node's children (topk), levels (depth), verified tokens with the root
    (tokens)."""
    topk: int
    depth: int
    tokens: int

    @property
    def grown(self) -> int:
        """Nodes grown below the root: topk at level 1, topk * topk at each later level."""
        return self.topk + (self.depth - 1) * self.topk * self.topk

    @classmethod
    def parse(cls, text: str, where: str = "eval.tree") -> "TreeSpec | None":
        """'TOPK,DEPTH,TOKENS' (e.g. '4,4,16') -> a TreeSpec; '' -> None (a chain). Refused naming `where`."""
        text = (text or "").strip()
        if not text:
            return None
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise EyasError(f"{where}: {text!r} is not TOPK,DEPTH,TOKENS (three whole numbers, e.g. 4,4,16: "
                            f"SGLang's speculative-eagle-topk, speculative-num-steps, speculative-num-draft-tokens)")
        spec = cls(*(int(p) for p in parts))
        spec.check(where)
        return spec

    def check(self, where: str = "eval.tree") -> None:
        if self.topk < 1 or self.depth < 1:
            raise EyasError(f"{where}: topk and depth must be at least 1, got {self.topk},{self.depth},{self.tokens}")
        if not 2 <= self.tokens <= self.grown + 1:
            raise EyasError(f"{where}: tokens (verified per round, the root included) must be 2 to {self.grown + 1} "
                            f"for topk {self.topk} and depth {self.depth} (that many nodes are grown), got "
                            f"{self.tokens}")

    def __str__(self) -> str:
        return f"{self.topk},{self.depth},{self.tokens}"

    def as_dict(self) -> dict:
        return {"topk": self.topk, "depth": self.depth, "tokens": self.tokens}


def serving_flags(spec: TreeSpec | None, k: int) -> dict:
    """How to serve the setting eyas evaluated (a tree, or a chain of k drafts) in SGLang and vLLM."""
    if spec is None:
        return {"sglang": f"--speculative-eagle-topk 1 --speculative-num-steps {k} --speculative-num-draft-tokens "
                          f"{k + 1}",
                "vllm": f'--speculative-config \'{{"num_speculative_tokens": {k}, ...}}\''}
    return {"sglang": f"--speculative-eagle-topk {spec.topk} --speculative-num-steps {spec.depth} "
                      f"--speculative-num-draft-tokens {spec.tokens}",
            # vLLM's EAGLE tree is static (speculative_token_tree, a fixed list of paths), not a dynamic tree
            "vllm": "no dynamic tree: vLLM's speculative_config takes a static tree (speculative_token_tree, a fixed "
                    "list of paths) or a chain (num_speculative_tokens); its acceptance is not comparable with this "
                    "dynamic tree's"}


@dataclass
class Tree:
    """A grown tree, N nodes with the root (device tensors): tokens [N] (target ids; the root's is the last
    committed token), parents [N] (the root's is 0), depth [N] (the root's 0), anc [N, N] (bool), scores [N] (sum of
    draft log-probabilities along the path; the root's 0)."""
    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    anc: torch.Tensor
    scores: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


# expand(frontier node ids [topk], their tokens [topk], their level, anc over the grown nodes [C, C]) -> log-probs
# [topk, Vd] of each frontier node's next token (the drafter run on the frontier nodes)
Expand = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]


def grow_tree(spec: TreeSpec, root_token: torch.Tensor, root_logp: torch.Tensor, expand: Expand,
              to_target: Callable[[torch.Tensor], torch.Tensor] = lambda i: i) -> Tree:
    """Grow `spec`'s tree (module docstring) from the root's draft log-probabilities root_logp [Vd]; `expand` runs
    the drafter on a level's frontier; to_target maps draft-vocabulary ids to target ids. The grown nodes are
    numbered root 0, level 1 at 1..topk, then each level's topk * topk (frontier node f's children at f*topk..),
    which `expand` sees as node ids."""
    k, D = spec.topk, spec.depth
    dev = root_logp.device
    C = 1 + spec.grown
    tok = torch.zeros(C, dtype=torch.long, device=dev)
    par = torch.zeros(C, dtype=torch.long, device=dev)
    dep = torch.zeros(C, dtype=torch.long, device=dev)
    score = torch.zeros(C, dtype=torch.float32, device=dev)
    anc = torch.eye(C, dtype=torch.bool, device=dev)
    tok[0] = root_token.reshape(())
    s, i = root_logp.float().topk(k)
    new = torch.arange(1, k + 1, device=dev)
    # Python scalars are written with index_fill_/fill_ (a kernel argument): `t[idx] = 1` makes a host tensor and
    # copies it to the device, which a CUDA graph's capture refuses
    tok[new], score[new] = to_target(i), s
    dep.index_fill_(0, new, 1)
    anc[:, 0].index_fill_(0, new, True)
    frontier = new
    for d in range(2, D + 1):
        lp = expand(frontier, tok[frontier], d - 1, anc).float()  # [k, Vd]
        cs, ci = lp.topk(k, dim=-1)  # each frontier node's k likeliest children
        cs = (score[frontier][:, None] + cs).reshape(-1)
        base = 1 + k + (d - 2) * k * k
        new = torch.arange(base, base + k * k, device=dev)
        parents = frontier.repeat_interleave(k)
        tok[new], par[new], score[new] = to_target(ci.reshape(-1)), parents, cs
        dep.index_fill_(0, new, d)
        anc[new] = anc[parents]
        anc.view(-1).index_fill_(0, new * (C + 1), True)  # anc[new, new] = True
        frontier = new[cs.topk(k).indices]
    # the tokens - 1 best grown nodes; a stable sort keeps a parent before a child of the same score
    best = score[1:].sort(descending=True, stable=True).indices[:spec.tokens - 1] + 1
    keep = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), best.sort().values])
    where = torch.full((C,), -1, dtype=torch.long, device=dev)
    where[keep] = torch.arange(keep.shape[0], device=dev)
    return Tree(tokens=tok[keep], parents=where[par[keep]].clamp_min(0), depth=dep[keep],
                anc=anc[keep][:, keep], scores=score[keep])


def accept_greedy(tree: Tree, logits: torch.Tensor, depth: int):
    """Greedy verification of a tree from the target's logits [N, V] at its nodes: follow, from the root, the child
    whose token is the target's argmax. -> (accepted count [] (long), the accepted nodes by level [depth] (0 past
    the count), the next token []: the target's argmax at the last accepted node). No host sync."""
    g = logits.argmax(-1)  # [N]
    match = tree.tokens == g[tree.parents]
    match[0].fill_(True)
    ok = ~(tree.anc & ~match[None]).any(-1)  # every node on the path from the root matches
    levels = torch.arange(1, depth + 1, device=g.device)
    at = ok[None] & (tree.depth[None] == levels[:, None])  # [depth, N]; at most one node a level (distinct tokens)
    a = at.any(-1).sum()
    path = at.long().argmax(-1)
    last = (ok.long() * (tree.depth + 1)).argmax()
    return a, path, g.gather(0, last.view(1))[0]  # g[last] would read `last` on the host


def accept_sample(tree: Tree, p: torch.Tensor, generator: torch.Generator | None = None):
    """Sampled verification of a tree of deterministic drafts (the drafter's top-k, not sampled) from the target's
    probabilities p [N, V] at its nodes, lossless in distribution: at a node, its children are tried best first,
    each as a point-mass proposal: child c is accepted with probability r(c) / sum(r), where r is p at the node with
    the children tried before zeroed; on acceptance the walk moves to c, else after the last child the next token is
    drawn from r normalised. Each token is thus emitted with exactly p's probability.
    -> (accepted count, accepted node ids by level (list), next token (int)); one host sync and one draw."""
    N = tree.size
    pc = p[tree.parents, tree.tokens]  # [N]: each node's token under its parent's distribution
    u = torch.rand(N, device=p.device, generator=generator)
    parents, scores, pc_h, u_h = (x.tolist() for x in (tree.parents, tree.scores, pc, u))
    kids: list[list[int]] = [[] for _ in range(N)]
    for c in range(1, N):
        kids[parents[c]].append(c)
    node, path = 0, []
    while True:
        tried = 0.0
        moved = False
        for c in sorted(kids[node], key=lambda c: -scores[c]):
            left = 1.0 - tried
            if left > 0 and u_h[c] * left < pc_h[c]:
                node, moved = c, True
                path.append(c)
                break
            tried += pc_h[c]
        if not moved:
            break
    r = p[node].clone()
    if kids[node]:
        r[tree.tokens[kids[node]]] = 0
        if not float(r.sum()) > 0:  # the children held all of p's mass (and were all rejected: p's rounding)
            r = p[node]
    nxt = torch.multinomial(r / r.sum(), 1, generator=generator)
    return len(path), path, int(nxt)
