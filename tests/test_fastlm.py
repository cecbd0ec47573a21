"""FastLM against the HF forward it replaces: a right-padded batched prefill, decode steps at
different positions per row, and rollbacks, on the real SmolLM2 and a random Qwen2 (q/k/v biases);
architectures it does not implement are refused; on a GPU, the CUDA-graph decode step replays the
eager one."""
import pytest
import torch
import torch.nn.functional as F

from eyas.engine.fastlm import FastLM, supported
from eyas.engine.graphs import DecodeGraph
from eyas.target import capture_hidden
from eyas.util import EyasError


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 1e-4 of the reference's scale (SmolLM2's residual stream reaches ~3e4, where fp32 itself
    resolves only ~2e-3)."""
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * max(1.0, want.abs().max().item()), f"max error {err} at scale {want.abs().max().item()}"


class Rows:
    """The token sequences held by the cache rows. Each check compares FastLM's outputs with an HF
    forward over the row's whole sequence; they are compared at the end, one HF forward per longest
    sequence (a causal model gives a prefix the same outputs)."""

    def __init__(self, model, aux, seqs):
        self.model, self.aux, self.seqs = model, aux, [list(s) for s in seqs]
        self.checks = []

    def check(self, lm_out, rows, starts, T=None):
        """lm_out = FastLM's (logits, aux) for ids at rows[i] from position starts[i] (T tokens, or the
        rest of each row's sequence when right-padded)."""
        logits, aux = lm_out
        for i, (r, p) in enumerate(zip(rows, starts)):
            n = T or len(self.seqs[r]) - p
            self.checks.append((tuple(self.seqs[r][:p + n]), p, logits[i, :n], aux[i, :n]))

    def verify(self):
        seqs = {c[0] for c in self.checks}
        longest = [s for s in seqs if not any(len(o) > len(s) and o[:len(s)] == s for o in seqs)]
        ref = {}
        with torch.no_grad():
            for s in longest:
                a, final = capture_hidden(self.model, self.aux, torch.tensor([s]))
                ref[s] = self.model.lm_head(final)[0], a[0]
        for s, p, logits, aux in self.checks:
            want_logits, want_aux = next(ref[o] for o in longest if o[:len(s)] == s)
            close(logits, want_logits[p:len(s)])
            close(aux, want_aux[p:len(s)])


def run_checks(model, aux, vocab: int):
    n_layers = model.config.num_hidden_layers
    aux = aux + [n_layers]  # the pre-norm final state too
    g = torch.Generator().manual_seed(0)
    lens = [7, 12, 3]
    rows = Rows(model, aux, [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens])
    lm = FastLM(model, batch_size=3, max_len=32, aux_layers=aux)

    # right-padded prefill of three rows of different lengths (padding garbage lands past each row's end)
    W = max(lens)
    ids = torch.tensor([s + [0] * (W - len(s)) for s in rows.seqs])
    out = lm.forward(ids, torch.zeros(3, dtype=torch.long), want_aux=True, upto=W)
    rows.check(out, [0, 1, 2], [0, 0, 0])
    last, _ = lm.forward(ids, torch.zeros(3, dtype=torch.long), upto=W, last_idx=torch.tensor(lens) - 1)
    close(last[:, 0], out[0][torch.arange(3), torch.tensor(lens) - 1])

    # decode steps: one token per row, each at its own position (the first overwrites rows 0 and 2's padding)
    for _ in range(3):
        nxt = torch.randint(0, vocab, (3, 1), generator=g)
        pos = torch.tensor([len(s) for s in rows.seqs])
        for r in range(3):
            rows.seqs[r].append(int(nxt[r, 0]))
        out = lm.forward(nxt, pos, want_aux=True)
        rows.check(out, [0, 1, 2], pos.tolist(), T=1)

    # rollbacks: row 1 re-runs from position 5 with other tokens (a slice of rows), row 0 from position 2
    # (an index tensor); their later slots are stale and must stay invisible
    new1 = torch.randint(0, vocab, (1, 3), generator=g)
    rows.seqs[1] = rows.seqs[1][:5] + new1[0].tolist()
    rows.check(lm.forward(new1, torch.tensor([5]), rows=slice(1, 2), want_aux=True, upto=8), [1], [5], T=3)
    new0 = torch.randint(0, vocab, (1, 2), generator=g)
    rows.seqs[0] = rows.seqs[0][:2] + new0[0].tolist()
    rows.check(lm.forward(new0, torch.tensor([2]), rows=torch.tensor([0]), want_aux=True), [0], [2], T=2)

    # and all rows go on decoding from their new lengths
    nxt = torch.randint(0, vocab, (3, 1), generator=g)
    pos = torch.tensor([len(s) for s in rows.seqs])
    for r in range(3):
        rows.seqs[r].append(int(nxt[r, 0]))
    rows.check(lm.forward(nxt, pos, want_aux=True, upto=int(pos.max()) + 1), [0, 1, 2], pos.tolist(), T=1)
    rows.verify()


