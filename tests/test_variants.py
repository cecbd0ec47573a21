"""Drafter variants of the speculators format (eyas.variants): each trains, changes what the drafter computes,
exports to the speculators format and imports back equal; SGLang refuses them clearly; a drafter written the way
speculators 0.9.0 writes its defaults (a Qwen3 layer, its config a to_diff_dict) imports, fine-tunes and decodes."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.decode import Decoder
from eyas.draft import DraftConfig, build_drafter, load_drafter, save_drafter
from eyas.export import export_drafter
from eyas.formats import import_drafter
from eyas.features import Sample
from eyas.train.ttt import pack_samples, target_labels, ttt_unroll
from eyas.util import EyasError

VARIANTS = {
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc": {"norm_before_fc": True},
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
    "qwen3": {"layer_type": "qwen3"},
    "all": {"norm_before_residual": True, "fc_norm": True, "norm_output": True, "layer_type": "qwen3"},
}


def _randomized(d):
    """Norm weights away from 1, so every norm a variant adds or moves changes the output."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if n.endswith("norm.weight") or ".fc_norm." in n or "norm." in n:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return d


def _logits(d, target):
    torch.manual_seed(2)
    ids = torch.randint(0, 1000, (1, 20))
    aux, _ = target.capture(ids)
    with torch.no_grad():
        h, logits = d(ids, aux)
        return logits, d(ids, h)[1]  # a second step from the fed-back state (norm_output changes it)


