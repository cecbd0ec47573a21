"""EAGLE-2 dynamic draft trees: tree construction on hand-made probabilities, the target's tree-mask verify against
per-branch forwards (both engines), greedy tree decoding against plain greedy decoding on the real SmolLM2 (through
acceptances and rejections on every branch and level), and the sampled tree rule against exact distributions."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from eyas.decode import FastTargetRunner, TargetRunner, probs_from_logits
from eyas.draft import causal_attend
from eyas.tree import Tree, TreeSpec, accept_sample, grow_tree, serving_flags
from eyas.tree_decode import TreeDecoder, _keep_path, _target_tree_forward
from eyas.util import EyasError

from conftest import NEW
from test_decode import _chi2


# ---------------------------------------------------------------------------------------------
# the tree setting and tree construction

def test_tree_spec_parses_and_refuses_bad_settings():
    assert TreeSpec.parse("4,4,16") == TreeSpec(4, 4, 16) and TreeSpec.parse("") is None
    assert TreeSpec.parse(" 1, 3, 4 ").grown == 3 and TreeSpec(8, 6, 32).grown == 8 + 5 * 64
    for bad, why in [("4,4", "TOPK,DEPTH,TOKENS"), ("a,b,c", "TOPK,DEPTH,TOKENS"), ("0,4,16", "at least 1"),
                     ("2,2,8", "2 to 7"), ("4,4,1", "2 to")]:
        with pytest.raises(EyasError, match=why):
            TreeSpec.parse(bad, "--tree")
    flags = serving_flags(TreeSpec(4, 5, 16), 3)
    assert flags["sglang"] == "--speculative-eagle-topk 4 --speculative-num-steps 5 --speculative-num-draft-tokens 16"
    assert "static" in flags["vllm"]
    assert "--speculative-eagle-topk 1 --speculative-num-steps 3 --speculative-num-draft-tokens 4" == \
        serving_flags(None, 3)["sglang"]


def _logp(probs: dict[int, float], V: int = 6) -> torch.Tensor:
    p = torch.full((V,), 1e-9)
    for t, x in probs.items():
        p[t] = x
    return p.log()


def test_grow_tree_keeps_the_best_scored_nodes_as_a_tree():
    """topk 2, depth 3, 7 tokens on hand-made probabilities. Level 1: tokens 0 (.5), 1 (.3). Level 2 grows node 1's
    children 2 (.5*.7=.35), 3 (.15) and node 2's 4 (.3*.9=.27), 5 (.03); its frontier is nodes 3 (.35) and 5 (.27),
    whose children are 1 (.245), 0 (.105) and 3 (.216), 2 (.054). The six best grown nodes: .5 .35 .3 .27 .245 .216,
    a tree through both branches."""
    children = {0: {2: .7, 3: .3}, 1: {4: .9, 5: .1}, 2: {1: .7, 0: .3}, 4: {3: .8, 2: .2}}
    calls = []

    def expand(frontier, tokens, level, anc):
        calls.append((frontier.tolist(), tokens.tolist(), level))
        return torch.stack([_logp(children[t]) for t in tokens.tolist()])

    tree = grow_tree(TreeSpec(2, 3, 7), torch.tensor([5]), _logp({0: .5, 1: .3, 2: .1, 3: .05, 4: .03}), expand)
    assert calls == [([1, 2], [0, 1], 1), ([3, 5], [2, 4], 2)]
    assert tree.tokens.tolist() == [5, 0, 1, 2, 4, 1, 3]
    assert tree.parents.tolist() == [0, 0, 0, 1, 2, 3, 4]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 3, 3]
    want = [[j == i or j in anc for j in range(7)]
            for i, anc in enumerate([(), (0,), (0,), (0, 1), (0, 2), (0, 1, 3), (0, 2, 4)])]
    assert tree.anc.tolist() == want
    assert torch.allclose(tree.scores.exp(), torch.tensor([1, .5, .3, .35, .27, .245, .216]), atol=1e-6)
    # token ids map through to_target (the draft vocabulary's offsets)
    mapped = grow_tree(TreeSpec(2, 3, 7), torch.tensor([5]), _logp({0: .5, 1: .3, 2: .1, 3: .05, 4: .03}),
                       lambda f, t, lv, a: torch.stack([_logp(children[x - 10]) for x in t.tolist()]),
                       to_target=lambda i: i + 10)
    assert mapped.tokens.tolist() == [5, 10, 11, 12, 14, 11, 13]
    # equal scores (probability 1 all the way down): a parent is kept before its child, so the nodes stay a tree
    chain = grow_tree(TreeSpec(1, 3, 3), torch.tensor([0]), _logp({4: 1.0}), lambda f, t, lv, a: _logp({4: 1.0})[None])
    assert chain.parents.tolist() == [0, 0, 1] and chain.depth.tolist() == [0, 1, 2]


# ---------------------------------------------------------------------------------------------
# the tree-mask verify equals each branch's own forward

def _qwen3():
    torch.manual_seed(0)
    conf = AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                                max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32).eval()
    from eyas.target import Target, default_aux_layers

    return Target(model=model, tokenizer=None, name="random-qwen3", source="random", sha256="",
                  aux_layers=default_aux_layers(4), eot_token_ids=[0])


@pytest.mark.parametrize("family", ["tiny", "qwen3"])
@pytest.mark.parametrize("engine", ["fast", "hf", "fast-rowwise", "fast-scattered"])
def test_tree_verify_equals_each_branch_forward(tiny, family, engine, monkeypatch):
    """A hand-made tree of 7 nodes after a 9-token prefix: each node's logits and aux states from the one tree
    forward equal those of a forward over its own branch (prefix, root, ancestors, node, at consecutive positions);
    moving a path's cache entries to consecutive slots leaves the cache of that branch's forward. fast: each node's
    path laid at consecutive slots (FastLM.tree_paths); fast-scattered: the ancestors attended at their tree slots;
    fast-rowwise: that, token by token (FastLM.rowwise_verify), in the tree verify and the branches' forwards."""
    from eyas.engine.fastlm import FastLM

    monkeypatch.setattr(FastLM, "rowwise_verify", engine == "fast-rowwise")
    monkeypatch.setattr(FastLM, "tree_paths", engine == "fast")
    engine = engine.split("-")[0]
    target = tiny if family == "tiny" else _qwen3()
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(1, 500, (1, 9), generator=g)
    toks = torch.randint(1, 500, (7,), generator=g)
    parents = [0, 0, 0, 1, 2, 3, 3]
    depth = [0, 1, 1, 2, 2, 3, 3]
    anc = torch.eye(7, dtype=torch.bool)
    for i in range(1, 7):
        anc[i] |= anc[parents[i]]
    Runner = FastTargetRunner if engine == "fast" else TargetRunner

    def prefilled():
        r = Runner(target, 64)
        r.forward(prefix, torch.arange(9))
        return r

    with torch.no_grad():
        r = prefilled()
        logits, aux = _target_tree_forward(r, toks[None], 9 + torch.tensor(depth), torch.tensor([9]), anc, 64)
        for i in range(7):
            branch = [j for j in range(7) if anc[i, j]]
            ref = prefilled()
            rl, ra = ref.forward(toks[branch][None], torch.arange(9, 9 + len(branch)))
            torch.testing.assert_close(logits[0, i], rl[0, -1], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(aux[0, i], ra[0, -1], rtol=1e-4, atol=1e-4)
        path = [0, 1, 3, 5]  # the root, then levels 1..3
        _keep_path(r, torch.tensor([9 + j for j in path[1:]]), torch.tensor([10, 11, 12]))
        ref = prefilled()
        ref.forward(toks[path][None], torch.arange(9, 13))
        mine = ([(a, b) for a, b in zip(r.lm.k, r.lm.v)] if engine == "fast"
                else [(x.keys, x.values) for x in r.cache.layers])
        theirs = ([(a, b) for a, b in zip(ref.lm.k, ref.lm.v)] if engine == "fast"
                  else [(x.keys, x.values) for x in ref.cache.layers])
        for (k1, v1), (k2, v2) in zip(mine, theirs):
            torch.testing.assert_close(k1[:, :, :13], k2[:, :, :13], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v1[:, :, :13], v2[:, :, :13], rtol=1e-4, atol=1e-4)


def _products_round_rows_alone(model, rows: int, draws: int = 4) -> bool:
    """Whether each of the model's bf16 linear layers (the first decoder layer's and the head) gives `rows` rows at
    once, bit for bit, what it gives each row alone."""
    mods = [m for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear)]
    mods.append(model.get_output_embeddings())
    g = torch.Generator().manual_seed(7)
    for m in mods:
        w = m.weight
        for _ in range(draws):
            x = torch.randn(rows, w.shape[1], generator=g).to(w.device, w.dtype)
            if not torch.equal(F.linear(x, w, m.bias), torch.cat([F.linear(r[None], w, m.bias) for r in x])):
                return False
    return True


