"""The speculative decoding engine: lossless greedy decoding on the real SmolLM2 target, the
rejection-sampling rule against exact distributions, and cache rollback under forced rejections."""
import pytest
import torch

from eyas.decode import Decoder, verify_greedy, verify_sample
from eyas.draft import build_drafter, causal_attend
from eyas.engine.fastlm import FastLM
from eyas.engine.sampling import probs_from_logits
from eyas.evaluate import prompt_ids

from conftest import NEW, assert_same_cache, draft_vocab

# the untrained drafter, rejected almost always, checks the first NEW_UNTRAINED of conftest's NEW answer tokens
NEW_UNTRAINED = 12
FEW = 5  # prompts for the decoding paths checked beside the main one (each SmolLM2 verify pass costs 0.1-0.3 s on CI's CPU)


# ---------------------------------------------------------------------------------------------
# the sampling rule, statistically (no model needed: a Markov-chain "model" with exact probabilities)

def _wrong_resample_from_p(p, q, drafts, generator=None):
    """A plausible bug: on rejection, draw from p instead of the residual max(p - q, 0)."""
    B, K = drafts.shape
    pd = p[:, :K].gather(-1, drafts[..., None])[..., 0]
    qd = q.gather(-1, drafts[..., None])[..., 0]
    u = torch.rand(B, K, generator=generator)
    a = (u * qd < pd).long().cumprod(-1).sum(-1)
    return a, torch.multinomial(p[torch.arange(B), a], 1, generator=generator)[:, 0]


def _wrong_deterministic(p, q, drafts, generator=None):
    """Another: accept whenever p(d) >= q(d)... and otherwise never (no coin flip)."""
    B, K = drafts.shape
    pd = p[:, :K].gather(-1, drafts[..., None])[..., 0]
    qd = q.gather(-1, drafts[..., None])[..., 0]
    a = (pd >= qd).long().cumprod(-1).sum(-1)
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], 1)
    r = (p[torch.arange(B), a] - q_pad[torch.arange(B), a]).clamp_min(0) + 1e-12
    return a, torch.multinomial(r, 1, generator=generator)[:, 0]


def _chain_sample_joint(rule, P, Q, K, n_tokens, N, seed):
    """Run speculative rounds with `rule` for N independent sequences of a Markov chain that starts
    at token 0 (target transition matrix P, drafter Q) and return the counts of the first n_tokens."""
    g = torch.Generator().manual_seed(seed)
    V = P.shape[0]
    last = torch.zeros(N, dtype=torch.long)
    buf = torch.full((N, n_tokens), -1, dtype=torch.long)
    count = torch.zeros(N, dtype=torch.long)
    ar = torch.arange(N)
    while (count < n_tokens).any():
        drafts, qs, ps = [], [], []
        x = last
        for _ in range(K):
            qs.append(Q[x])
            ps.append(P[x])
            x = torch.multinomial(Q[x], 1, generator=g)[:, 0]
            drafts.append(x)
        ps.append(P[x])
        d = torch.stack(drafts, 1)
        a, nxt = rule(torch.stack(ps, 1), torch.stack(qs, 1), d, g)
        emitted = torch.cat([d, torch.zeros(N, 1, dtype=torch.long)], 1)
        emitted[ar, a] = nxt
        for j in range(K + 1):
            put = (j <= a) & (count < n_tokens)
            buf[ar[put], count[put]] = emitted[put, j]
            count = count + put.long()
        last = nxt
    idx = torch.zeros(N, dtype=torch.long)
    for j in range(n_tokens):
        idx = idx * V + buf[:, j]
    return torch.bincount(idx, minlength=V ** n_tokens).double()


def _exact_joint(P, n_tokens):
    V = P.shape[0]
    probs = P[0]
    for _ in range(n_tokens - 1):
        probs = (probs.view(-1, V)[..., None] * P[None]).reshape(-1)
    return probs


