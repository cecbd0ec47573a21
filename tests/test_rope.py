"""The drafter's rope of each kind the engines serve (eyas.rope): equal to transformers' rotary embedding, what the
engines compute from the exported settings, carried through training, save/load, both exports and import, for a
tiny Llama-3.1-style target (llama3 rope) and a tiny DeepSeek-V3-style one (MLA, MoE, yarn); and refused at preflight
where the drafter cannot have it."""
import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from eyas.draft import DraftConfig, Eagle3Drafter, build_drafter, load_drafter, save_drafter
from eyas.export import export_drafter
from eyas.formats import import_drafter
from eyas.rope import check_rope_scaling, target_rope
from eyas.target import Target, default_aux_layers
from eyas.train.ttt import pack_samples, target_labels, ttt_unroll
from eyas.features import Sample
from eyas.util import EyasError

HD, HEADS, MAXPOS, ORIG = 16, 4, 256, 64
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIG},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, "beta_fast": 32,
             "beta_slow": 1},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(HD // 2)],
                 "long_factor": [2.0 + 0.5 * i for i in range(HD // 2)], "original_max_position_embeddings": ORIG},
}


def _llama(kind: str, theta: float = 10000.0):
    kw = dict(hidden_size=HD * HEADS, num_attention_heads=HEADS, head_dim=HD, max_position_embeddings=MAXPOS,
              rope_theta=theta)
    if SCALINGS[kind]:
        kw["rope_scaling"] = dict(SCALINGS[kind])
    return AutoConfig.for_model("llama", **kw)


def _drafter_for(cfg) -> Eagle3Drafter:
    theta, scaling = target_rope(cfg)
    c = DraftConfig(hidden_size=HD * HEADS, intermediate_size=96, num_attention_heads=HEADS, num_key_value_heads=2,
                    head_dim=HD, target_hidden_size=HD * HEADS, target_vocab_size=100, draft_vocab_size=50,
                    aux_layers=[1, 2, 3], rope_theta=theta, max_position_embeddings=MAXPOS, rope_scaling=scaling)
    torch.manual_seed(0)
    return Eagle3Drafter(c)


def _windows(kind: str):
    """Position windows to compare at, past original_max_position_embeddings (64) too. Dynamic: at the length
    the engines' one static table is computed for (max_position_embeddings x factor), where transformers' per-call
    table is the same. Longrope: windows wholly below or above original_max_position_embeddings (transformers picks
    short or long factors for a whole call by its last position; the drafter per position, see eyas.rope)."""
    if kind == "dynamic":
        return [(0, int(MAXPOS * 2.0)), (300, int(MAXPOS * 2.0))]
    if kind == "longrope":
        return [(0, ORIG), (ORIG, MAXPOS), (150, 220)]
    return [(0, 40), (60, 200), (0, MAXPOS)]


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_cos_sin_equal_transformers(kind):
    cfg = _llama(kind, theta=500000.0 if kind == "llama3" else 10000.0)
    d = _drafter_for(cfg)
    assert (d.config.rope_scaling or {}).get("rope_type", "default") == kind
    hf = LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, 1, HD)
    for lo, hi in _windows(kind):
        pos = torch.arange(lo, hi)[None]
        cos, sin = hf(x, pos)
        dcos, dsin = d.rope(pos, torch.float32)
        torch.testing.assert_close(dcos[:, 0], cos, rtol=0, atol=1e-6, msg=f"{kind} cos at {lo}..{hi}")
        torch.testing.assert_close(dsin[:, 0], sin, rtol=0, atol=1e-6, msg=f"{kind} sin at {lo}..{hi}")
    # the fused table (decoding) holds the same cos/sin, and a step through it gives the same logits
    top = _windows(kind)[-1][1]
    pos = torch.arange(top)[None]
    want = d.rope(pos, torch.float32)
    d.fuse(top)
    table = d.__dict__["_rope_table"]
    assert torch.equal(table[0], want[0][0, 0]) and torch.equal(table[1], want[1][0, 0])
    ids, hid = torch.randint(0, 100, (1, 12)), torch.randn(1, 12, 3 * HD * HEADS)
    p = torch.arange(top - 12, top)[None]
    with torch.no_grad():
        fused = d(ids, hid, p, rope_table=True)[1]
        d.unfuse()
        plain = d(ids, hid, p)[1]
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


def test_longrope_per_position():
    """Longrope's cos/sin of a position is the short factors' below original_max_position_embeddings and the long
    ones' from there, whatever other positions share its call."""
    d = _drafter_for(_llama("longrope"))
    both = d.rope(torch.arange(ORIG - 8, ORIG + 8)[None], torch.float32)
    low = d.rope(torch.arange(ORIG - 8, ORIG)[None], torch.float32)
    high = d.rope(torch.arange(ORIG, ORIG + 8)[None], torch.float32)
    assert torch.equal(both[0][..., :8, :], low[0]) and torch.equal(both[0][..., 8:, :], high[0])


def _engine_yarn(rs: dict, theta: float, hd: int, pos: torch.Tensor):
    """cos/sin as SGLang's and vLLM's YaRNScalingRotaryEmbedding (get_rope's "yarn" branch) compute them from a
    draft layer's rope_scaling: they read factor, original_max_position_embeddings, beta_fast, beta_slow (and
    attn_factor, extrapolation_factor), truncate the correction range and scale cos/sin by 0.1 ln(factor) + 1."""
    factor, omp = rs["factor"], rs["original_max_position_embeddings"]
    bf, bs = rs.get("beta_fast", 32), rs.get("beta_slow", 1)
    pos_freqs = theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd)

    def corr(rot):
        return hd * math.log(omp / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(bf)), 0), min(math.ceil(corr(bs)), hd - 1)
    ramp = torch.clamp((torch.arange(hd // 2, dtype=torch.float) - low) / ((high - low) or 0.001), 0, 1)
    mask = 1 - ramp
    inv = (1 / (factor * pos_freqs)) * (1 - mask) + (1 / pos_freqs) * mask
    mscale = (0.1 * math.log(factor) + 1.0) * rs.get("attn_factor", 1.0)
    freqs = pos.float()[:, None] * inv
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos() * mscale, emb.sin() * mscale


def _engine_dynamic(rs: dict, theta: float, hd: int, maxpos: int, pos: torch.Tensor):
    """The engines' DynamicNTKScalingRotaryEmbedding: one table with the base stretched for maxpos x factor."""
    f = rs["factor"]
    base = theta * ((f * (maxpos * f) / maxpos) - (f - 1)) ** (hd / (hd - 2))
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    emb = torch.cat([pos.float()[:, None] * inv] * 2, -1)
    return emb.cos(), emb.sin()


# --------------------------------------------------------------------------- tiny targets of the two families

def _target(tiny, cfg, name):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.requires_grad_(False)
    return Target(model=model, tokenizer=tiny.tokenizer, name=name, source="test", sha256=name * 4,
                  aux_layers=default_aux_layers(cfg.num_hidden_layers))


@pytest.fixture(scope="module")
def llama31(tiny):
    cfg = AutoConfig.for_model(
        "llama", vocab_size=tiny.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}, tie_word_embeddings=False)
    return _target(tiny, cfg, "llama31")


@pytest.fixture(scope="module")
def deepseek(tiny):
    """DeepSeek-V3's shape, tiny: MLA (q/kv low rank, rope on part of each head), MoE with a shared expert after a
    dense first layer, yarn rope with mscale / mscale_all_dim."""
    cfg = AutoConfig.for_model(
        "deepseek_v3", vocab_size=tiny.vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=640,
        rope_scaling={"type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1})
    return _target(tiny, cfg, "dsv3")


def _train_steps(drafter, target, steps: int = 2):
    """A couple of optimizer steps of the TTT unroll on the target's own features (sequences of 40 tokens: past
    the targets' original_max_position_embeddings of 16)."""
    torch.manual_seed(1)
    samples = []
    for n in (40, 28):
        ids = torch.randint(0, 1000, (1, n))
        aux, final = target.capture(ids)
        samples.append(Sample(ids[0], torch.ones(n, dtype=torch.bool), aux[0], final[0]))
    batch = pack_samples(samples, pad_to=72)
    labels = target_labels(batch.final, target.model.get_output_embeddings(), drafter.draft_ids)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        st = ttt_unroll(drafter, batch, labels, 3)
        loss = sum(st.loss_sum) / max(1, int(sum(st.count)))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses)


def _logits(d, target):
    torch.manual_seed(2)
    ids = torch.randint(0, 1000, (1, 30))
    aux, _ = target.capture(ids)
    pos = torch.arange(10, 40)[None]  # past original_max_position_embeddings
    with torch.no_grad():
        return d(ids, aux, pos)[1]


@pytest.mark.parametrize("which", ["llama31", "deepseek"])
def test_target_family_round_trip(request, which, tmp_path):
    target = request.getfixturevalue(which)
    d = build_drafter(target, 200, torch.arange(200))
    c = d.config
    kind = c.rope_scaling["rope_type"]
    assert kind == ("llama3" if which == "llama31" else "yarn")
    if which == "deepseek":  # the drafter's Llama layer: whole heads of v_head_dim, no MLA-only yarn settings
        assert (c.head_dim, c.num_attention_heads, c.num_key_value_heads) == (16, 4, 4)
        assert c.rope_scaling == {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16,
                                  "beta_fast": 32.0, "beta_slow": 1.0}
    _train_steps(d, target)
    want = _logits(d, target)
    save_drafter(d, tmp_path / "draft")
    back = load_drafter(tmp_path / "draft", target=target)
    assert back.config.rope_scaling == c.rope_scaling and torch.equal(_logits(back, target), want)
    for fmt in ("sglang", "vllm"):
        p = export_drafter(d, tmp_path / fmt, fmt, which)
        raw = json.loads((p / "config.json").read_text())
        lc = raw if fmt == "sglang" else raw["transformer_layer_config"]
        assert lc["rope_scaling"] == c.rope_scaling and lc["rope_theta"] == c.rope_theta
        assert "mscale" not in json.dumps(lc)
        imported = import_drafter(p, target=target)
        assert imported.config.rope_scaling == c.rope_scaling
        assert torch.equal(_logits(imported, target), want)
        # transformers (which both engines build their config with) reads the same rope back
        from transformers import LlamaConfig

        rp = LlamaConfig(**{k: v for k, v in lc.items() if k != "torch_dtype"}).rope_parameters
        assert {k: v for k, v in rp.items() if k != "rope_theta"} == c.rope_scaling
    if which == "deepseek":  # what the engines' Llama layer computes from the export is what the drafter trains with
        pos = torch.arange(0, 600)
        ecos, esin = _engine_yarn(c.rope_scaling, c.rope_theta, c.head_dim, pos)
        dcos, dsin = d.rope(pos[None], torch.float32)
        torch.testing.assert_close(dcos[0, 0], ecos, rtol=0, atol=2e-6)
        torch.testing.assert_close(dsin[0, 0], esin, rtol=0, atol=2e-6)


def test_dynamic_is_the_engines_static_table():
    d = _drafter_for(_llama("dynamic"))
    pos = torch.arange(0, 300)
    ecos, esin = _engine_dynamic(d.config.rope_scaling, d.config.rope_theta, HD, MAXPOS, pos)
    dcos, dsin = d.rope(pos[None], torch.float32)
    torch.testing.assert_close(dcos[0, 0], ecos, rtol=0, atol=2e-6)
    torch.testing.assert_close(dsin[0, 0], esin, rtol=0, atol=2e-6)


def test_old_config_without_rope_scaling_loads(tiny, tmp_path):
    """A drafter folder saved before rope_scaling existed (rope_theta only) loads as plain rope."""
    d = build_drafter(tiny, 100, torch.arange(100))
    save_drafter(d, tmp_path / "draft")
    raw = json.loads((tmp_path / "draft" / "config.json").read_text())
    raw.pop("rope_scaling")
    (tmp_path / "draft" / "config.json").write_text(json.dumps(raw))
    back = load_drafter(tmp_path / "draft", target=tiny)
    assert back.config.rope_scaling is None
    pos = torch.arange(50)[None]
    assert torch.equal(back.rope(pos, torch.float32)[0], d.rope(pos, torch.float32)[0])


# --------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("setting, named", [
    ({"rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]}}, "mrope_section"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, "rope_type 'proportional'"),
    ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, "transformers has no rope function"),
])
def test_unsupported_target_rope_refused(setting, named):
    cfg = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4, **{
        k: v for k, v in setting.items() if k != "rope_scaling"})
    if "rope_scaling" in setting:  # set as a loaded config holds it (transformers' own validation aside)
        cfg.rope_parameters = {"rope_theta": 10000.0, **setting["rope_scaling"]}
    with pytest.raises(EyasError, match=named.replace("(", r"\(").replace(")", r"\)")):
        target_rope(cfg, "target 'x'")


@pytest.mark.parametrize("bad, named", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.7},
     "rope_scaling.mscale=0.7"),
    ({"rope_type": "llama3", "factor": 8.0}, "rope_scaling.low_freq_factor is missing"),
    ({"rope_type": "linear", "factor": "2"}, "rope_scaling.factor must be a positive number"),
    ("yarn", "must be an object"),
])
def test_bad_drafter_rope_refused(bad, named):
    with pytest.raises(EyasError, match=named):
        check_rope_scaling(bad, "draft/config.json")