@pytest.mark.parametrize("family,device", [("smollm2", "cpu"), ("qwen3", "cpu"),
                                           pytest.param("smollm2", "cuda", marks=pytest.mark.gpu)])
def test_tree_verify_rounds_as_steps_over_each_path_in_bf16(smol, family, device):
    """In bf16, where attention rounds by its query count and the order of its terms (on this CPU the real SmolLM2's
    nodes differ when the tree is attended in one call): a binary tree of 12 nodes (a node's ancestors among its
    cousins) verified after a 40-token prefix gives each node, bit for bit, the logits and aux states of one-token
    steps over its own path at the positions plain decoding gives them."""
    import copy

    from eyas.engine.fastlm import FastLM

    model = (copy.deepcopy(smol.model) if family == "smollm2" else _qwen3().model).to(device, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(1, 500, (1, 40), generator=g).to(device)
    toks = torch.randint(1, 500, (12,), generator=g).to(device)
    parents = [0] + [(i - 1) // 2 for i in range(1, 12)]
    paths = [[0]]
    for i in range(1, 12):
        paths.append(paths[parents[i]] + [i])
    anc = torch.zeros(12, 12, dtype=torch.bool)
    for i, p in enumerate(paths):
        anc[i, p] = True
    depth = torch.tensor([len(p) - 1 for p in paths])
    at = lambda p: torch.tensor([p], device=device)  # noqa: E731
    # every product the forward makes (each width it takes in: a CPU kernel may split a long row otherwise for
    # another row count), over 12 rows at once against each row alone, on several draws
    if not _products_round_rows_alone(model, 12):
        pytest.skip("this machine's bf16 matrix products round a row by the rows beside it")
    with torch.no_grad():
        lm = FastLM(model, 1, 128, aux_layers=[1, 2])
        lm.forward(prefix, at(0))
        logits, aux = lm.forward(toks[None], at(40), want_aux=True, tree=((40 + depth).to(device), anc.to(device)))
        for i, p in enumerate(paths):  # each path's steps rewrite the slots from 40 on
            for d, j in enumerate(p):
                sl, sa = lm.forward(toks[j].view(1, 1), at(40 + d), want_aux=True)
            assert torch.equal(logits[0, i], sl[0, 0]) and torch.equal(aux[0, i], sa[0, 0]), f"node {i}"


# ---------------------------------------------------------------------------------------------
# greedy tree decoding on the real target

SHAPES = ["4,4,16", "2,3,6", "1,3,4", "3,1,3"]


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_tree_decoding_equals_plain(smol, prompt_set, plain_outputs, trained, shape):
    """Tree rounds of several shapes (a wide tree, a narrow one, a chain, one level) give plain greedy decoding's
    tokens; the trained drafter gets drafts accepted."""
    spec = TreeSpec.parse(shape)
    dec = TreeDecoder(smol, trained, spec, max_len=256)
    acc = []
    for ids, ref in list(zip(prompt_set, plain_outputs))[:2]:  # two prompts a shape: each round costs a SmolLM2 verify
        g = dec.generate(ids, NEW, smol.eot_token_ids)
        assert g.tokens == ref[:NEW], (shape, smol.tokenizer.decode(ids[-12:]))
        assert all(0 <= a <= spec.depth for a in g.accepted)
        acc += g.accepted
    assert sum(acc) > 0, acc


def test_overlapped_tree_rounds_decode_losslessly(smol, prompt_set, plain_outputs, trained, monkeypatch):
    """With Decoder.overlap (the GPU default) the next greedy tree round is queued before the host reads the last
    one, fed its device outputs: forced on here, on the CPU, the tokens are still plain greedy decoding's, at most
    one round is launched past the end of each generation, and at least one was launched ahead."""
    from eyas.decode import Decoder

    monkeypatch.setattr(Decoder, "overlap", True)
    launched, real = [], TreeDecoder._launch

    def counting(self, *a, **kw):
        launched[-1] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(TreeDecoder, "_launch", counting)
    extra = []
    for shape in ("4,4,16", "2,3,6"):
        dec = TreeDecoder(smol, trained, TreeSpec.parse(shape), max_len=256)
        for ids, ref in list(zip(prompt_set, plain_outputs))[:2]:
            launched.append(0)
            g = dec.generate(ids, NEW, smol.eot_token_ids)
            assert g.tokens == ref[:NEW], (shape, smol.tokenizer.decode(ids[-12:]))
            extra.append(launched[-1] - g.target_forwards)
    assert set(extra) <= {0, 1} and 1 in extra, extra


def test_transformers_engine_decodes_trees_losslessly(smol, prompt_set, plain_outputs, trained):
    dec = TreeDecoder(smol, trained, TreeSpec(4, 4, 16), max_len=256, engine="hf")
    assert dec.engine == "hf"
    for ids, ref in list(zip(prompt_set, plain_outputs))[:2]:
        assert dec.generate(ids, NEW, smol.eot_token_ids).tokens == ref[:NEW]


class ScriptedTreeDecoder(TreeDecoder):
    """Grows the real drafter's tree (so the drafter's tree attention runs), then rewrites its tokens so that the
    target's greedy continuation lies along the LAST node's branch of level e (round r: e = r % (depth + 1), the
    deepest level the tree has if shallower) and no other node matches it: acceptances of every length, down
    branches other than the first, so the cache compaction moves entries from scattered slots."""

    def __init__(self, *a, reference, prompt_len, **kw):
        super().__init__(*a, **kw)
        self.reference, self.n, self.rounds = reference, prompt_len, 0

    def grow(self, last, h_last, logits_last, pos0, upto):
        tree = super().grow(last, h_last, logits_last, pos0, upto)
        L = int(pos0) + 1
        ref = self.reference[L - self.n:] + [0] * (self.tree.depth + 1)
        depth, parents = tree.depth.tolist(), tree.parents.tolist()
        e = min(self.rounds % (self.tree.depth + 1), max(depth))
        self.rounds += 1
        end = max(i for i in range(tree.size) if depth[i] == e)
        on_path = set()
        while end:
            on_path.add(end)
            end = parents[end]
        V = self.target.vocab_size
        toks = [tree.tokens[0].item()] + [ref[depth[i] - 1] if i in on_path else (ref[depth[i] - 1] + 1 + i) % V
                                          for i in range(1, tree.size)]
        return Tree(tokens=torch.tensor(toks, device=tree.tokens.device), parents=tree.parents, depth=tree.depth,
                    anc=tree.anc, scores=tree.scores)


@pytest.mark.parametrize("shape", ["3,3,8", "2,4,9"])
def test_scripted_acceptance_on_every_branch_keeps_the_caches_right(smol, prompt_set, long_answer, trained, shape):
    """Every accepted length 0..depth, along the last branch of its level: the output equals plain greedy decoding,
    and afterwards the target's cache and the drafter's hold what fresh passes over the final sequence compute."""
    from eyas.engine.fastlm import FastLM

    spec = TreeSpec.parse(shape)
    ids = prompt_set[1]
    ref = long_answer[:40]
    dec = ScriptedTreeDecoder(smol, trained, spec, max_len=256, reference=ref, prompt_len=len(ids))
    g = dec.generate(ids, 30, ())
    assert g.tokens == ref[:30]
    assert set(g.accepted) == set(range(spec.depth + 1)), g.accepted
    seq = torch.tensor([ids + g.tokens])
    m = seq.shape[1] - 1
    fresh = FastLM(smol.model, 1, 256)
    fresh.forward(seq, torch.tensor([0]))
    for i in range(smol.num_layers):
        for have, want in ((dec.runner.lm.k[i], fresh.k[i]), (dec.runner.lm.v[i], fresh.v[i])):
            torch.testing.assert_close(have[:, :, :m], want[:, :, :m], atol=1e-4, rtol=1e-4)
    aux, _ = smol.capture(seq)
    keys = []
    trained(seq[:, 1:], aux[:, :-1], attend=lambda q, k, v: keys.append(k) or causal_attend(q, k, v))
    torch.testing.assert_close(dec.dcaches[0].k[:, :, :m], keys[0], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# the sampled tree rule, statistically (a Markov-chain "model" with exact probabilities)

def _wrong_no_renormalise(tree, p, generator=None):
    """A plausible bug: each sibling accepted with p(c), forgetting the mass of the siblings rejected before it."""
    parents, toks = tree.parents.tolist(), tree.tokens.tolist()
    node, path = 0, []
    while True:
        kids = sorted((c for c in range(1, tree.size) if parents[c] == node), key=lambda c: -float(tree.scores[c]))
        nxt = next((c for c in kids if float(torch.rand(1, generator=generator)) < float(p[node, toks[c]])), None)
        if nxt is None:
            r = p[node].clone()
            r[[toks[c] for c in kids]] = 0
            return len(path), path, int(torch.multinomial(r / r.sum(), 1, generator=generator))
        node = nxt
        path.append(nxt)


def _wrong_residual_is_p(tree, p, generator=None):
    """Another: after every child is rejected, draw from p itself (the rejected children not taken out)."""
    a, path, _ = accept_sample(tree, p, generator)
    node = path[-1] if path else 0
    return a, path, int(torch.multinomial(p[node], 1, generator=generator))


def _tree_sample_joint(rule, P, Q, spec, n_tokens, N, seed):
    """N sequences of a Markov chain from token 0, each made by tree rounds (the tree grown from drafter Q's
    log-probabilities, verified against target P by `rule`) -> counts of their first n_tokens."""
    g = torch.Generator().manual_seed(seed)
    V = P.shape[0]
    trees = [grow_tree(spec, torch.tensor([x]), Q[x].log(), lambda f, t, lv, a: Q[t].log()) for x in range(V)]
    counts = torch.zeros(V ** n_tokens, dtype=torch.float64)
    for _ in range(N):
        out, x = [], 0
        while len(out) < n_tokens:
            tree = trees[x]
            _, path, nxt = rule(tree, P[tree.tokens], g)
            out += tree.tokens[path].tolist() + [nxt] if path else [nxt]
            x = out[-1]
        idx = 0
        for t in out[:n_tokens]:
            idx = idx * V + t
        counts[idx] += 1
    return counts


def test_tree_sampling_reproduces_target_distribution():
    """First 2 emitted tokens of a 5-token Markov chain, tree 3,2,6 (12 nodes grown, 5 kept with the root), 6k
    sequences: the joint law of the emitted tokens equals the target chain's (chi-square below df + 6·sqrt(2·df), a
    >6-sigma bound), while two deliberately wrong rules exceed it. The target's nucleus (0.9) puts zero mass on
    tokens the tree may hold."""
    torch.manual_seed(0)
    V, n, N = 5, 2, 6_000
    P = probs_from_logits(torch.randn(V, V), 1.0, 0.9).double()
    Q = probs_from_logits(torch.randn(V, V), 1.0, 1.0).double()
    P, Q = P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True)
    assert (P == 0).any()
    exact = (P[0][:, None] * P).reshape(-1)
    spec = TreeSpec(3, 2, 6)
    stats = {}
    for name, rule in [("right", accept_sample), ("no-renormalise", _wrong_no_renormalise),
                       ("residual-is-p", _wrong_residual_is_p)]:
        chi2, df = _chi2(_tree_sample_joint(rule, P, Q, spec, n, N, seed=1), exact)
        stats[name] = (chi2, df + 6 * math.sqrt(2 * df))
    assert stats["right"][0] < stats["right"][1], stats
    for name in ("no-renormalise", "residual-is-p"):
        assert stats[name][0] > stats[name][1], (name, stats)


def test_sampled_tree_decoding_runs_and_is_seeded(tiny):
    from eyas.draft import build_drafter
    from eyas.evaluate import prompt_ids

    torch.manual_seed(0)
    d = build_drafter(tiny, 512)
    ids = prompt_ids(tiny.tokenizer, [{"role": "user", "content": "hi"}])
    outs = []
    for _ in range(2):
        dec = TreeDecoder(tiny, d, TreeSpec(3, 3, 8), temperature=0.8, max_len=128, seed=7)
        g = dec.generate(ids, 12, ())
        assert len(g.tokens) == 12 and all(0 <= t < tiny.vocab_size for t in g.tokens)
        outs.append(g.tokens)
    assert outs[0] == outs[1]
    with pytest.raises(EyasError, match="fit"):
        TreeDecoder(tiny, d, TreeSpec(3, 3, 8), max_len=24).generate(ids, 20)


# ---------------------------------------------------------------------------------------------
# eyas eval --tree, eyas parity, bench/bench_decode.py --tree

def test_eyas_eval_tree_writes_a_tree_report(tiny, tmp_path, capsys):
    """`eyas eval --tree 2,2,4` decodes with trees on the tiny target: the report says the tree, its depth as k,
    acceptance per level, SGLang's flags for it, and the lossless check; a malformed --tree stops with one line."""
    import json

    from eyas.cli import main
    from eyas.draft import build_drafter, save_drafter

    torch.manual_seed(0)
    draft = save_drafter(build_drafter(tiny, 1024), tmp_path / "draft")
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello there\nName a fruit.\n")
    args = ["eval", "--preset", "tiny", "--out", str(tmp_path / "run"), "--prompts", str(prompts), "--draft",
            str(draft), "--max-new-tokens", "8", "--device", "cpu"]
    assert main(args + ["--tree", "2,2,4"]) == 0
    rep = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert rep["tree"] == {"topk": 2, "depth": 2, "tokens": 4} and rep["k"] == 2
    assert len(rep["per_position_acceptance"]) == 2 and len(rep["accepted_length_histogram"]) == 3
    assert rep["serving_flags"]["sglang"] == ("--speculative-eagle-topk 2 --speculative-num-steps 2 "
                                              "--speculative-num-draft-tokens 4")
    assert rep["lossless"] is True and rep["lossless_checked"] == 2
    md = (tmp_path / "run" / "eval" / "report.md").read_text()
    assert "dynamic tree topk 2, depth 2, 4 tokens" in md and "Per-level acceptance" in md
    assert "at tree 2,2,4 (topk, depth, tokens) over 2 answers" in capsys.readouterr().err
    assert main(args + ["--tree", "2,2,9"]) == 2
    assert "eval.tree (--tree): tokens (verified per round, the root included) must be 2 to 7" in \
        capsys.readouterr().err


def test_parity_notes_the_engine_flags_of_a_tree_report():
    from eyas.parity import tree_settings_note

    rep = {"tree": {"topk": 4, "depth": 5, "tokens": 16}, "k": 5}
    assert "--speculative-eagle-topk 4 --speculative-num-steps 5 --speculative-num-draft-tokens 16" in \
        tree_settings_note(rep, "sglang")
    assert "static" in tree_settings_note(rep, "vllm") and tree_settings_note({"k": 3}, "vllm") is None


def test_bench_decode_sweeps_trees_beside_chains(tmp_path):
    """bench/bench_decode.py --tree times each tree as its own method beside the chain of --k and the plain
    baseline of the same run, with τ, per-level acceptance, tok/s and the speedup over plain in its JSON."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))  # bench_decode imports its sibling gpu_watch
    try:
        spec = importlib.util.spec_from_file_location("bench_decode_tree", bench / "bench_decode.py")
        bd = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bd)
        prompts = tmp_path / "p.txt"
        prompts.write_text("Hello there\nName a fruit.\n")
        out = tmp_path / "r.json"
        assert bd.main(["--draft", "untrained", "--target", "tiny", "--prompts", str(prompts), "--limit", "2",
                        "--k", "2", "--tree", "2,2,4", "3,3,8", "--max-new-tokens", "8", "--budget", "60",
                        "--ew", "0", "--skip-hf", "--out", str(out)]) == 0  # --ew 0: no compiling on the CPU
    finally:
        sys.path.remove(str(bench))
    methods = json.loads(out.read_text())["methods"]
    assert {"eyas_plain_ew0", "eyas_spec_k2_fused_ew0", "eyas_tree_2_2_4_ew0", "eyas_tree_3_3_8_ew0"} <= set(methods)
    for name, depth in (("eyas_tree_2_2_4_ew0", 2), ("eyas_tree_3_3_8_ew0", 3)):
        r = methods[name]
        assert r["tree"]["depth"] == depth and len(r["per_position_acceptance"]) == depth
        assert r["same_as_plain"] == "2/2" and r["tokens_per_s"] > 0 and r["speedup_vs_plain"] > 0
        assert r["acceptance_length"] >= 1
    with pytest.raises(SystemExit):
        bd.main(["--draft", "untrained", "--tree", "4,4"])


@pytest.mark.gpu
def test_graphed_tree_rounds_decode_losslessly_on_gpu():
    """On a GPU with CUDA graphs (the default there), each greedy tree round is one graph per span of the cache,
    captured by warm_up and checked against eager runs: the tiny model's plain greedy tokens (fp32) across every
    span, the same accepted counts as eager tree rounds, and the graphs stay on."""
    from eyas.config import TargetConfig
    from eyas.draft import build_drafter
    from eyas.target import load_target

    t = load_target(TargetConfig(name="tiny", dtype="float32", device="cuda"))
    torch.manual_seed(0)
    d = build_drafter(t, 512)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, t.vocab_size, (n,), generator=g).tolist() for n in (40, 240, 500)]
    runs = {}
    for graphs in (True, False):
        dec = TreeDecoder(t, d, TreeSpec(4, 4, 16), max_len=600, compile=graphs)
        assert dec.graphs.enabled == graphs
        if graphs:
            dec.warm_up()
            assert any(key[0].startswith("tree@") for key in dec.graphs.graphs)
        runs[graphs] = []
        for ids in prompts:
            plain = dec.generate(ids, 40, (), speculative=False).tokens
            spec = dec.generate(ids, 40, ())
            assert spec.tokens == plain
            runs[graphs].append(spec.accepted)
        assert dec.graphs.enabled == graphs
    assert runs[True] == runs[False]


# ---------------------------------------------------------------------------------------------
# the greedy round does no host work (what a CUDA graph's capture refuses), checked on the CPU

_FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.eye, torch.rand, torch.randn,
              torch.randint, torch.linspace}


class _HostWork(TorchFunctionMode):
    """Records what, on a GPU, would copy host data to the device or read the device on the host: tensors made from
    Python data (torch.tensor, list indices, Python scalars written into a tensor: aten.lift_fresh below the Python
    layer), factories without a device, and host reads (aten._local_scalar_dense: item, tolist, bool)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        outer = self

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten._local_scalar_dense.default):
                    outer.seen.append(f"{func} at {outer.where()}")
                return func(*args, **(kwargs or {}))

        self.ops = Ops()

    @staticmethod
    def where() -> str:
        import traceback

        frames = [f for f in traceback.extract_stack() if "/eyas/" in f.filename]
        return f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and "device" not in kwargs:
            self.seen.append(f"{func.__name__} without a device at {self.where()}")
        return func(*args, **kwargs)

    def __enter__(self):
        self.ops.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self.ops.__exit__(*exc)


def test_greedy_tree_round_does_no_host_work(tiny):
    """Every greedy tree round (grow, verify, accept, commit, drafter rerun) on the tiny target with eyas' engine
    makes no tensor from host data and reads nothing on the host: on a GPU each of those is a host->device copy or a
    sync that a CUDA graph's capture refuses. The guard itself catches a Python scalar written into a tensor."""
    from eyas.draft import build_drafter

    with _HostWork() as probe:
        torch.zeros(3)[torch.arange(2, device="cpu")] = 1
    assert len(probe.seen) == 2 and "lift_fresh" in probe.seen[1], probe.seen
    torch.manual_seed(0)
    d = build_drafter(tiny, 512)
    dec = TreeDecoder(tiny, d, TreeSpec(3, 3, 8), max_len=128)
    assert dec.engine == "fast"
    rounds, seen = [], []
    orig = dec._tree_round_fwd

    def guarded(*a, **k):
        with _HostWork() as guard:
            out = orig(*a, **k)
        rounds.append(1)
        seen.extend(guard.seen)
        return out

    dec._tree_round_fwd = guarded
    g = dec.generate(list(range(20, 40)), 12, ())
    assert len(rounds) >= 2 and len(g.tokens) == 12
    assert not seen, sorted(set(seen))


def _hash_map_prompt(smol) -> list[int]:
    """A chat prompt whose answer meets a near-tie within 30 tokens on this project's CPU in bf16: one-token plain
    decoding, or N-token steps with their attention in one call, part there from a tree."""
    from eyas.evaluate import prompt_ids

    return prompt_ids(smol.tokenizer, [{"role": "user", "content": "Explain how a hash map works."}])


@pytest.mark.parametrize("shape", ["3,3,8", "2,4,9"])
@pytest.mark.parametrize("which,device", [("smollm2", "cpu"), pytest.param("smollm2", "cuda", marks=pytest.mark.gpu),
                                          pytest.param("qwen2.5-1.5b", "cuda", marks=pytest.mark.gpu)])
def test_a_bf16_tree_is_plain_decoding_with_the_trees_verify_shapes(smol, which, device, shape):
    """A tree's verify runs its N nodes in one call, each node attending as a batch row of its own over its path
    (FastLM.tree_paths). Plain decoding with its steps shaped so (TreeDecoder.generate_like_verify: N tokens a call,
    the attention row by row) is what a greedy tree must give bit for bit in bf16, on machines whose products round
    a row by the rows beside it too (one-token plain decoding then parts from it): through acceptances of several
    lengths down branches other than the first."""
    from test_decode import _bf16_target

    from eyas.draft import build_drafter

    from conftest import assert_same_cache, draft_vocab

    t = _bf16_target(smol, which, device)
    spec = TreeSpec.parse(shape)
    ids = _hash_map_prompt(smol)
    twin = TreeDecoder(t, None, spec, max_len=256)
    ref = twin.generate_like_verify(ids, 40, ()).tokens
    torch.manual_seed(0)
    drafter = build_drafter(t, 2048, draft_vocab(t, [ids + ref]))
    dec = ScriptedTreeDecoder(t, drafter, spec, max_len=256, reference=ref, prompt_len=len(ids))
    g = dec.generate(ids, 30, ())
    assert g.tokens == ref[:30]
    # acceptances of several lengths (an untrained drafter's tree of N nodes may hold no node at the full depth)
    assert {0, 1, 2} <= set(g.accepted), g.accepted
    # bit for bit beneath the tokens: every committed position's keys and values in every layer
    assert_same_cache(dec, twin, len(ids) + 29)


def test_a_trees_plain_twin_prefills_as_the_tree_does_when_its_graphs_are_off(smol):
    """Under CUDA graphs a tree's run prefills the prompt padded to a fixed length; its plain twin runs without graphs
    and must still prefill so: on a GPU a prefill of another length rounds the prompt's keys and values otherwise.
    Graphs stood in for by eager calls (this machine has none): the same prefill shape, the same tokens, and the same
    keys and values bit for bit."""
    from test_decode import _bf16_target

    from eyas.draft import build_drafter

    from conftest import assert_same_cache

    t = _bf16_target(smol, "smollm2", "cpu")
    spec = TreeSpec.parse("3,3,8")
    ids = _hash_map_prompt(smol)
    torch.manual_seed(0)
    dec = TreeDecoder(t, build_drafter(t, 2048), spec, max_len=256)
    twin = TreeDecoder(t, None, spec, max_len=256)
    first_call = {}
    for d in (dec, twin):
        d.graphs.enabled, d.graphs.run = True, lambda name, fn, *a: fn(*a)
        fwd = d.runner.lm.forward

        def record(ids_, *a, _d=d, _fwd=fwd, **k):
            first_call.setdefault(id(_d), ids_.shape[1])
            return _fwd(ids_, *a, **k)

        d.runner.lm.forward = record
    assert dec.prefill_padded
    g = dec.generate(ids, 20, ())
    assert twin.generate_like_verify(ids, 20, ()).tokens == g.tokens
    assert first_call[id(twin)] == first_call[id(dec)] == TreeDecoder.PREFILL_BUCKET > len(ids)
    assert twin.graphs.enabled and twin.graph_prefill is None  # its settings come back
    assert_same_cache(dec, twin, len(ids) + 19)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["smollm2", "qwen2.5-1.5b"])
def test_a_compiled_graphed_tree_is_its_plain_twin_bit_for_bit(smol, which):
    """As bench_decode runs a tree (compile: CUDA graphs and compiled elementwise kernels), its rounds and its plain
    twin (generate_like_verify, which runs eager) leave the same tokens and, slot by slot, the same keys and values in
    every layer; an untrained drafter, so mostly the root's row carries the round."""
    from test_decode import _bf16_target

    from eyas.draft import build_drafter

    from conftest import assert_same_cache

    t = _bf16_target(smol, which, "cuda")
    spec = TreeSpec.parse("4,2,6")
    ids = _hash_map_prompt(smol)
    twin = TreeDecoder(t, None, spec, max_len=512, compile=True)
    ref = twin.generate_like_verify(ids, 80, ()).tokens
    torch.manual_seed(0)
    dec = TreeDecoder(t, build_drafter(t, 2048), spec, max_len=512, compile=True)
    g = dec.generate(ids, 60, ())
    assert dec.graphs.enabled  # the rounds ran as graphs, checked against eager runs
    assert g.tokens == ref[:60]
    assert_same_cache(dec, twin, len(ids) + 59)