def _chi2(counts, probs):
    """Pearson chi-square of counts against probs (inf if a probability-zero cell was hit), and df."""
    e = probs * counts.sum()
    keep = e > 0
    if counts[~keep].sum() > 0:
        return float("inf"), int(keep.sum()) - 1
    return float(((counts[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_rejection_sampling_reproduces_target_distribution(top_p):
    """First 3 emitted tokens of a 5-token Markov chain, K=3, 60k sequences: the joint law of the
    emitted tokens must equal the target chain's (chi-square below df + 6·sqrt(2·df), a >6-sigma
    bound), while two deliberately wrong rules must exceed it. With top_p < 1 the target
    (temperature 0.7, nucleus 0.8) puts zero mass where the drafter does not."""
    torch.manual_seed(0)
    V, K, n, N = 5, 3, 3, 60_000
    P = probs_from_logits(torch.randn(V, V), 0.7, top_p).double()
    Q = probs_from_logits(torch.randn(V, V), 1.0, 1.0).double()
    P, Q = P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True)
    exact = _exact_joint(P, n)
    assert abs(exact.sum() - 1) < 1e-9
    stats = {}
    for name, rule in [("right", verify_sample), ("resample-from-p", _wrong_resample_from_p),
                       ("deterministic", _wrong_deterministic)]:
        chi2, df = _chi2(_chain_sample_joint(rule, P, Q, K, n, N, seed=1), exact)
        stats[name] = (chi2, df + 6 * (2 * df) ** 0.5)
    chi2, bound = stats["right"]
    assert chi2 < bound, stats
    for name in ("resample-from-p", "deterministic"):
        assert stats[name][0] > stats[name][1], (name, stats)


def test_probs_top_p_and_greedy_rule():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = probs_from_logits(logits, 1.0, 0.7)
    full = torch.softmax(logits, -1)
    assert full[0, 0] < 0.7 < full[0, :2].sum()
    assert (p[0, 2:] == 0).all() and torch.allclose(p[0, :2], full[0, :2] / full[0, :2].sum())
    tl = torch.zeros(1, 4, 10)
    tl[0, torch.arange(4), torch.tensor([3, 5, 7, 9])] = 1.0  # target argmax: 3, 5, 7, 9
    for drafts, a_exp, n_exp in [([3, 5, 7], 3, 9), ([3, 4, 7], 1, 5), ([0, 5, 7], 0, 3)]:
        a, nxt = verify_greedy(tl, torch.tensor([drafts]))
        assert (int(a), int(nxt)) == (a_exp, n_exp)


# ---------------------------------------------------------------------------------------------
# greedy losslessness on the real target

@pytest.mark.parametrize("layers", [1, 2])
def test_fused_drafter_step_equals_the_plain_one(tiny, tmp_path, layers):
    """Eagle3Drafter.fuse (q/k/v and gate/up as one product each in every layer, rope from a table) gives the same
    step as the separate modules (its RMSNorms one kernel each), keeps the state dict (and a fused drafter still
    saves and loads), and stands aside once .to() gives the modules new weights; unfuse() undoes all of it."""
    from eyas.draft import RMSNorm, _fused, load_drafter, save_drafter

    torch.manual_seed(0)
    d = build_drafter(tiny, 512, intermediate_size=96, num_layers=layers).eval()
    keys = sorted(d.state_dict())
    ids = torch.randint(0, tiny.vocab_size, (1, 6))
    aux = torch.randn(1, 6, 3 * d.config.hidden_size)
    pos = (torch.arange(6) + 9)[None]
    with torch.no_grad():
        ref = d(ids, aux, pos)
        d.fuse(64)
        attn, mlp = d.decoder_layers()[-1].self_attn, d.decoder_layers()[-1].mlp
        for layer in d.decoder_layers():
            assert _fused(layer.self_attn, ("q_proj", "k_proj", "v_proj")) is not None
            assert _fused(layer.mlp, ("gate_proj", "up_proj")) is not None
        norms = [m for m in d.modules() if isinstance(m, RMSNorm)]
        assert len(norms) == 4 + 2 * (layers - 1) and all(m.one_kernel for m in norms)
        got = d(ids, aux, pos, rope_table=True)
        for a, b in zip(ref, got):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert sorted(d.state_dict()) == keys
        save_drafter(d, tmp_path / "d")
        back = load_drafter(tmp_path / "d", tiny).eval()
        torch.testing.assert_close(back(ids, aux, pos)[1], ref[1], rtol=1e-5, atol=1e-5)
        d.to(torch.float64)
        assert _fused(attn, ("q_proj", "k_proj", "v_proj")) is None and _fused(mlp, ("gate_proj", "up_proj")) is None
        again = d(ids, aux.double(), pos, rope_table=True)  # the fp32 table is not used for fp64 states
        torch.testing.assert_close(again[1].float(), ref[1], rtol=1e-4, atol=1e-4)
        d.unfuse()
        assert not any(m.one_kernel for m in norms) and "_rope_table" not in d.__dict__


@pytest.mark.parametrize("fused", [False, True], ids=["steps", "fused"])
@pytest.mark.parametrize("which", ["untrained", "trained"])
def test_greedy_speculative_equals_plain(smol, prompt_set, plain_outputs, which, fused, request):
    drafter = request.getfixturevalue(which)
    new = NEW if which == "trained" else NEW_UNTRAINED
    taus = {}
    for k in (1, 3, 7):
        dec = Decoder(smol, drafter, k=k, max_len=256, fused=fused)
        assert dec.fused == fused
        acc = []
        n = len(prompt_set) if k == 3 else FEW  # every prompt at the default K; K=1 and 7 on the first few (CI time)
        for ids, ref in zip(prompt_set[:n], plain_outputs):
            g = dec.generate(ids, new, smol.eot_token_ids, speculative=True)
            assert g.tokens == ref[:new], (which, k, smol.tokenizer.decode(ids[-12:]))
            acc += g.accepted
        taus[k] = (sum(acc) + len(acc)) / len(acc)
    if which == "trained":  # the test exercises acceptance, not only rejection
        assert taus[3] > 1.5 and taus[7] >= taus[1], taus
    else:
        assert taus[1] < 1.5, taus


@pytest.mark.parametrize("fuse_drafter", [False, True])
def test_fuse_drafter_argument_sets_the_drafters_layout(smol, prompt_set, plain_outputs, trained, fuse_drafter):
    """`Decoder(fuse_drafter=...)` fuses the drafter's projections and rope table or leaves them apart (bench/
    bench_decode.py --draft-fuse times both); either way greedy decoding gives plain decoding's tokens."""
    dec = Decoder(smol, trained, k=3, max_len=256, fuse_drafter=fuse_drafter)
    assert ("_rope_table" in dec.drafter.__dict__) == fuse_drafter
    for ids, ref in zip(prompt_set[:FEW], plain_outputs):
        assert dec.generate(ids, NEW, smol.eot_token_ids, speculative=True).tokens == ref[:NEW]


@pytest.mark.parametrize("fused", [False, True], ids=["steps", "fused"])
def test_folded_verify_decodes_losslessly(smol, prompt_set, trained, fused, monkeypatch):
    """With the verify pass folding the query heads (FastLM.gqa_steps off) instead of SDPA's enable_gqa,
    greedy speculative decoding still reproduces plain greedy decoding, through accepted and rejected drafts."""
    from eyas.engine.fastlm import FastLM

    monkeypatch.setattr(FastLM, "gqa_steps", False)
    plain = Decoder(smol, None, max_len=256)
    refs = [plain.generate(ids, NEW, smol.eot_token_ids, speculative=False).tokens for ids in prompt_set[:4]]
    for k in (3, 7):
        dec = Decoder(smol, trained, k=k, max_len=256, fused=fused)
        acc = []
        for ids, ref in zip(prompt_set[:4], refs):
            g = dec.generate(ids, NEW, smol.eot_token_ids, speculative=True)
            assert g.tokens == ref, (k, smol.tokenizer.decode(ids[-12:]))
            acc += g.accepted
        assert 0 < sum(acc) < k * len(acc), acc  # drafts were accepted and rejected


def test_transformers_engine_gives_the_same_tokens(smol, prompt_set, plain_outputs, trained):
    """The fallback for architectures eyas' forward does not run: transformers with its StaticCache."""
    dec = Decoder(smol, trained, k=3, max_len=256, engine="hf")
    assert dec.engine == "hf"
    for ids, ref in list(zip(prompt_set, plain_outputs))[:3]:
        assert dec.generate(ids, NEW, smol.eot_token_ids, speculative=True).tokens == ref[:NEW]
        assert dec.generate(ids, NEW, smol.eot_token_ids, speculative=False).tokens == ref[:NEW]


def test_overlapped_steps_and_rounds_decode_losslessly(smol, prompt_set, plain_outputs, trained, monkeypatch):
    """Decoder.overlap (the GPU default) queues the next plain step or fused round before the host reads the
    last one's tokens, feeding it the device outputs (the round's next position included). Forced on here, on
    the CPU: plain and speculative output still equal plain greedy decoding, one step or round at most is
    launched past the end of each generation, and at least one was launched ahead (the overlap did happen)."""
    monkeypatch.setattr(Decoder, "overlap", True)
    launched = []
    real = Decoder._launch

    def counting(self, *a, **kw):
        launched[-1] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(Decoder, "_launch", counting)
    extra = []
    for k in (1, 3, 7):
        dec = Decoder(smol, trained, k=k, max_len=256, fused=True)
        for speculative in (False, True) if k == 3 else (True,):
            for ids, ref in zip(prompt_set[:FEW], plain_outputs):
                launched.append(0)
                g = dec.generate(ids, NEW, smol.eot_token_ids, speculative=speculative)
                assert g.tokens == ref[:NEW], (k, speculative, smol.tokenizer.decode(ids[-12:]))
                extra.append(launched[-1] - g.target_forwards)
                assert 0 < g.verify_seconds and g.prefill_seconds + g.verify_seconds <= g.seconds
    assert set(extra) <= {0, 1} and 1 in extra, extra
    # a generation that stops on its first token launches nothing
    launched.append(0)
    g = Decoder(smol, trained, k=3, max_len=256, fused=True).generate(prompt_set[0], 1, ())
    assert len(g.tokens) == 1 and launched[-1] == 0


def test_compiled_elementwise_target_decodes_losslessly(smol, prompt_set, plain_outputs, trained, monkeypatch):
    """Decoder.compile_elementwise (FastLM's rope, residual add + norm and silu * up as torch.compile'd kernels on
    its steps and verify passes; prefills stay eager): a step's logits and aux states match the eager forward's,
    and plain and K=3 speculative decoding give the eager plain output, token for token."""
    from eyas.engine.fastlm import FastLM

    ids = torch.tensor([prompt_set[0]])
    n = ids.shape[1]
    lms = {}
    for ew in (False, True):
        lm = FastLM(smol.model, 1, 256, smol.aux_layers)
        lm.compile_elementwise = ew
        with torch.no_grad():
            lm.forward(ids, torch.tensor([0]), one_off=True)  # the prefill, eager either way
            lms[ew] = lm.forward(torch.tensor([[plain_outputs[0][0], plain_outputs[0][1], 17, 99]]),
                                 torch.tensor([n]), want_aux=True)
    for a, b in zip(lms[False], lms[True]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(Decoder, "compile_elementwise", True)
    dec = Decoder(smol, trained, k=3, max_len=256, fused=True)
    assert dec.runner.lm.compile_elementwise
    for ids, ref in list(zip(prompt_set, plain_outputs))[:3]:
        assert dec.generate(ids, NEW, smol.eot_token_ids, speculative=False).tokens == ref[:NEW]
        assert dec.generate(ids, NEW, smol.eot_token_ids, speculative=True).tokens == ref[:NEW]
    import eyas.engine.fastlm

    assert not eyas.engine.fastlm._EAGER  # the compiled functions ran, none fell back to eager


# ---------------------------------------------------------------------------------------------
# rollback: rejections forced at every draft position

class ScriptedDecoder(Decoder):
    """Runs the real drafter (so its cache is written and rolled back) but proposes the target's own
    greedy tokens, wrong at a scripted position each round: round r rejects at position r % (K+1)
    (K+1 meaning all accepted). Works in both round modes: step by step (`draft`, position L as an
    int) and fused (`_draft_chain`, position L-1 as a tensor)."""

    def __init__(self, *a, reference, prompt_len, **kw):
        super().__init__(*a, **kw)
        self.reference, self.n, self.round = reference, prompt_len, 0

    def _script(self, L: int, device) -> torch.Tensor:
        start = L - self.n  # index into reference of the first draft's token
        oracle = list(self.reference[start:start + self.k])
        oracle += [0] * (self.k - len(oracle))
        err = self.round % (self.k + 1)
        if err < self.k:
            oracle[err] = (oracle[err] + 1) % self.target.vocab_size
        self.round += 1
        return torch.tensor([oracle], device=device)

    def draft(self, h_last, logits_last, L):
        drafts, q = super().draft(h_last, logits_last, L)
        return self._script(L, drafts.device), q

    def _draft_chain(self, h_last, logits_last, pos0, upto):
        drafts = super()._draft_chain(h_last, logits_last, pos0, upto)
        return self._script(int(pos0[0]) + 1, drafts.device)


@pytest.mark.parametrize("fused", [False, True, "overlap"], ids=["steps", "fused", "fused_overlap"])
@pytest.mark.parametrize("k", [3, 7])
def test_rollback_with_rejections_at_every_position(smol, prompt_set, long_answer, untrained, k, fused, monkeypatch):
    _rollback_check(smol, prompt_set, long_answer, untrained, k, fused, monkeypatch)


@pytest.mark.parametrize("fused", [False, True], ids=["steps", "fused"])
def test_two_layer_drafter_rolls_back_every_layer(smol, prompt_set, plain_outputs, long_answer, fused, monkeypatch):
    """A drafter of two decoder layers (train.draft_layers=2) decodes losslessly through rejections at every
    position, and each layer's cache holds what a fresh pass over the final sequence computes for that layer."""
    torch.manual_seed(1)
    deep = build_drafter(smol, 2048, draft_vocab(smol, [p + o for p, o in zip(prompt_set, plain_outputs)]),
                         num_layers=2)
    _rollback_check(smol, prompt_set, long_answer, deep, 3, fused, monkeypatch)


def _rollback_check(smol, prompt_set, long_answer, untrained, k, fused, monkeypatch):
    if fused == "overlap":  # fused rounds, each queued before the last one is read (the GPU default)
        monkeypatch.setattr(Decoder, "overlap", True)
    ids = prompt_set[1]
    ref = long_answer
    dec = ScriptedDecoder(smol, untrained, k=k, max_len=256, reference=ref, prompt_len=len(ids), fused=bool(fused))
    g = dec.generate(ids, 40, (), speculative=True)
    assert g.tokens == ref[:40]
    expected = [r % (k + 1) for r in range(len(g.accepted))]
    assert g.accepted == expected  # every position 0..K-1 was rejected, and K accepted in full
    assert set(expected) == set(range(k + 1))
    # the drafter cache of every committed position equals a fresh pass over the final sequence
    seq = torch.tensor([ids + g.tokens])
    aux, _ = smol.capture(seq)
    keys = [[] for _ in range(untrained.config.num_hidden_layers)]

    def recorder(layer):
        def record(q, kk, v):
            keys[layer].append(kk)
            return causal_attend(q, kk, v)
        return record

    untrained(seq[:, 1:], aux[:, :-1], attend=[recorder(i) for i in range(len(keys))])
    m = seq.shape[1] - 1
    assert len(dec.dcaches) == len(keys)
    for dc, kk in zip(dec.dcaches, keys):
        assert torch.allclose(dc.k[:, :, :m], kk[0], atol=1e-4), (dc.k[:, :, :m] - kk[0]).abs().max()
    # and so does the target's: after all the rollbacks, its cache holds the final sequence
    fresh = FastLM(smol.model, 1, 256)
    fresh.forward(seq, torch.tensor([0]))
    for i in range(smol.num_layers):
        for have, want in ((dec.runner.lm.k[i], fresh.k[i]), (dec.runner.lm.v[i], fresh.v[i])):
            torch.testing.assert_close(have[:, :, :m], want[:, :, :m], atol=1e-4, rtol=1e-4)


def _bf16_target(smol, which: str, device: str):
    """A bf16 target: the real SmolLM2, or a random model of Qwen2.5-Coder-1.5B's shape (the first target whose
    greedy speculative decoding parted from plain decoding on a GPU), on `device`."""
    import copy
    import dataclasses

    if which == "smollm2":
        return dataclasses.replace(smol, model=copy.deepcopy(smol.model).to(device, torch.bfloat16))
    from transformers import AutoConfig, AutoModelForCausalLM

    from eyas.target import Target, default_aux_layers

    torch.manual_seed(0)
    conf = AutoConfig.for_model("qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                num_attention_heads=12, num_key_value_heads=2, rms_norm_eps=1e-6,
                                tie_word_embeddings=False, vocab_size=151936, max_position_embeddings=32768)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16).eval()
    return Target(model=model, tokenizer=None, name="random-qwen2.5-1.5b", source="random", sha256="",
                  aux_layers=default_aux_layers(28), eot_token_ids=[0])


@pytest.mark.parametrize("fused", [False, True], ids=["steps", "fused"])
@pytest.mark.parametrize("k", [3, 7])
@pytest.mark.parametrize("which,device", [("smollm2", "cpu"), pytest.param("smollm2", "cuda", marks=pytest.mark.gpu),
                                          pytest.param("qwen2.5-1.5b", "cuda", marks=pytest.mark.gpu)])
def test_speculative_decoding_is_plain_decoding_with_the_verify_shapes_in_bf16(smol, prompt_set, which, device, k,
                                                                               fused):
    """Plain decoding with its steps shaped as the verify (Decoder.plain_like_verify) makes every call with the
    verify's shapes, so greedy speculative decoding gives its tokens bit for bit in bf16 on any machine whose kernels
    round a row alike wherever it sits among the call's rows (on some CPUs a 1,536-wide product rounds a row by the
    rows beside it, so one-token plain decoding parts from it): through accepted drafts (rows past the first) and
    rejections at every position, scripted from that reference."""
    t = _bf16_target(smol, which, device)
    ids = prompt_set[1]
    ref = Decoder(t, None, k=k, max_len=256).generate_like_verify(ids, 40, ()).tokens
    torch.manual_seed(0)
    drafter = build_drafter(t, 2048, draft_vocab(t, [ids + ref]))
    dec = ScriptedDecoder(t, drafter, k=k, max_len=256, reference=ref, prompt_len=len(ids), fused=fused)
    g = dec.generate(ids, 40, (), speculative=True)
    assert g.tokens == ref
    assert set(g.accepted) == set(range(k + 1))  # every row of the verify gave a token


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["smollm2", "qwen2.5-1.5b"])
def test_compiled_greedy_speculative_decoding_is_one_token_plain_decoding_bit_for_bit(smol, prompt_set, which):
    """As the decoder runs on a GPU by default (CUDA graphs, compiled elementwise kernels with the norms settled for
    the verify's rows, FastLM.settle_norms), greedy speculative decoding at K=3 and one-token plain decoding give the
    same tokens and, slot by slot, the same keys and values in every layer: a verify rounds each row as a one-token
    step does (an untrained drafter: mostly the verify's first row carries a round)."""
    t = _bf16_target(smol, which, "cuda")
    ids = prompt_set[1]
    torch.manual_seed(0)
    spec = Decoder(t, build_drafter(t, 2048), k=3, max_len=512, compile=True)
    plain = Decoder(t, None, k=3, max_len=512, compile=True)
    g = spec.generate(ids, 64, (), speculative=True)
    p = plain.generate(ids, 64, (), speculative=False)
    assert spec.runner.lm.compile_elementwise and spec.graphs.enabled and spec.fused
    assert g.tokens == p.tokens
    assert_same_cache(spec, plain, len(ids) + 63)


def test_sampling_decoding_runs_and_is_seeded(tiny):
    torch.manual_seed(0)
    d = build_drafter(tiny, 512)
    ids = prompt_ids(tiny.tokenizer, [{"role": "user", "content": "hi"}])
    outs = []
    for _ in range(2):
        dec = Decoder(tiny, d, k=3, temperature=0.8, top_p=0.9, max_len=128, seed=7)
        g = dec.generate(ids, 20, (), speculative=True)
        assert len(g.tokens) == 20 and all(0 <= t < tiny.vocab_size for t in g.tokens)
        outs.append(g.tokens)
    assert outs[0] == outs[1]
    with pytest.raises(Exception, match="fit"):
        Decoder(tiny, d, k=3, max_len=16).generate(ids, 20)


@pytest.mark.parametrize("fused", [False, True])
def test_generation_times_its_phases(tiny, fused):
    """A generation's prefill, draft and verify seconds are parts of its wall time, for plain and speculative
    decoding; a fused round is all verify."""
    torch.manual_seed(0)
    d = build_drafter(tiny, 512)
    ids = prompt_ids(tiny.tokenizer, [{"role": "user", "content": "Tell me about hawks."}])
    dec = Decoder(tiny, d, k=3, max_len=128, fused=fused)
    for speculative in (False, True):
        g = dec.generate(ids, 12, (), speculative=speculative)
        assert g.prefill_seconds > 0 and g.verify_seconds > 0
        assert g.prefill_seconds + g.draft_seconds + g.verify_seconds <= g.seconds
        assert (g.draft_seconds > 0) == (speculative and not fused)


def _drafter_and_spanning_prompts(target):
    """An untrained drafter and three random prompts whose 40-token generations, in a 600-slot cache, stay in the
    first 256-slot span, cross into the second, and cross into the last (shorter) one."""
    torch.manual_seed(0)
    d = build_drafter(target, 512)
    g = torch.Generator().manual_seed(1)
    return d, [torch.randint(10, target.vocab_size, (n,), generator=g).tolist() for n in (40, 240, 500)]


@pytest.mark.parametrize("fused,padded", [(False, False), (True, False), (True, True)],
                         ids=["steps", "fused_overlap", "fused_overlap_padded_prefill"])
def test_warm_up_runs_every_step_a_generation_makes(tiny, fused, padded, monkeypatch):
    """Decoder.warm_up runs, before anything is timed, every fixed-shape step (name, input shapes, attended cache
    span) that generations reaching any span of the cache make: the generations below, which cross from the
    first span into the second and into the last (shorter) one, make no step it did not make (with padded
    prefills, the prefills among them). The steps it ran leave the output unchanged: plain and speculative tokens
    equal a decoder's that was never warmed up."""
    if fused:
        monkeypatch.setattr(Decoder, "overlap", True)
    monkeypatch.setattr(Decoder, "graph_prefill", padded)
    d, prompts = _drafter_and_spanning_prompts(tiny)
    outs = {}
    for warm in (True, False):
        dec = Decoder(tiny, d, k=3, max_len=600, fused=fused)
        assert dec.engine == "fast" and dec.fused == fused
        seen = []
        real = dec._call

        def recording(name, *args, upto):
            seen.append((name, tuple(tuple(a.shape) for a in args), upto))
            return real(name, *args, upto=upto)

        dec._call = recording
        if warm:
            assert dec.warm_up() == len(seen)
            warmed = set(seen)
            assert {u for *_, u in warmed} == {256, 512, 600}
            seen.clear()
        outs[warm] = [dec.generate(ids, 40, (), speculative=s).tokens for ids in prompts for s in (False, True)]
        if warm:
            assert {u for *_, u in seen} == {256, 512, 600}  # the generations did reach every span
            assert set(seen) <= warmed, set(seen) - warmed
            # padded prefills of 128, 256 and 512 tokens for the prompts of 40, 240 and 500, plain and speculative
            assert sorted(x[:2] for x in seen if x[0].startswith("prefill")) == sorted(
                [(name, ((1, tp), (1,))) for tp in (128, 256, 512) for name in ("prefill", "prefill_spec")]
                if padded else [])
    assert outs[True] == outs[False]


@pytest.mark.parametrize("fused", [False, True], ids=["steps", "fused"])
def test_padded_prefill_gives_the_unpadded_generation(tiny, fused, monkeypatch):
    """Decoder.graph_prefill pads each prompt to a multiple of PREFILL_BUCKET tokens (one CUDA graph per padded
    length on a GPU): the padding's cache slots are overwritten before anything attends to them, so the tokens and
    every round's accepted count equal the unpadded prefill's, for prompts shorter than a bucket, of exactly one,
    and longer than one."""
    torch.manual_seed(0)
    d = build_drafter(tiny, 512)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, tiny.vocab_size, (n,), generator=g).tolist() for n in (5, 128, 129, 300)]
    runs = {}
    for padded in (False, True):
        monkeypatch.setattr(Decoder, "graph_prefill", padded)
        dec = Decoder(tiny, d, k=3, max_len=512, fused=fused)
        assert dec.prefill_padded == padded
        assert [dec._prefill_len(len(p)) for p in prompts] == ([128, 128, 256, 384] if padded else [None] * 4)
        gens = [dec.generate(p, 30, (), speculative=s) for p in prompts for s in (False, True)]
        # the state the first round starts from: the first token, and the drafter's hidden state and logits after it
        states = [dec._prefill(torch.tensor([p]), True) for p in prompts]
        runs[padded] = [(x.tokens, x.accepted) for x in gens], states
    assert runs[True][0] == runs[False][0]
    for (f1, h1, l1), (f0, h0, l0) in zip(runs[True][1], runs[False][1]):
        assert torch.equal(f1, f0) and h1.shape == h0.shape and l1.shape == l0.shape
        assert torch.allclose(h1, h0, atol=1e-5) and torch.allclose(l1, l0, atol=1e-5)