def test_matches_hf_smollm2(smol):
    assert supported(smol.model) == (True, "")
    run_checks(smol.model, smol.aux_layers, smol.vocab_size)


def test_folded_multi_token_calls_match_hf_smollm2(smol, monkeypatch):
    """Multi-token calls (a verify, a rollback) go through SDPA's enable_gqa by default; with
    FastLM.gqa_steps off they fold the query heads as one-token steps do, and pass the same checks."""
    assert FastLM.gqa_steps
    monkeypatch.setattr(FastLM, "gqa_steps", False)
    run_checks(smol.model, smol.aux_layers, smol.vocab_size)


def test_multi_token_calls_copy_nothing_with_gqa(smol, monkeypatch):
    """A 4-token call with enable_gqa gives the folded call's logits and states, and runs no copy, where the
    folded call copies q and the attention output in every layer (bench/verify_ops.py counts them)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    def run(gqa: bool):
        monkeypatch.setattr(FastLM, "gqa_steps", gqa)
        lm = FastLM(smol.model, 1, 40, aux_layers=smol.aux_layers)
        ids = torch.randint(0, smol.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
        lm.forward(ids, torch.zeros(1, dtype=torch.long))
        with profile(activities=[ProfilerActivity.CPU]) as p:
            out = lm.forward(ids[:, :4], torch.tensor([9]), want_aux=True, upto=16)
        assert lm._use_gqa(4, False) == gqa
        return out, Counter(e.name for e in p.events())["aten::clone"]

    (logits, aux), clones = run(True)
    (logits0, aux0), clones0 = run(False)
    close(logits, logits0)
    close(aux, aux0)
    assert clones == 0 and clones0 >= 2 * smol.num_layers, (clones, clones0)


def test_unfused_norm_matches_hf(smol, monkeypatch):
    """The default runs RMSNorm through torch's fused kernel (HF's rounding steps kept; SmolLM2's norm weights
    are trained, not ones); the model's own norm modules, the other path, pass the same checks."""
    assert FastLM.fused_norm
    monkeypatch.setattr(FastLM, "fused_norm", False)
    run_checks(smol.model, smol.aux_layers, smol.vocab_size)


def test_hf_rounding_norm_matches_hf(smol, monkeypatch):
    """The fused norm with HF's rounding steps (normalize in fp32, round, times the weight), the path before the
    one-kernel norm became the default, passes the same checks."""
    assert FastLM.norm_one_kernel
    monkeypatch.setattr(FastLM, "norm_one_kernel", False)
    run_checks(smol.model, smol.aux_layers, smol.vocab_size)


@pytest.mark.gpu
def test_one_kernel_norm_is_close_to_hf_rounding_on_gpu():
    """In bf16 the one-kernel norm rounds once, after the weight: at most about one bf16 step from HF's order."""
    from eyas.engine.fastlm import llama_rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 576, device="cuda", generator=g).to(torch.bfloat16) * 3
    w = (1 + 0.5 * torch.randn(576, device="cuda", generator=g)).to(torch.bfloat16)
    one = llama_rms_norm(x, w, 1e-5, one_kernel=True)
    hf = llama_rms_norm(x, w, 1e-5)
    ref = w.float() * F.rms_norm(x.float(), (576,), eps=1e-5)  # exact up to fp32
    assert one.dtype == torch.bfloat16
    step = ref.abs().clamp(min=1e-3) * 2 ** -7  # one bf16 step (8 significant bits)
    assert ((one.float() - ref).abs() <= step).all()
    assert ((one.float() - hf.float()).abs() <= 2 * step).all()


@pytest.mark.parametrize("gqa,ew", [(True, False), (False, False), (True, True)], ids=["gqa", "folded", "gqa_compiled"])
def test_matches_hf_qwen2_with_biases(gqa, ew, monkeypatch):
    """FastLM against transformers on a small random Qwen2 (q/k/v biases), with the verify's attention through
    enable_gqa or folded, and with the elementwise work compiled (FastLM.compile_elementwise, on under the decoder
    on a GPU)."""
    monkeypatch.setattr(FastLM, "gqa_steps", gqa)
    monkeypatch.setattr(FastLM, "compile_elementwise", ew)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    conf = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(conf).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    with torch.no_grad():  # random init leaves the biases at zero: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    run_checks(model, [2, 3, 4], 256)
    if ew:  # compiled, not fallen back to the eager functions
        import eyas.engine.fastlm

        assert not eyas.engine.fastlm._EAGER