def _train(d, target, steps=2):
    torch.manual_seed(1)
    samples = []
    for n in (24, 17):
        ids = torch.randint(0, 1000, (1, n))
        aux, final = target.capture(ids)
        samples.append(Sample(ids[0], torch.ones(n, dtype=torch.bool), aux[0], final[0]))
    batch = pack_samples(samples, pad_to=48)
    labels = target_labels(batch.final, target.model.get_output_embeddings(), d.draft_ids)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        st = ttt_unroll(d, batch, labels, 3)
        (sum(st.loss_sum) / max(1, int(sum(st.count)))).backward()
        opt.step()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_trains_exports_imports(tiny, tmp_path, name):
    v = VARIANTS[name]
    torch.manual_seed(0)
    base = _randomized(build_drafter(tiny, 300, torch.arange(300)))
    torch.manual_seed(0)
    d = _randomized(build_drafter(tiny, 300, torch.arange(300), variants=v))
    for k, x in v.items():
        assert getattr(d.config, k) == x
    shared = {k: t for k, t in d.state_dict().items() if k in base.state_dict()}
    assert set(d.state_dict()) - set(shared) == {n for n in d.state_dict() if "norm" in n and n not in shared}
    base.load_state_dict(shared, strict=False)
    assert not torch.allclose(_logits(d, tiny)[1], _logits(base, tiny)[1]), "the variant changes nothing"
    _train(d, tiny)
    want = _logits(d, tiny)
    save_drafter(d, tmp_path / "draft")
    assert all(torch.equal(a, b) for a, b in zip(_logits(load_drafter(tmp_path / "draft", tiny), tiny), want))
    p = export_drafter(d, tmp_path / "vllm", "vllm", "x")
    raw = json.loads((p / "config.json").read_text())
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert raw[flag] is bool(v.get(flag, False)), flag
    lc = raw["transformer_layer_config"]
    assert lc["model_type"] == v.get("layer_type", "llama")
    assert lc["architectures"] == ["Qwen3ForCausalLM" if v.get("layer_type") == "qwen3" else "LlamaForCausalLM"]
    names = set(load_file(str(p / "model.safetensors")))
    if v.get("fc_norm"):
        assert {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= names
    if v.get("norm_before_fc"):
        assert "input_norm.weight" in names
    if v.get("layer_type") == "qwen3":
        assert {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"} <= names
    back = import_drafter(p, target=tiny)
    assert all(getattr(back.config, k) == x for k, x in v.items())
    assert all(torch.equal(a, b) for a, b in zip(_logits(back, tiny), want))
    with pytest.raises(EyasError, match="cannot be served by SGLang.*LlamaForCausalLMEagle3 has no"):
        export_drafter(d, tmp_path / "sglang", "sglang", "x")


def test_variant_settings_refused():
    with pytest.raises(EyasError, match="norm_before_fc and fc_norm"):
        DraftConfig.from_dict(dict(_base_cfg(), norm_before_fc=True, fc_norm=True), "draft/config.json")
    with pytest.raises(EyasError, match="field 'norm_output' must be true or false"):
        DraftConfig.from_dict(dict(_base_cfg(), norm_output="yes"), "draft/config.json")
    with pytest.raises(EyasError, match="field 'layer_type' must be one of llama, qwen3"):
        DraftConfig.from_dict(dict(_base_cfg(), layer_type="mistral"), "draft/config.json")


def _base_cfg():
    return dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                target_hidden_size=64, target_vocab_size=100, draft_vocab_size=50, aux_layers=[1, 2, 3])


FIXTURE = Path(__file__).parent / "fixtures" / "speculators_0.9.0_eagle3_defaults.json"


def speculators_default_folder(tiny, path, ids):
    """A drafter folder as speculators 0.9.0 saves one made with its defaults for the tiny target: config.json is
    the one its Eagle3DraftModel.save_pretrained wrote (Qwen3 layer, every flag false; only the verifier path
    replaced), the weights random under the names it wrote (`layers.0.*` with q_norm/k_norm, the embedding,
    d2t/t2d)."""
    cfg = json.loads(FIXTURE.read_text())
    assert cfg["draft_vocab_size"] == ids.numel() and cfg["eagle_aux_hidden_state_layer_ids"] == tiny.aux_layers
    H, q, kv = tiny.hidden_size, 4 * 16, 2 * 16
    g = torch.Generator().manual_seed(7)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    sd = {"embed_tokens.weight": tiny.embed_tokens().weight.detach().clone(), "fc.weight": r(H, 3 * H),
          "layers.0.hidden_norm.weight": 1 + r(H), "layers.0.input_layernorm.weight": 1 + r(H),
          "layers.0.self_attn.q_proj.weight": r(q, 2 * H), "layers.0.self_attn.k_proj.weight": r(kv, 2 * H),
          "layers.0.self_attn.v_proj.weight": r(kv, 2 * H), "layers.0.self_attn.o_proj.weight": r(H, q),
          "layers.0.self_attn.q_norm.weight": 1 + r(16), "layers.0.self_attn.k_norm.weight": 1 + r(16),
          "layers.0.post_attention_layernorm.weight": 1 + r(H), "layers.0.mlp.gate_proj.weight": r(96, H),
          "layers.0.mlp.up_proj.weight": r(96, H), "layers.0.mlp.down_proj.weight": r(H, 96),
          "norm.weight": 1 + r(H), "lm_head.weight": r(ids.numel(), H),
          "d2t": ids - torch.arange(ids.numel()), "t2d": torch.zeros(tiny.vocab_size, dtype=torch.bool)}
    sd["t2d"][ids] = True
    path.mkdir(parents=True)
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_speculators_defaults_import_finetune_decode(tiny, tmp_path):
    ids = torch.arange(0, 2000, 2)
    src = speculators_default_folder(tiny, tmp_path / "spec", ids)
    d = import_drafter(src, target=tiny)
    c = d.config
    assert c.layer_type == "qwen3" and not (c.norm_before_residual or c.norm_before_fc or c.fc_norm or c.norm_output)
    assert (c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps) == (16, 4, 2, 1e-6)
    assert c.rope_theta == 10000.0 and c.rope_scaling is None  # Qwen3's default, left out of the file
    assert torch.equal(d.draft_ids, ids)
    assert torch.equal(d.midlayer.self_attn.q_norm.weight,
                       load_file(str(src / "model.safetensors"))["layers.0.self_attn.q_norm.weight"])
    # a value equal to the layer class's default may be left out (to_diff_dict): Qwen3's default is read for it
    cfg = json.loads((src / "config.json").read_text())
    del cfg["transformer_layer_config"]["max_position_embeddings"]
    (src / "config.json").write_text(json.dumps(cfg))
    assert import_drafter(src, target=tiny).config.max_position_embeddings == 32768  # Qwen3Config's
    _train(d, tiny)  # fine-tunes
    plain = Decoder(tiny, None, max_len=128)
    dec = Decoder(tiny, d, k=3, max_len=128)
    prompt = tiny.tokenizer("Tell me about the sea.").input_ids
    ref = plain.generate(prompt, 12, tiny.eot_token_ids, speculative=False).tokens
    assert dec.generate(prompt, 12, tiny.eot_token_ids, speculative=True).tokens == ref


def test_train_with_variants(tiny, tmp_path):
    """The train.draft_* settings reach the drafter a run trains (and the one it saves)."""
    from eyas.config import resolve
    from eyas.train.drafter_init import draft_variants, initial_drafter

    cfg = resolve(preset_name="tiny", overrides={"out": str(tmp_path / "run"), "train.draft_norm_output": True,
                                                 "train.draft_fc_norm": True, "train.draft_layer_type": "qwen3"})
    assert draft_variants(cfg) == {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": True,
                                   "norm_output": True, "layer_type": "qwen3"}
    d = initial_drafter(cfg, tiny, torch.arange(300))
    assert d.config.norm_output and d.config.fc_norm and d.config.layer_type == "qwen3"
    assert "fc_norm" in d._modules and "q_norm" in d.midlayer.self_attn._modules