def test_failed_compile_falls_back_to_eager(tiny, monkeypatch, capsys):
    """Decoder.compile_elementwise where torch.compile cannot build kernels (no Triton, no C compiler): each
    compiled function logs its failure once and runs eagerly, and decoding gives the eager decoder's tokens."""
    import eyas.engine.fastlm as fastlm

    torch.manual_seed(0)
    d = build_drafter(tiny, 512)
    ids = prompt_ids(tiny.tokenizer, [{"role": "user", "content": "Tell me about hawks."}])
    monkeypatch.setattr(Decoder, "compile_elementwise", False)
    ref = [Decoder(tiny, d, k=3, max_len=128).generate(ids, 12, (), speculative=s).tokens for s in (False, True)]

    def broken(fn, **kw):
        def run(*a):
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(fastlm, "_COMPILED", {})
    monkeypatch.setattr(fastlm, "_EAGER", set())
    monkeypatch.setattr(Decoder, "compile_elementwise", True)
    dec = Decoder(tiny, d, k=3, max_len=128)
    assert dec.elementwise_compiled and dec.runner.lm.compile_elementwise
    out = [dec.generate(ids, 12, (), speculative=s).tokens for s in (False, True)]
    assert out == ref
    err = capsys.readouterr().err
    assert fastlm._EAGER == {fastlm._rotate, fastlm._add_norm, fastlm._silu_mul}
    for name in ("_rotate", "_add_norm", "_silu_mul"):
        assert err.count(f"compiled {name} failed (RuntimeError: no compiler here)") == 1, err