def test_refuses_what_it_does_not_implement():
    from transformers import AutoModelForCausalLM, Gemma2Config, GPT2Config, LlamaConfig, MistralConfig

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    cases = [
        (Gemma2Config(**small, head_dim=8), "Gemma2ForCausalLM.*not an architecture"),  # soft-capping
        (GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4), "GPT2LMHeadModel.*model_type 'gpt2'"),
        (LlamaConfig(**small, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
         "LlamaForCausalLM: rope type 'dynamic' changes with the sequence length"),
        (LlamaConfig(**small, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                               "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                                               "original_max_position_embeddings": 32}),
         "LlamaForCausalLM: rope type 'longrope' changes with the sequence length"),
    ]
    for conf, msg in cases:
        model = AutoModelForCausalLM.from_config(conf)
        ok, why = supported(model)
        assert not ok
        with pytest.raises(EyasError, match="FastLM cannot run this target: " + msg):
            FastLM(model, 1, 8)
    for conf in (MistralConfig(**small, sliding_window=None), MistralConfig(**small, sliding_window=16)):
        assert supported(AutoModelForCausalLM.from_config(conf)) == (True, "")


def test_bad_rows_are_refused(tiny):
    lm = FastLM(tiny.model, 4, 8)
    with pytest.raises(EyasError, match="2 rows of ids but rows selects 3"):
        lm.forward(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, dtype=torch.long), rows=slice(0, 3))
    with pytest.raises(EyasError, match="contiguous"):
        lm.forward(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, dtype=torch.long), rows=slice(0, 4, 2))