def test_unsupported_rope_refused_at_preflight(tiny, tmp_path):
    """`eyas run` on a target whose rope the drafter cannot have stops before regen, naming the setting."""
    from eyas import config as C
    from eyas.pipeline import preflight

    cfg = AutoConfig.for_model("llama", vocab_size=tiny.vocab_size, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=6, num_attention_heads=4, partial_rotary_factor=0.5)
    model = AutoModelForCausalLM.from_config(cfg)
    folder = tmp_path / "partial"
    model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    run_cfg = C.Config()
    run_cfg.target.name, run_cfg.target.device, run_cfg.out = str(folder), "cpu", str(tmp_path / "run")
    run_cfg.data.source, run_cfg.regen.enabled, run_cfg.eval.prompts = str(data), False, str(data)
    with pytest.raises(EyasError, match="partial_rotary_factor=0.5"):
        preflight(run_cfg, tmp_path / "run", {})


@pytest.mark.parametrize("which", ["llama31", "deepseek"])
def test_scaled_rope_drafter_decodes_losslessly(request, which):
    """eyas' decoder runs a scaled-rope drafter through its fused rope table, past the target's
    original_max_position_embeddings, and reproduces plain greedy decoding."""
    from eyas.decode import Decoder

    target = request.getfixturevalue(which)
    d = build_drafter(target, 300, torch.arange(300))
    prompt = list(range(100, 112))  # 12 + 14 tokens: past original_max_position_embeddings (16)
    ref = Decoder(target, None, max_len=64).generate(prompt, 14, [], speculative=False).tokens
    assert Decoder(target, d, k=3, max_len=64).generate(prompt, 14, [], speculative=True).tokens == ref