@pytest.mark.parametrize("fused,layers", [(False, 1), (True, 1), (True, 2)], ids=["steps", "fused", "fused_2layers"])
def test_compiled_drafter_decodes_losslessly(tiny, fused, layers, monkeypatch):
    """Decoder.compile_drafter: the drafter's steps (and the fused round's catch-up) through its compiled
    parts (two, and one between each pair of layers) give the eager drafter's logits, the decoding stays equal to
    plain decoding token for token, and the compiled parts did run (none fell back to eager); the prefill's long
    call stays eager."""
    import eyas.engine.fastlm as fastlm
    from eyas.draft import _between_layers, _post_attention, _pre_attention

    torch.manual_seed(0)
    d = build_drafter(tiny, 512, num_layers=layers)
    ids = prompt_ids(tiny.tokenizer, [{"role": "user", "content": "Tell me about hawks."}])
    plain = Decoder(tiny, d, k=3, max_len=128, fused=fused).generate(ids, 16, (), speculative=False).tokens
    monkeypatch.setattr(fastlm, "_COMPILED", {})
    monkeypatch.setattr(fastlm, "_EAGER", set())
    monkeypatch.setattr(Decoder, "compile_drafter", True)
    dec = Decoder(tiny, d, k=3, max_len=128, fused=fused)
    assert dec.drafter_compiled
    out = dec.generate(ids, 16, (), speculative=True)
    assert out.tokens == plain and len(out.accepted) > 0
    assert _pre_attention in fastlm._COMPILED and _post_attention in fastlm._COMPILED and not fastlm._EAGER
    assert (_between_layers in fastlm._COMPILED) == (layers > 1)
    h = torch.randn(1, 4, 3 * d.config.hidden_size)
    step_ids, pos = torch.randint(0, tiny.vocab_size, (1, 4)), (torch.arange(4) + 5)[None]
    with torch.no_grad():
        got = d(step_ids, h, pos, rope_table=True)
        d.__dict__["_eyas_compiled"] = False
        ref = d(step_ids, h, pos, rope_table=True)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_warm_up_leaves_no_graph_to_capture_on_gpu():
    """On a GPU, after Decoder.warm_up every graph a generation replays is captured and checked: generations that
    cross every span of the cache capture nothing new and run no eager check, and their tokens equal an unwarmed
    decoder's (in fp32 on the tiny model)."""
    from eyas.config import TargetConfig
    from eyas.target import load_target

    t = load_target(TargetConfig(name="tiny", dtype="float32", device="cuda"))
    d, prompts = _drafter_and_spanning_prompts(t)
    outs = {}
    for warm in (True, False):
        dec = Decoder(t, d, k=3, max_len=600, compile=True)
        assert dec.fused and dec.graphs.enabled
        if warm:
            dec.warm_up()
            keys = set(dec.graphs.graphs)
            assert all(e[3] >= dec.graphs.check for e in dec.graphs.graphs.values())
        outs[warm] = [dec.generate(ids, 40, (), speculative=s).tokens for ids in prompts for s in (False, True)]
        assert dec.graphs.enabled
        if warm:
            assert set(dec.graphs.graphs) == keys
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_two_layer_drafter_decodes_losslessly_on_gpu():
    """On a GPU with CUDA graphs and the compiled drafter (the defaults there), a drafter of two decoder layers
    decodes the tiny model's plain greedy tokens (fp32), and every graph stays on."""
    from eyas.config import TargetConfig
    from eyas.target import load_target

    t = load_target(TargetConfig(name="tiny", dtype="float32", device="cuda"))
    _, prompts = _drafter_and_spanning_prompts(t)
    torch.manual_seed(0)
    d = build_drafter(t, 512, num_layers=2)
    dec = Decoder(t, d, k=3, max_len=600, compile=True)
    assert dec.fused and dec.graphs.enabled and dec.drafter_compiled and len(dec.dcaches) == 2
    for ids in prompts:
        plain = dec.generate(ids, 40, (), speculative=False).tokens
        spec = dec.generate(ids, 40, (), speculative=True)
        assert spec.tokens == plain and len(spec.accepted) > 0
    assert dec.graphs.enabled