def test_fused_projections_share_the_model_storage():
    """q/k/v and gate/up run as one product each: the model's own modules become views of the fused
    weights (its forward is unchanged and nothing is copied), a second FastLM reuses them, and after the
    model is cast the stale fusion is not used."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    conf = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(conf).eval()
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
    before = sum(p.numel() for p in model.parameters())
    lm = FastLM(model, 2, 16)
    a = model.model.layers[0].self_attn
    W, B = lm.qkv[0]
    assert a.q_proj.weight.data_ptr() == W.data_ptr() and a.v_proj.bias.data_ptr() == B[-a.v_proj.bias.numel():].data_ptr()
    assert lm.gate_up[1][0].data_ptr() == model.model.layers[1].mlp.gate_proj.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, atol=0, rtol=0)
    assert sum(p.numel() for p in model.parameters()) == before
    assert FastLM(model, 2, 16).qkv[0][0] is W  # fused once
    model.double()
    assert FastLM(model, 2, 16).qkv[0][0].dtype == torch.float64


def test_row_groups_attend_to_their_own_bounds(tiny):
    """Rows split into groups, each attending only up to its own bound, give what one group attending to
    the longest row gives; a bound per group needs groups; bad groups are refused."""
    torch.manual_seed(0)
    one, two = FastLM(tiny.model, 4, 48), FastLM(tiny.model, 4, 48)
    two.set_groups([0, 1])  # row 0 long, rows 1-3 short
    lens = torch.tensor([30, 4, 7, 2])
    ids = torch.randint(0, tiny.vocab_size, (4, 30))
    for lm in (one, two):
        lm.forward(ids, torch.zeros(4, dtype=torch.long), upto=30)
    tok, pos = ids.gather(1, (lens - 1)[:, None]), lens.clone()
    for _ in range(3):
        want, _ = one.forward(tok, pos, last_only=True, upto=int(pos.max()) + 1)
        got, _ = two.forward(tok, pos, last_only=True, upto=(int(pos[0]) + 1, int(pos[1:].max()) + 1))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        tok, pos = want[:, -1].argmax(-1)[:, None], pos + 1
    step = DecodeGraph(two, lambda logits: logits.argmax(-1), span=8)  # eager on a CPU; spans per group
    assert step.slots((33, 9)) == (40, 16) and step.slots(None) == (48, 48)
    with pytest.raises(EyasError, match="one bound per row group"):
        one.forward(tok, pos, upto=(40, 16))
    with pytest.raises(EyasError, match="does not start at 0"):
        one.set_groups([1, 3])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on a CPU, as intended
def test_flex_decode_steps_match_sdpa(tiny, monkeypatch):
    """Decode steps through flex attention bounded by each row's own position (flex_decode) give the logits of
    SDPA over the longest row's span: rows ending inside a block, on a block's last slot and on a block's first,
    over a cache whose length is not a whole number of blocks; a slice of rows (eager steps); and the decode graph
    then attends to the whole cache, one shape."""
    monkeypatch.setattr(FastLM, "FLEX_BLOCK", 8)  # many block edges in a short cache
    torch.manual_seed(0)
    sdpa, flex = FastLM(tiny.model, 4, 45), FastLM(tiny.model, 4, 45)
    flex.flex_decode = True
    lens = torch.tensor([3, 7, 8, 30])  # the next positions: inside block 0, block 0's last slot, block 1's first...
    ids = torch.randint(0, tiny.vocab_size, (4, 30))
    for lm in (sdpa, flex):
        lm.forward(ids, torch.zeros(4, dtype=torch.long), upto=30, one_off=True)  # prefills keep SDPA
    tok, pos = ids.gather(1, (lens - 1)[:, None]), lens.clone()
    for _ in range(12):  # ... up to position 41, past the last whole block (40)
        want, _ = sdpa.forward(tok, pos, last_only=True, upto=int(pos.max()) + 1)
        got, _ = flex.forward(tok, pos, last_only=True, upto=int(pos.max()) + 1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        tok, pos = want[:, -1].argmax(-1)[:, None], pos + 1
    want, _ = sdpa.forward(tok[1:3], pos[1:3], rows=slice(1, 3), last_only=True, upto=int(pos.max()) + 1)
    got, _ = flex.forward(tok[1:3], pos[1:3], rows=slice(1, 3), last_only=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    step = DecodeGraph(flex, lambda logits: logits.argmax(-1), span=8)
    assert step.slots(9) == 45 and step.slots(None) == 45


@pytest.mark.gpu
def test_flex_decode_graph_replays_the_sdpa_step():
    """On a GPU, the flex decode step (compiled, in a CUDA graph) picks the tokens SDPA's eager step picks, as rows
    of different lengths cross block edges."""
    from eyas.config import TargetConfig
    from eyas.target import load_target

    t = load_target(TargetConfig(name="tiny", dtype="float32", device="cuda"))
    flex, sdpa = FastLM(t.model, 4, 300), FastLM(t.model, 4, 300)
    flex.flex_decode = True
    step = DecodeGraph(flex, lambda logits: logits.argmax(-1))
    assert step.graph is not None
    lens = torch.tensor([5, 127, 128, 250], device="cuda")
    ids = torch.randint(0, t.vocab_size, (4, 250), device="cuda")
    for lm in (flex, sdpa):
        lm.forward(ids, torch.zeros(4, dtype=torch.long, device="cuda"), one_off=True)
    tok, pos = ids.gather(1, (lens - 1)[:, None]), lens.clone()
    for _ in range(6):
        step.ids.copy_(tok)
        step.pos.copy_(pos)
        want = sdpa.forward(tok, pos, last_only=True)[0][:, -1].argmax(-1)
        assert torch.equal(step(upto=int(pos.max()) + 1), want)
        tok, pos = want[:, None], pos + 1
    assert sorted(step.graphs) == [300]


@pytest.mark.gpu
def test_decode_graph_replays_the_eager_step():
    from eyas.config import TargetConfig
    from eyas.target import load_target

    t = load_target(TargetConfig(name="tiny", dtype="float32", device="cuda"))
    graphed, eager = FastLM(t.model, 4, 64), FastLM(t.model, 4, 64)
    step = DecodeGraph(graphed, lambda logits: logits.argmax(-1), span=8)
    assert step.graph is not None
    ids = torch.randint(0, t.vocab_size, (4, 5), device="cuda")
    for lm in (graphed, eager):
        lm.forward(ids, torch.zeros(4, dtype=torch.long, device="cuda"))
    tok, pos = ids[:, -1:], torch.tensor([5, 5, 5, 5], device="cuda")
    for _ in range(6):
        step.ids.copy_(tok)
        step.pos.copy_(pos)
        want = eager.forward(tok, pos, last_only=True)[0][:, -1].argmax(-1)
        assert torch.equal(step(upto=int(pos.max()) + 1), want)  # a graph per 8-slot span: 8 and 16
        tok, pos = want[:, None], pos + 1
    assert sorted(step.graphs) == [8, 16, 64]
    # with row groups: a graph per pair of spans
    graphed.set_groups([0, 2])
    eager.set_groups([0, 2])
    step = DecodeGraph(graphed, lambda logits: logits.argmax(-1), span=8)
    for _ in range(4):
        step.ids.copy_(tok)
        step.pos.copy_(pos)
        bounds = (int(pos[:2].max()) + 1, 3)  # rows 2-3 attend to 3 slots only: their answer changes
        want = eager.forward(tok, pos, last_only=True, upto=bounds)[0][:, -1].argmax(-1)
        assert torch.equal(step(upto=bounds), want)
        tok, pos = want[:, None], pos + 1
    assert (16, 8) in step.graphs


@pytest.mark.gpu
def test_one_off_prefill_matches_the_default_kernels():
    """A prefill with `one_off` (no cuDNN attention) writes the same cache and logits as the default choice."""
    from eyas.config import TargetConfig
    from eyas.target import load_target

    t = load_target(TargetConfig(name="tiny", dtype="float32", device="cuda"))
    a, b = FastLM(t.model, 3, 64), FastLM(t.model, 3, 64)
    ids = torch.randint(0, t.vocab_size, (3, 37), device="cuda")
    rows, zero = torch.tensor([2, 0, 1], device="cuda"), torch.zeros(3, dtype=torch.long, device="cuda")
    last = torch.tensor([36, 20, 5], device="cuda")
    la, _ = a.forward(ids, zero, rows=rows, upto=37, last_idx=last, one_off=True)
    lb, _ = b.forward(ids, zero, rows=rows, upto=37, last_idx=last)
    torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)
    for i in range(len(a.k)):
        torch.testing.assert_close(a.k[i], b.k[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.v[i], b.v[i], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_capture_without_cudnn_matches_the_default_kernels(monkeypatch):
    """Captures avoid cuDNN's attention on a GPU (eyas.target.CAPTURE_WITHOUT_CUDNN); the states they give
    equal those of the default kernel choice (fp32: within kernel rounding) and an uncaptured forward's."""
    import eyas.target as T
    from eyas.config import TargetConfig
    from eyas.target import load_target

    t = load_target(TargetConfig(name="tiny", dtype="float32", device="cuda"))
    ids = torch.randint(0, t.vocab_size, (3, 45), device="cuda")
    aux, final = t.capture(ids)
    monkeypatch.setattr(T, "CAPTURE_WITHOUT_CUDNN", False)
    aux0, final0 = t.capture(ids)
    torch.testing.assert_close(aux, aux0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, final0, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        hs = t.model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(final, hs[-1], atol=1e-4, rtol=1e-4)  # hs[-1]: the last normed state
    H = t.hidden_size
    for j, layer in enumerate(t.aux_layers):
        torch.testing.assert_close(aux[..., j * H:(j + 1) * H], hs[layer], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_multi_token_calls_copy_nothing_on_gpu(monkeypatch):
    """On a GPU in bf16 with a head size cuDNN's attention takes (64), a 4-token call (a K=3 verify) with
    enable_gqa gives the folded call's logits and launches no copy (not in attention, nor in the cache writes'
    index_put, which copies index tensors whose strides differ); folded, it copies twice per layer."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(conf).eval().to("cuda", torch.bfloat16)
    ids = torch.randint(0, 512, (1, 20), device="cuda")
    step, at = ids[:, :4], torch.tensor([20], device="cuda")

    def run(gqa: bool):
        monkeypatch.setattr(FastLM, "gqa_steps", gqa)
        lm = FastLM(model, 1, 64)
        lm.forward(ids, torch.zeros(1, dtype=torch.long, device="cuda"), upto=32)
        lm.forward(step, at, upto=32)  # warm
        with profile(activities=[ProfilerActivity.CPU]) as p:
            logits, _ = lm.forward(step, at, upto=32)
            torch.cuda.synchronize()
        return logits, Counter(e.name for e in p.events())["aten::clone"]

    logits, clones = run(True)
    logits0, clones0 = run(False)
    torch.testing.assert_close(logits.float(), logits0.float(), atol=3e-2, rtol=3e-2)
    assert clones == 0 and clones0 >= 2 * conf.num_hidden_layers, (clones, clones0)


# ---------------------------------------------------------------------------------------------
# Qwen3 (q/k norm), Qwen3-MoE, sliding windows and scaled ropes, against transformers

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def random_model(model_type: str, **kw):
    """A small random causal LM of `model_type` (seed 0) whose norm weights are random too (their init is ones, which
    would hide a norm applied to the wrong axis or skipped)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**SMALL, **kw})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model