@pytest.mark.gpu
def test_graphed_prefill_gives_the_eager_prefill_generation_on_gpu(monkeypatch):
    """On a GPU with CUDA graphs, prompts prefilled padded as one graph per padded length (the default) give the
    eager prefill's tokens and accepted counts (fp32, tiny model), and every prefill graph passed its checks."""
    from eyas.config import TargetConfig
    from eyas.target import load_target

    t = load_target(TargetConfig(name="tiny", dtype="float32", device="cuda"))
    d, prompts = _drafter_and_spanning_prompts(t)
    runs = {}
    for pf in (None, False):
        monkeypatch.setattr(Decoder, "graph_prefill", pf)
        dec = Decoder(t, d, k=3, max_len=600, compile=True)
        assert dec.prefill_padded == (pf is None)
        gens = [dec.generate(ids, 40, (), speculative=s) for ids in prompts for s in (False, True)]
        runs[pf] = [(g.tokens, g.accepted) for g in gens]
        assert dec.graphs.enabled
        if pf is None:
            assert sorted(k[0] for k in dec.graphs.graphs if k[0].startswith("prefill")) == sorted(
                f"{name}@{u}" for u in (256, 256, 512) for name in ("prefill", "prefill_spec"))
    assert runs[None] == runs[False]


@pytest.mark.parametrize("engine", ["static", "generate"])
def test_greedy_val_answers_are_the_decoders_text(smol, prompt_set, plain_outputs, engine):
    """The text `greedy_tau` is scored on (eyas.train.greedyval: regen's static decode loop, every prompt in its rows at
    once, or transformers' generate, several prompts a batch, left padded) is the decoder's plain greedy output token
    for token, the turn's end kept as the decoder keeps it."""
    from eyas.train.greedyval import greedy_answers

    got = greedy_answers(smol, prompt_set, NEW, batch_tokens=3 * (max(map(len, prompt_set)) + NEW), engine=engine)
    assert got == plain_outputs