@pytest.mark.parametrize("gqa,ew,fuse", [(True, False, True), (False, False, True), (True, True, True),
                                         (True, False, False)], ids=["gqa", "folded", "gqa_compiled", "unfused"])
def test_matches_hf_qwen3(gqa, ew, fuse, monkeypatch):
    """FastLM on a small random Qwen3 (q_norm/k_norm over each head before rope, a head size other than
    hidden/heads) gives transformers' logits and states for prefills, decode steps and rollbacks: with the verify's
    attention through enable_gqa or folded, the elementwise work compiled (q/k norm and rope one kernel each), and
    q/k/v unfused."""
    import eyas.engine.fastlm

    monkeypatch.setattr(FastLM, "gqa_steps", gqa)
    monkeypatch.setattr(FastLM, "compile_elementwise", ew)
    monkeypatch.setattr(FastLM, "fuse", fuse)
    model = random_model("qwen3", head_dim=24)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is None and attn.q_norm.weight.shape == (24,)
    assert supported(model) == (True, "")
    run_checks(model, [1, 2, 4], 256)
    if ew:  # compiled, not fallen back to the eager functions
        assert eyas.engine.fastlm._norm_rotate in eyas.engine.fastlm._COMPILED and not eyas.engine.fastlm._EAGER


def test_matches_hf_qwen3_moe():
    """Qwen3-MoE: Qwen3's attention, and a sparse MLP block (or, in mlp_only_layers, a plain one) that FastLM runs
    through the model's own module."""
    model = random_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)
    assert type(model.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    assert supported(model) == (True, "")
    run_checks(model, [1, 2, 4], 256)


@pytest.mark.parametrize("model_type,kw", [
    ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=3)),  # layers 3-5 slide
    ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=0)),
    ("mistral", dict(sliding_window=6)),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32)),
], ids=["qwen3_alternating", "qwen2", "mistral", "qwen3_moe"])
def test_sliding_windows_match_hf(model_type, kw):
    """Sliding-window attention as transformers applies it (a query at p sees p - window < s <= p; Qwen2/Qwen3 per
    layer from layer_types, Mistral and Qwen3-MoE in every layer), over rows longer than the window."""
    model = random_model(model_type, **kw)
    windows = FastLM(model, 1, 8).windows
    if model_type == "qwen3":
        assert windows == [None] * 3 + [4] * 3
    else:
        assert set(windows) == {kw["sliding_window"]}
    run_checks(model, [1, 2, 4], 256)


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "linear", "factor": 2.0},
], ids=lambda r: r["rope_type"])
def test_scaled_ropes_match_hf(rope):
    """Llama with llama3, yarn and linear rope: FastLM takes cos/sin from the model's rotary module, whose inv_freq
    they change and whose attention_scaling (yarn's, here not 1) it applies as transformers does."""
    model = random_model("llama", rope_parameters={**rope, "rope_theta": 10000.0})
    rot = model.model.rotary_emb
    assert rot.rope_type == rope["rope_type"]
    assert (rot.attention_scaling != 1.0) == (rope["rope_type"] == "yarn")
    assert supported(model) == (True, "")
    run_checks(model, [1, 2, 4], 256)


class _Scripted:
    """Drafts for a Decoder subclass: the target's own greedy tokens (`reference`), wrong at one position per round
    in turn (round r rejects at r % (K+1); K+1: all accepted), so a generation takes every acceptance length."""

    def _script(self, L: int, device) -> torch.Tensor:
        start = L - self.n
        oracle = list(self.reference[start:start + self.k]) + [0] * self.k
        oracle = oracle[:self.k]
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


def random_target(model, tiny):
    """An eyas Target around a random model, with the tiny preset's tokenizer (whose vocabulary the model shares)."""
    from eyas.target import Target

    return Target(model=model, tokenizer=tiny.tokenizer, name=model.config.model_type, source="", sha256="",
                  aux_layers=[1, 2, 4], eot_token_ids=list(tiny.eot_token_ids))


LLAMA3 = {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16, "rope_theta": 10000.0}}
YARN = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                            "rope_theta": 10000.0}}


@pytest.mark.parametrize("model_type,kw,fused", [("qwen3", {}, False), ("qwen3", {}, True), ("llama", LLAMA3, True),
                                                 ("llama", YARN, True)],
                         ids=["qwen3-steps", "qwen3-fused", "llama3_rope-fused", "yarn_rope-fused"])
def test_greedy_speculative_decoding_is_lossless(tiny, model_type, kw, fused):
    """On the fast engine, plain greedy decoding gives transformers' generate token for token, and speculative
    decoding (drafts accepted up to every length, rolled back at every position) gives plain decoding's tokens."""
    from eyas.decode import Decoder
    from eyas.draft import build_drafter
    from eyas.evaluate import prompt_ids

    model = random_model(model_type, vocab_size=tiny.vocab_size, max_position_embeddings=256, initializer_range=0.2)
    target = random_target(model, tiny)
    ids = prompt_ids(tiny.tokenizer, [{"role": "user", "content": "Tell me about hawks."}])
    plain = Decoder(target, None, k=1, max_len=128)
    assert plain.engine == "fast"
    want = plain.generate(ids, 24, (), speculative=False).tokens
    x = torch.tensor([ids])
    ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False)[0, len(ids):]
    assert want == ref.tolist()

    class Dec(_Scripted, Decoder):
        pass

    torch.manual_seed(0)
    dec = Dec(target, build_drafter(target, 512), k=3, max_len=128, fused=fused)
    dec.reference, dec.n, dec.round = want, len(ids), 0
    out = dec.generate(ids, 24, (), speculative=True)
    assert out.tokens == want
    assert set(out.accepted) == {0, 1, 2, 3}, out.accepted