def test_ttt_chain_simulates_the_decoders_acceptance(smol, prompt_set, plain_outputs, trained):
    """The greedy chain the TTT unroll simulates on the target's own greedy text (the validation's forecast
    of τ, `val_tau`) is what the decoder accepts: each round of a K=3 decoding starts at a position whose
    simulated chain length equals the round's accepted count. It ties the unroll's attention pattern, rope
    positions and inputs to the decoder's."""
    from eyas.features import Sample, target_top
    from eyas.train.ttt import pack_samples, target_labels, ttt_unroll

    dec = Decoder(smol, trained, k=3, max_len=256)
    lm_head = smol.model.get_output_embeddings()
    rounds = agree = 0
    for ids, out in zip(prompt_set, plain_outputs):
        g = dec.generate(ids, NEW, smol.eot_token_ids)
        assert g.tokens == out
        seq = torch.tensor(ids + out)
        with torch.no_grad():
            aux, final = smol.capture(seq[None])
            top = target_top(final[0], lm_head)
        batch = pack_samples([Sample(seq, torch.ones(len(seq), dtype=torch.bool), aux[0], final[0], top)])
        labels = target_labels(batch.final, lm_head, trained.draft_ids, top=batch.top)
        with torch.no_grad():
            st = ttt_unroll(trained, batch, labels, 3, chain=True)
        chain = torch.stack(st.hits).sum(0)
        t = len(ids) - 1  # the first round drafts after the prefill's token: from the prompt's last position
        for a in g.accepted:
            if t + 3 + 2 <= len(seq):  # the unroll sees all 3 steps there
                rounds += 1
                agree += int(chain[t]) == a
            t += a + 1
    assert rounds >= 30
    assert agree == rounds, f"{agree} of {rounds} rounds"
    assert 0 < sum(int(h.sum()) for h in st.hits) and int(st.hits[2].sum()) <= int(st.alive[2].sum())