def test_greedy_validation_on_qwen3_equals_generate(tiny):
    """The trainer's greedy validation (and regen's static engine under it) on a Qwen3 with alternating sliding
    windows, prompts of different lengths in one batch, gives transformers' generate answers token for token."""
    from eyas.train.greedyval import greedy_answers

    model = random_model("qwen3", vocab_size=tiny.vocab_size, max_position_embeddings=256, initializer_range=0.2,
                         use_sliding_window=True, sliding_window=6, max_window_layers=3)
    target = random_target(model, tiny)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, tiny.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 20)]
    static = greedy_answers(target, prompts, 10, 4096, engine="static")
    assert static == greedy_answers(target, prompts, 10, 4096, engine="generate")
    assert all(len(a) == 10 for a in static)


def test_fallback_is_logged_once_with_its_reason(tiny, capsys):
    """A target FastLM does not run (a tiny GPT-NeoX: partial rotary, parallel residual) falls back to transformers
    in regen, the decoder and greedy validation, each saying so once per process with the reason; an explicit hf
    engine is a choice, not a fallback, and says nothing."""
    import eyas.engine.fastlm
    from eyas.config import RegenConfig
    from eyas.engine.generate import GenerateEngine, embedded_engine
    from eyas.decode import Decoder
    from eyas.train.greedyval import greedy_answers

    eyas.engine.fastlm._FALLBACK_LOGGED.clear()
    model = random_model("gpt_neox", vocab_size=tiny.vocab_size, max_position_embeddings=128)
    target = random_target(model, tiny)
    Decoder(target, None, k=1, max_len=64, engine="hf")
    assert "fast engine" not in capsys.readouterr().err
    for _ in range(2):
        assert embedded_engine(target, RegenConfig()) is GenerateEngine
        assert Decoder(target, None, k=1, max_len=64).engine == "hf"
        greedy_answers(target, [[1, 2, 3]], 2, 64)
    err = capsys.readouterr().err
    why = "GPTNeoXForCausalLM (model_type 'gpt_neox') is not an architecture FastLM implements"
    for where in ("regen", "decoder", "greedy validation"):
        lines = [ln for ln in err.splitlines() if ln.startswith(f"{where}: the target runs on transformers")]
        assert len(lines) == 1 and why in lines[0], err


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_qwen3_decodes_in_cuda_graphs_on_gpu(model_type):
    """On a GPU (fp32), a random Qwen3 (and Qwen3-MoE) on the fast engine with CUDA graphs and compiled elementwise
    kernels (the GPU defaults) decodes transformers' greedy tokens, plainly and speculatively (drafts accepted up to
    every length); for Qwen3 every graph of the plain and the speculative decoder stays on and the compiled q/k
    norm + rope ran. The regen decode step's graph replays the eager step."""
    import eyas.engine.fastlm
    from eyas.decode import Decoder
    from eyas.draft import build_drafter
    from eyas.target import Target

    kw = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if model_type == "qwen3_moe" else {}
    model = random_model(model_type, vocab_size=512, max_position_embeddings=512, initializer_range=0.2, **kw).cuda()
    target = Target(model=model, tokenizer=None, name=model_type, source="", sha256="", aux_layers=[1, 2, 4])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (9, 200)]

    class Dec(_Scripted, Decoder):
        pass

    torch.manual_seed(0)
    drafter = build_drafter(target, 256)
    for ids in prompts:
        x = torch.tensor([ids], device="cuda")
        want = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, do_sample=False)[0, len(ids):]
        plain = Decoder(target, None, k=1, max_len=300, compile=True)
        assert plain.engine == "fast" and plain.elementwise_compiled
        assert plain.generate(ids, 40, (), speculative=False).tokens == want.tolist()
        # the scripted drafts are made on the host inside the round, which no graph can hold: its capture fails,
        # and the round runs eagerly, as losslessly
        dec = Dec(target, drafter, k=3, max_len=300, compile=True)
        dec.reference, dec.n, dec.round = want.tolist(), len(ids), 0
        out = dec.generate(ids, 40, (), speculative=True)
        assert out.tokens == want.tolist() and set(out.accepted) == {0, 1, 2, 3}
        spec = Decoder(target, drafter, k=3, max_len=300, compile=True)  # the drafter's own drafts: all graphed
        assert spec.generate(ids, 40, (), speculative=True).tokens == want.tolist()
        if model_type == "qwen3":
            assert plain.graphs.enabled and plain.graphs.replays and spec.graphs.enabled and spec.graphs.replays
    if model_type == "qwen3":
        assert eyas.engine.fastlm._norm_rotate in eyas.engine.fastlm._COMPILED and not eyas.engine.fastlm._EAGER
    graphed, eager = FastLM(model, 2, 64), FastLM(model, 2, 64)
    step = DecodeGraph(graphed, lambda logits: logits.argmax(-1), span=8)
    if model_type == "qwen3":  # (the MoE's expert loop may sync, which no graph can hold: then steps run eagerly)
        assert step.graph is not None
    ids = torch.randint(0, 512, (2, 5), device="cuda")
    for lm in (graphed, eager):
        lm.forward(ids, torch.zeros(2, dtype=torch.long, device="cuda"))
    tok, pos = ids[:, -1:], torch.tensor([5, 5], device="cuda")
    for _ in range(6):
        step.ids.copy_(tok)
        step.pos.copy_(pos)
        want = eager.forward(tok, pos, last_only=True)[0][:, -1].argmax(-1)
        assert torch.equal(step(upto=int(pos.max()) + 1), want)
        tok, pos = want[:, None], pos + 1