def test_decoder_rounds_count_what_the_decoder_accepts(smol, prompt_set, plain_outputs, trained):
    """`decoder_rounds`, the walk training's greedy_tau takes over the greedy answers packed as the validation packs
    them (several sequences a batch, the prompt outside the loss mask), counts the decoder's own rounds: per draft
    position, the rounds that reach it and those that accept it, the same numbers as a K=3 decoding of each prompt
    (rounds the unroll sees to their end). Averaging the chain over every position gives another figure (1.900
    against the rounds' 1.944 here)."""
    from eyas.features import Sample, target_top
    from eyas.train.ttt import acceptance_length, chain_acceptance, decoder_rounds, pack_samples, target_labels, ttt_unroll

    dec = Decoder(smol, trained, k=3, max_len=256)
    lm_head = smol.model.get_output_embeddings()
    samples, alive, hit = [], [0] * 3, [0] * 3
    for ids, out in zip(prompt_set, plain_outputs):
        g = dec.generate(ids, NEW, smol.eot_token_ids)
        seq = torch.tensor(ids + out)
        t = len(ids) - 1
        for a in g.accepted:
            if t + 3 + 2 <= len(seq):
                for j in range(3):
                    alive[j] += a >= j
                    hit[j] += a > j
            t += a + 1
        with torch.no_grad():
            aux, final = smol.capture(seq[None])
        mask = torch.arange(len(seq)) >= len(ids)
        samples.append(Sample(seq, mask, aux[0], final[0], target_top(final[0], lm_head)))
    batch = pack_samples(samples, pad_to=sum(len(s.input_ids) for s in samples) + 7)
    labels = target_labels(batch.final, lm_head, trained.draft_ids, top=batch.top)
    with torch.no_grad():
        st = ttt_unroll(trained, batch, labels, 3, chain=True)
    r_alive, r_hit = decoder_rounds(batch, st.hits)
    assert (r_alive, r_hit) == (alive, hit) and alive[0] >= 30 and 0 < hit[0] < alive[0]
    every = chain_acceptance([float(m.sum()) for m in st.alive], [float(m.sum()) for m in st.hits])
    assert acceptance_length(every) != acceptance_length(chain_acceptance(r_alive, r_hit))