def test_bench_decode_builds_a_random_qwen3_target(tiny, tmp_path):
    """bench/bench_decode.py --random-target: Qwen3-0.6B's shape (built on the meta device here: no weights) is one
    FastLM runs; a config.json of any shape gives a random target of the tokenizer's vocabulary that the fast engine
    decodes; engines are given as a list of known names."""
    import importlib.util
    import json
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    from eyas.decode import Decoder

    path = Path(__file__).parents[1] / "bench" / "bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode", path)
    bd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bd)
    model_type, fields = bd.RANDOM_SHAPES["qwen3"]
    with torch.device("meta"):
        shaped = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields,
                                                                       vocab_size=tiny.vocab_size))
    assert shaped.model.layers[0].self_attn.q_proj.out_features == 2048 and supported(shaped) == (True, "")
    conf = tmp_path / "config.json"
    conf.write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96, "head_dim": 32,
                                "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2}))
    target = bd.random_target(str(conf), "tiny", "float32", "cpu")
    assert target.vocab_size == len(tiny.tokenizer) and target.model.config.model_type == "qwen3"
    dec = Decoder(target, None, k=1, max_len=64)
    assert dec.engine == "fast" and len(dec.generate([1, 2, 3], 4, (), speculative=False).tokens) == 4
    for bad in ("fast,fast", "vllm"):
        with pytest.raises(SystemExit):
            bd.main(["--draft", "untrained", "--engine", bad])


def test_compiled_rows_alike_tells_a_row_local_function_from_one_that_reads_other_rows():
    """compiled_rows_alike: a function whose every row depends on that row alone (silu and multiply, compiled) gives
    each row of a call of T rows what a one-row call gives; one whose rows read the others' (a row minus the mean of
    the rows) does not."""
    from eyas.engine import fastlm

    def make(T, g):
        return torch.randn(1, T, 32, generator=g), torch.randn(1, T, 32, generator=g)

    def centred(x, y):
        return x - x.mean(1, keepdim=True) + y

    assert fastlm.compiled_rows_alike(fastlm._silu_mul, make, (1, 4, 8), rows=16)
    assert not fastlm.compiled_rows_alike(centred, make, (4,), rows=16)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_settled_norms_run_compiled_only_where_their_rows_round_alike(model_type, monkeypatch):
    """FastLM.settle_norms: with compile_elementwise and the verify's row count in exact_rows, the norms (each
    residual add with its norm; Qwen3's q/k norm with rope) run compiled where compiled_rows_alike finds each row of
    such a call equal to a one-row call, and eagerly where it does not, for every call; the logits stay the eager
    forward's up to rounding either way."""
    from eyas.engine import fastlm

    model = random_model(model_type, head_dim=24) if model_type == "qwen3" else random_model(model_type)
    norm_fn = fastlm._norm_rotate if model_type == "qwen3" else fastlm._add_norm
    ids = torch.randint(0, 256, (1, 13), generator=torch.Generator().manual_seed(0))
    ref = FastLM(model, 1, 64)
    with torch.no_grad():
        ref.forward(ids[:, :8], torch.tensor([0]), one_off=True)
        want = ref.forward(ids[:, 8:12], torch.tensor([8]))[0]
    real = fastlm.compiled
    for alike in (True, False):
        asked, used = [], []
        monkeypatch.setattr(fastlm, "compiled_rows_alike", lambda fn, make, lengths, rows=256: asked.append(
            (fn, [make(T, torch.Generator().manual_seed(0))[0].shape[1] for T in lengths])) or alike)
        monkeypatch.setattr(fastlm, "compiled", lambda fn: used.append(fn) or real(fn))
        lm = FastLM(model, 1, 64)
        lm.compile_elementwise, lm.exact_rows = True, (4,)
        assert lm.settle_norms() is alike and lm.norms_compiled is alike
        assert (fastlm._add_norm, [4]) in asked and (not alike or (norm_fn, [4]) in asked)  # the first no settles it
        with torch.no_grad():
            lm.forward(ids[:, :8], torch.tensor([0]), one_off=True)
            got = lm.forward(ids[:, 8:12], torch.tensor([8]))[0]
            lm.forward(ids[:, 12:13], torch.tensor([12]))  # a one-row step
        assert (norm_fn in used) is alike
        assert fastlm._silu_mul in used  # the rest of the elementwise work stays compiled
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
