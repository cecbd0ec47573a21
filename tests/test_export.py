"""Export to SGLang / vLLM, import from SGLang / vLLM / original EAGLE, checked against what each
engine's loader reads.

Engine sources the expectations below were taken from (see docs/serving.md):
  SGLang  python/sglang/srt/models/llama_eagle3.py (commit 03d5a77), models/llama.py
          (LlamaModel.forward captures `hidden_states + residual` before layer i for i in
          layers_to_capture; set_eagle3_layers_to_capture adds 1 to configured ids), and
          model_executor/model_runner.py (reads eagle_config["eagle_aux_hidden_state_layer_ids"]).
  vLLM    vllm/model_executor/models/llama_eagle3.py (commit 00bd149),
          vllm/transformers_utils/configs/speculators/{base,algos}.py (speculators -> HF config;
          norm_before_residual defaults to True when absent), v1 eagle3_utils
          get_eagle3_aux_layers_from_config (top-level eagle_aux_hidden_state_layer_ids, as-is).
  speculators v0.7.0.1  src/speculators/models/eagle3/{config,core}.py (layers.0.* names).
"""
import copy
import dataclasses
import json
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas import config as C
from eyas.config import Config
from eyas.draft import Eagle3Drafter, build_drafter, save_drafter
from eyas.aux_layers import engine_aux_ids, eyas_aux_ids
from eyas.draft_config import check_checkpoint
from eyas.export import export_drafter, run_export, verifier_architectures
from eyas.formats import import_drafter
from eyas.serve_target import verifier_name
from eyas.util import EyasError

DRAFT_VOCAB = 2048


def _drafter(target, seed=0):
    torch.manual_seed(seed)
    ids = torch.randperm(target.vocab_size)[:DRAFT_VOCAB].sort().values
    d = build_drafter(target, DRAFT_VOCAB, draft_ids=ids)
    with torch.no_grad():  # every parameter non-trivial, norms included, so a swapped tensor shows
        for name, p in d.named_parameters():
            if name != "embed_tokens.weight":
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return d.eval()


def _logits(d, target, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (2, 11), generator=g)
    aux = torch.randn(2, 11, len(d.config.aux_layers) * target.hidden_size, generator=g)
    with torch.no_grad():
        h, logits = d(ids, aux)
        _, logits2 = d(ids, h)  # the fed-back step too
    return torch.cat([logits, logits2])


@pytest.fixture(scope="module")
def drafter(tiny):
    return _drafter(tiny)


# --------------------------------------------------------------------------- round trip

@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_round_trip_identical_logits(tiny, drafter, tmp_path, fmt):
    p = export_drafter(drafter, tmp_path / fmt, fmt, "HuggingFaceTB/SmolLM2-135M-Instruct")
    back = import_drafter(p, target=tiny)
    assert torch.equal(_logits(back, tiny), _logits(drafter, tiny))
    assert torch.equal(back.d2t, drafter.d2t) and torch.equal(back.t2d, drafter.t2d)
    assert back.config.aux_layers == drafter.config.aux_layers
    # without a target, the drafter is rebuilt from the folder alone (embedding exported on request)
    p2 = export_drafter(drafter, tmp_path / (fmt + "-emb"), fmt, "x", include_embeddings=True)
    alone = import_drafter(p2)
    assert torch.equal(_logits(alone, tiny), _logits(drafter, tiny))


def test_import_original_eagle_layout(tiny, drafter, tmp_path):
    """Original EAGLE-3 release: HF-Llama config + draft_vocab_size, pytorch_model.bin with midlayer.*,
    no aux-layer ids (EAGLE captures [2, N//2, N-3], the target's default)."""
    c = drafter.config
    d = tmp_path / "eagle"
    d.mkdir()
    torch.save(drafter.trainable_state_dict(), d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "hidden_act": "silu",
        "vocab_size": c.target_vocab_size, "draft_vocab_size": c.draft_vocab_size,
        "max_position_embeddings": 2048, "tie_word_embeddings": False}))
    back = import_drafter(d, target=tiny)
    assert back.config.aux_layers == tiny.aux_layers
    assert torch.equal(_logits(back, tiny), _logits(drafter, tiny))
    with pytest.raises(EyasError, match="aux-layer ids are not recorded"):
        import_drafter(d)  # no target: the layers cannot be known


def test_import_eyas_folder(tiny, drafter, tmp_path):
    save_drafter(drafter, tmp_path / "draft")
    back = import_drafter(tmp_path / "draft", target=tiny)
    assert torch.equal(_logits(back, tiny), _logits(drafter, tiny))


# --------------------------------------------------------------------------- conformance

def _expected_sglang(cfg):
    """Tensor -> (shape, dtype) as SGLang's LlamaForCausalLMEagle3 builds its parameters from config.json:
    fc: Linear(target_hidden_size*3 -> hidden); midlayer = Llama decoder layer whose qkv_proj takes
    2*hidden; lm_head ParallelLMHead(draft_vocab_size, hidden); d2t -> hot_token_id; t2d skipped."""
    H, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, I = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
    f = torch.float32
    return {
        "fc.weight": ((H, cfg["target_hidden_size"] * 3), f),
        "midlayer.input_layernorm.weight": ((H,), f), "midlayer.hidden_norm.weight": ((H,), f),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * H), f), "midlayer.self_attn.k_proj.weight": ((kv, 2 * H), f),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * H), f), "midlayer.self_attn.o_proj.weight": ((H, q), f),
        "midlayer.post_attention_layernorm.weight": ((H,), f),
        "midlayer.mlp.gate_proj.weight": ((I, H), f), "midlayer.mlp.up_proj.weight": ((I, H), f),
        "midlayer.mlp.down_proj.weight": ((H, I), f),
        "norm.weight": ((H,), f), "lm_head.weight": ((cfg["draft_vocab_size"], H), f),
        "d2t": ((cfg["draft_vocab_size"],), torch.int64), "t2d": ((cfg["vocab_size"],), torch.bool),
    }


def test_sglang_conformance(tiny, drafter, tmp_path):
    p = export_drafter(drafter, tmp_path / "sg", "sglang", "HuggingFaceTB/SmolLM2-135M-Instruct")
    cfg = json.loads((p / "config.json").read_text())
    # fields SGLang's loader and model runner read
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]  # EntryClass of llama_eagle3.py
    assert cfg["num_hidden_layers"] == 1  # >1 would build extra BasicDecoderLayers
    assert cfg["tie_word_embeddings"] is False  # True would make lm_head the (full-vocab) embedding
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB  # None would load the target's lm_head instead
    assert cfg["vocab_size"] == tiny.vocab_size and cfg["target_hidden_size"] == tiny.hidden_size
    assert cfg["hidden_size"] == tiny.hidden_size and cfg["head_dim"] == drafter.config.head_dim
    assert cfg["hidden_act"] == "silu" and cfg["attention_bias"] is False and cfg["rope_scaling"] is None
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [a - 1 for a in tiny.aux_layers]
    assert "eagle_aux_hidden_state_layer_ids" not in cfg  # vLLM would read a top-level list without the +1
    sd = load_file(str(p / "model.safetensors"))
    exp = _expected_sglang(cfg)
    assert set(sd) == set(exp), "exactly the tensors SGLang loads, no embedding unless asked"
    for k, (shape, dtype) in exp.items():
        assert tuple(sd[k].shape) == shape, k
        assert sd[k].dtype == dtype, k
    # transformers reads it as a Llama config with these values (SGLang builds its model from that)
    from transformers import LlamaConfig
    lc = LlamaConfig.from_pretrained(str(p))
    assert lc.hidden_size == tiny.hidden_size and lc.num_hidden_layers == 1
    assert lc.draft_vocab_size == DRAFT_VOCAB
    theta = (getattr(lc, "rope_parameters", None) or {}).get("rope_theta", getattr(lc, "rope_theta", None))
    assert theta == drafter.config.rope_theta


def _vllm_pretrained_config(config_dict):
    """What vLLM's speculators adapter turns the file into (SpeculatorsConfig.
    extract_transformers_pre_trained_config + update_eagle3, read from vLLM's source)."""
    assert config_dict["speculators_model_type"] == "eagle3"
    pre = dict(config_dict["transformer_layer_config"])
    pre["draft_vocab_size"] = config_dict.get("draft_vocab_size")
    if config_dict.get("target_hidden_size") is not None:
        pre["target_hidden_size"] = config_dict["target_hidden_size"]
    pre["norm_before_residual"] = config_dict.get("norm_before_residual", True)
    pre["architectures"] = ["Eagle3LlamaForCausalLM"]
    if config_dict.get("eagle_aux_hidden_state_layer_ids"):
        pre["eagle_aux_hidden_state_layer_ids"] = config_dict["eagle_aux_hidden_state_layer_ids"]
    spec = config_dict["speculators_config"]  # validate_speculators_config
    _ = spec["proposal_methods"][0]["speculative_tokens"], spec["verifier"]["name_or_path"]
    return pre


def test_vllm_conformance(tiny, drafter, tmp_path):
    p = export_drafter(drafter, tmp_path / "vl", "vllm", "HuggingFaceTB/SmolLM2-135M-Instruct",
                       num_speculative_tokens=4)
    raw = json.loads((p / "config.json").read_text())
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert raw[key] is False, f"{key} written explicitly"
    assert raw["speculators_config"]["proposal_methods"][0] == {
        "proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1, "accept_tolerance": 0.0}
    assert raw["speculators_config"]["default_proposal_method"] == "greedy"
    assert raw["speculators_config"]["algorithm"] == "eagle3"
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    cfg = _vllm_pretrained_config(raw)
    assert cfg["norm_before_residual"] is False  # eyas: residual is the un-normed hidden state
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(tiny.aux_layers)
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["vocab_size"] == tiny.vocab_size
    assert cfg["target_hidden_size"] == tiny.hidden_size and cfg["num_hidden_layers"] == 1
    assert cfg["model_type"] == "llama" and cfg["hidden_act"] == "silu" and cfg["attention_bias"] is False
    sd = load_file(str(p / "model.safetensors"))
    # vLLM: lm_head stays top level, everything else gets "model.", midlayer./layers.0. -> layers.0.,
    # d2t -> draft_id_to_target_id (int64), t2d ignored; speculators writes layers.0.*
    exp = {k.replace("midlayer.", "layers.0."): v for k, v in _expected_sglang(cfg | {
        "head_dim": cfg["head_dim"], "vocab_size": cfg["vocab_size"]}).items()}
    assert set(sd) == set(exp)
    for k, (shape, dtype) in exp.items():
        assert tuple(sd[k].shape) == shape, k
        assert sd[k].dtype == dtype, k
    from transformers import LlamaConfig
    lc = LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    assert lc.head_dim == drafter.config.head_dim and lc.num_key_value_heads == drafter.config.num_key_value_heads


# --------------------------------------------------------------------------- aux-layer ids

def _sglang_captured(cfg):
    """SGLang: model_runner reads eagle_config ids; set_eagle3_layers_to_capture adds 1; LlamaModel
    records the stream entering layer i for i in layers_to_capture."""
    return [v + 1 for v in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]


def _vllm_captured(cfg):
    """vLLM: get_eagle3_aux_layers_from_config passes the ids as-is; LlamaModel records
    hidden_states + residual before layer idx for idx in aux_hidden_state_layers."""
    return list(_vllm_pretrained_config(cfg)["eagle_aux_hidden_state_layer_ids"])


@pytest.mark.parametrize("aux", [[2, 4, 5], [1, 3, 7]])
@pytest.mark.parametrize("fmt,captured", [("sglang", _sglang_captured), ("vllm", _vllm_captured)])
def test_engine_captures_the_trained_layers(tiny, tmp_path, aux, fmt, captured):
    target = dataclasses.replace(tiny, aux_layers=aux)
    d = _drafter(target)
    p = export_drafter(d, tmp_path / fmt, fmt, "x")
    layers = captured(json.loads((p / "config.json").read_text()))
    ids = torch.randint(0, tiny.vocab_size, (1, 7))
    with torch.no_grad():
        hs = tiny.model(ids, output_hidden_states=True).hidden_states  # hs[i] = stream entering layer i
    engine_aux = torch.cat([hs[i] for i in layers], dim=-1)
    eyas_aux, _ = target.capture(ids)
    assert torch.allclose(engine_aux, eyas_aux, atol=1e-6)
    assert import_drafter(p, target=target).config.aux_layers == aux


@pytest.mark.parametrize("fmt", ["eyas", "sglang", "vllm"])
def test_eval_captures_the_layers_the_drafter_was_trained_on(tiny, tmp_path, fmt):
    """A drafter trained on other aux layers than the target's default: the eval (and bench_decode) reads them from
    the folder and captures those, unless the user named the target's layers, when loading refuses the drafter."""
    from eyas.evaluate import drafter_aux_layers, load_eval_drafter, recorded_aux_layers

    trained = dataclasses.replace(tiny, aux_layers=[1, 3, 7])
    d = _drafter(trained)
    p = tmp_path / fmt
    if fmt == "eyas":
        save_drafter(d, p)
    else:
        export_drafter(d, p, fmt, "x")
    assert recorded_aux_layers(p) == [1, 3, 7]
    named = dataclasses.replace(tiny, aux_layers=drafter_aux_layers(tiny, p, explicit=True))
    assert named.aux_layers == tiny.aux_layers != [1, 3, 7]
    with pytest.raises(EyasError, match=r"aux layers \[1, 3, 7\] != the target's"):
        load_eval_drafter(p, named)
    target = dataclasses.replace(tiny, aux_layers=drafter_aux_layers(tiny, p))
    assert target.aux_layers == [1, 3, 7] and load_eval_drafter(p, target).config.aux_layers == [1, 3, 7]
    assert tiny.aux_layers != [1, 3, 7]  # the target the eval was given is left as it was
    ids = torch.randint(0, tiny.vocab_size, (1, 7))
    with torch.no_grad():
        hs = tiny.model(ids, output_hidden_states=True).hidden_states
    assert torch.allclose(target.capture(ids)[0], torch.cat([hs[i] for i in (1, 3, 7)], dim=-1), atol=1e-6)
    # a folder that records no ids (original EAGLE) keeps the target's default, as the engines do
    raw = json.loads((p / "config.json").read_text())
    raw.pop("aux_layers", None), raw.pop("eagle_aux_hidden_state_layer_ids", None), raw.pop("eagle_config", None)
    (p / "config.json").write_text(json.dumps(raw))
    assert recorded_aux_layers(p) is None


def test_aux_id_translation_and_limits():
    assert engine_aux_ids([2, 15, 27], "sglang", 30) == [1, 14, 26]
    assert engine_aux_ids([2, 15, 27], "vllm", 30) == [2, 15, 27]
    for f in ("sglang", "vllm"):
        assert eyas_aux_ids(engine_aux_ids([3, 9, 20], f, 30), f) == [3, 9, 20]
    with pytest.raises(EyasError, match="aux layer 30 cannot be served"):
        engine_aux_ids([2, 15, 30], "vllm", 30)  # the final pre-norm state: not reachable in the engines
    with pytest.raises(EyasError, match="not one of"):
        engine_aux_ids([2, 3, 4], "tensorrt", 30)


# --------------------------------------------------------------------------- refusals

def test_export_refuses_misshapen_or_missing_tensor(tiny, tmp_path):
    d = _drafter(tiny)
    d.midlayer.hidden_norm.weight = torch.nn.Parameter(torch.ones(tiny.hidden_size + 1))
    with pytest.raises(EyasError, match=r"'midlayer.hidden_norm.weight' has shape \[65\], expected \[64\]"):
        export_drafter(d, tmp_path / "x", "sglang", "x")
    assert not (tmp_path / "x" / "config.json").exists()
    # a saved eyas checkpoint with a tensor missing is refused before anything is built
    run = tmp_path / "run"
    save_drafter(_drafter(tiny), run / "draft")
    sd = load_file(str(run / "draft" / "model.safetensors"))
    del sd["midlayer.mlp.up_proj.weight"]
    sd["lm_head.weight"] = sd["lm_head.weight"][:-1]
    save_file(sd, str(run / "draft" / "model.safetensors"))
    with pytest.raises(EyasError, match=r"'lm_head.weight' has shape \[2047, 64\].*|'midlayer.mlp.up_proj.weight' is missing"):
        check_checkpoint(run / "draft")
    cfg = Config()
    cfg.out, cfg.target.name = str(run), "tiny"
    with pytest.raises(EyasError, match="'midlayer.mlp.up_proj.weight' is missing"):
        run_export(cfg)


def test_run_export_writes_both_formats(tiny, drafter, tmp_path, capsys):
    save_drafter(drafter, tmp_path / "draft")
    cfg = Config()
    cfg.out, cfg.target.name = str(tmp_path), "tiny"
    res = run_export(cfg)
    assert set(res["export"]) == {"sglang", "vllm"}
    for f in ("sglang", "vllm"):
        raw = json.loads((tmp_path / "export" / f / "config.json").read_text())
        assert raw["eyas"]["aux_layers"] == drafter.config.aux_layers
        back = import_drafter(tmp_path / "export" / f, target=tiny)
        assert torch.equal(_logits(back, tiny), _logits(drafter, tiny))
    raw = json.loads((tmp_path / "export" / "vllm" / "config.json").read_text())
    # the verifier is the target eyas trained with, written as a transformers folder (tests/test_serve_target.py)
    assert raw["speculators_config"]["verifier"]["name_or_path"] == str((tmp_path / "export" / "target").resolve())
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == cfg.eval.k
    assert raw["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    # an export of one format says that the other one's folder, not rewritten, may hold an earlier drafter
    cfg.export.formats = ["vllm"]
    run_export(cfg)
    assert f"{tmp_path / 'export' / 'sglang'} is an earlier export, not written this time (not in export.formats)" \
        in capsys.readouterr().err
    # a preset's verifier is its hub id; the verifier's architecture follows the target: the Qwen preset and an HF
    # folder's config.json
    assert verifier_name(C.TargetConfig(name="smollm2")) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert verifier_architectures(C.TargetConfig(name="qwen-coder-0.5b")) == ["Qwen2ForCausalLM"]
    folder = tmp_path / "hf-target"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    assert verifier_architectures(C.TargetConfig(name=str(folder))) == ["MistralForCausalLM"]
    assert verifier_architectures(C.TargetConfig(name=str(tmp_path / "model.gguf"))) is None


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_import_refuses_a_drafter_that_does_not_fit(tiny, drafter, tmp_path, fmt):
    p = export_drafter(drafter, tmp_path / fmt, fmt, "x")
    wider = types.SimpleNamespace(name="wide", hidden_size=128, vocab_size=tiny.vocab_size,
                                  aux_layers=tiny.aux_layers, num_layers=8)
    with pytest.raises(EyasError, match="hidden size 64 != target's 128"):
        import_drafter(p, target=wider)
    other_vocab = types.SimpleNamespace(name="v", hidden_size=64, vocab_size=50000, aux_layers=tiny.aux_layers)
    with pytest.raises(EyasError, match="vocabulary 49152 != target's 50000"):
        import_drafter(p, target=other_vocab)
    four = types.SimpleNamespace(name="f", hidden_size=64, vocab_size=tiny.vocab_size, aux_layers=[1, 2, 3, 4])
    with pytest.raises(EyasError, match="3 aux layers != the target's 4"):
        import_drafter(p, target=four)


def test_import_reads_specforge_yarn_settings(tiny, drafter, tmp_path, capsys):
    """SpecForge 0.2.0 cannot build a yarn draft layer without mscale and mscale_all_dim (it scales cos/sin by
    their ratio), so every SGLang folder it writes for yarn carries them, under rope_scaling and transformers 5's
    rope_parameters. With 1 and 0 that ratio is SGLang's 0.1 ln(factor) + 1: such a drafter imports, as the eyas
    drafter SGLang serves. Other values trained another scale than the engines serve, and are refused."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
            "beta_slow": 1.0}
    c = dataclasses.replace(drafter.config, rope_scaling=yarn, max_position_embeddings=256)
    d = Eagle3Drafter(c, tiny.embed_tokens().weight.detach().float())
    d.load_state_dict(drafter.state_dict())
    p = export_drafter(d.eval(), tmp_path / "sf", "sglang", "x")
    raw = json.loads((p / "config.json").read_text())
    raw["rope_scaling"] = {**yarn, "mscale": 1.0, "mscale_all_dim": 0.0}  # as SpecForge's export writes it
    raw["rope_parameters"] = {**raw["rope_scaling"], "rope_theta": raw["rope_theta"]}
    (p / "config.json").write_text(json.dumps(raw))
    back = import_drafter(p, target=tiny)
    assert back.config.rope_scaling == yarn
    assert torch.equal(_logits(back, tiny), _logits(d, tiny))
    for ms, ms_all in ((0.707, 0.707), (1.0, 1.0), (0.7, None)):  # DeepSeek's pair: scale 1 where SGLang scales
        raw["rope_scaling"] = {**yarn, "mscale": ms, **({} if ms_all is None else {"mscale_all_dim": ms_all})}
        (p / "config.json").write_text(json.dumps(raw))
        with pytest.raises(EyasError, match=rf"rope_scaling.mscale={ms} is a yarn rope setting the eyas drafter does "
                                            rf"not run: .* scale cos/sin by .* SGLang and vLLM serve 1.1386"):
            import_drafter(p, target=tiny)


def test_import_refuses_what_eyas_cannot_run(tiny, drafter, tmp_path):
    p = export_drafter(drafter, tmp_path / "vl", "vllm", "x")
    raw = json.loads((p / "config.json").read_text())
    bad = copy.deepcopy(raw)
    bad["transformer_layer_config"]["model_type"] = "gemma2"
    (p / "config.json").write_text(json.dumps(bad))
    with pytest.raises(EyasError, match="model_type 'gemma2' is a decoder layer eyas does not build"):
        import_drafter(p, target=tiny)
    bad = copy.deepcopy(raw)
    bad["transformer_layer_config"]["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "mscale": 0.7,
                                                       "original_max_position_embeddings": 64}
    (p / "config.json").write_text(json.dumps(bad))
    with pytest.raises(EyasError, match=r"transformer_layer_config.rope_scaling.mscale=0.7"):
        import_drafter(p, target=tiny)
    sg = export_drafter(drafter, tmp_path / "sg", "sglang", "x")  # SGLang's layout has no such flag
    bad = json.loads((sg / "config.json").read_text())
    bad["norm_before_residual"] = True
    (sg / "config.json").write_text(json.dumps(bad))
    with pytest.raises(EyasError, match="norm_before_residual=true outside the speculators format"):
        import_drafter(sg, target=tiny)
    sd = load_file(str(p / "model.safetensors"))
    sd["layers.0.self_attn.q_proj.weight"] = sd["layers.0.self_attn.q_proj.weight"][:, :64].contiguous()
    save_file(sd, str(p / "model.safetensors"))
    (p / "config.json").write_text(json.dumps(raw))
    with pytest.raises(EyasError, match=r"'midlayer.self_attn.q_proj.weight' has shape \[64, 64\], expected \[64, 128\]"):
        import_drafter(p, target=tiny)
    with pytest.raises(EyasError, match="not a drafter folder"):
        import_drafter(tmp_path / "nowhere")


# --------------------------------------------------------------------------- multi-layer drafters

def _vllm_eagle3_forward(sd, c, embeds, aux, pos):
    """What vLLM's Eagle3 Llama model (llama_eagle3.py, commit 00bd149) computes from the exported tensors, written
    from its structure and not from eyas' modules: layer 0 reads concat(input_layernorm(embeds), hidden_norm(h))
    with h as the residual; each later layer is a Llama layer whose norms add the residual first (fused add-norm);
    the final norm gives the logits' input and the pre-norm sum that is fed back."""
    eps, hd = c.rms_norm_eps, c.head_dim

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x):  # x [B, heads, T, hd]
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        ang = pos.float()[:, None, :, None] * inv
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-b, a], -1) * sin

    B, T, _ = embeds.shape
    h = aux @ sd["fc.weight"].T
    residual, x = None, None
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        if i == 0:
            residual = h
            x = torch.cat([rms(embeds, sd[p + "input_layernorm.weight"]), rms(h, sd[p + "hidden_norm.weight"])], -1)
        else:
            residual = x + residual
            x = rms(residual, sd[p + "input_layernorm.weight"])
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(B, T, -1, hd).transpose(1, 2)
        k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(B, T, -1, hd).transpose(1, 2)
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(B, T, -1, hd).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = (rope(q) @ rope(k).transpose(-1, -2)) / hd ** 0.5
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, -1) @ sd[p + "self_attn.o_proj.weight"].T
        residual = o + residual
        y = rms(residual, sd[p + "post_attention_layernorm.weight"])
        x = (torch.nn.functional.silu(y @ sd[p + "mlp.gate_proj.weight"].T) * (y @ sd[p + "mlp.up_proj.weight"].T)) \
            @ sd[p + "mlp.down_proj.weight"].T
    prenorm = x + residual
    return prenorm, rms(prenorm, sd["norm.weight"]) @ sd["lm_head.weight"].T


def test_two_layer_drafter_exports_what_vllm_runs(tiny, tmp_path):
    """A drafter of two decoder layers (train.draft_layers=2): the vLLM export names the second layer layers.1.*
    with q/k/v over H (no hidden_norm), writes num_hidden_layers 2, computes what vLLM's Eagle3 model computes from
    those tensors (fed-back state and logits), and imports back to the same logits; SGLang, whose later draft
    layers are another network, is refused by name, and the run's export skips it."""
    torch.manual_seed(0)
    ids = torch.randperm(tiny.vocab_size)[:DRAFT_VOCAB].sort().values
    d = build_drafter(tiny, DRAFT_VOCAB, draft_ids=ids, num_layers=2)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name != "embed_tokens.weight":
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    d.eval()
    p = export_drafter(d, tmp_path / "vl", "vllm", "x")
    raw = json.loads((p / "config.json").read_text())
    assert raw["transformer_layer_config"]["num_hidden_layers"] == 2
    sd = load_file(str(p / "model.safetensors"))
    H = tiny.hidden_size
    assert tuple(sd["layers.0.self_attn.q_proj.weight"].shape)[1] == 2 * H
    assert tuple(sd["layers.1.self_attn.q_proj.weight"].shape)[1] == H
    assert "layers.1.hidden_norm.weight" not in sd and "layers.1.input_layernorm.weight" in sd
    assert not any(k.startswith("midlayer.") for k in sd)
    g = torch.Generator().manual_seed(2)
    tok = torch.randint(0, tiny.vocab_size, (2, 9), generator=g)
    aux = torch.randn(2, 9, 3 * H, generator=g)
    pos = torch.arange(9)[None].expand(2, -1) + 4
    with torch.no_grad():
        h, logits = d(tok, aux, pos)
        ref_h, ref_logits = _vllm_eagle3_forward(sd, d.config, d.embed_tokens(tok), aux, pos)
    torch.testing.assert_close(h, ref_h, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    back = import_drafter(p, target=tiny)
    assert back.config.num_hidden_layers == 2
    assert torch.equal(_logits(back, tiny), _logits(d, tiny))
    with pytest.raises(EyasError, match="2 decoder layers cannot be served by SGLang"):
        export_drafter(d, tmp_path / "sg", "sglang", "x")
    run = tmp_path / "run"
    save_drafter(d, run / "draft")
    cfg = Config()
    cfg.out, cfg.target.name = str(run), "tiny"
    assert set(run_export(cfg)["export"]) == {"vllm"} and not (run / "export" / "sglang").exists()
    # an SGLang-layout folder with later layers is refused: SGLang runs them as another network
    sg = tmp_path / "sg1"
    export_drafter(_drafter(tiny), sg, "sglang", "x")
    raw = json.loads((sg / "config.json").read_text())
    (sg / "config.json").write_text(json.dumps(raw | {"num_hidden_layers": 2}))
    with pytest.raises(EyasError, match="2 decoder layers in SGLang's layout"):
        import_drafter(sg, target=tiny)


# --------------------------------------------------------------------------- the export folder, written whole

def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_export_replaces_the_folder_whole(tiny, drafter, tmp_path, monkeypatch):
    """`eyas export` writes each format into a fresh folder and swaps it in: a stale weights file in the old folder
    does not survive (a reader would merge it in), an export that stops midway leaves the old folder whole (not a
    new model.safetensors beside the old config.json), a killed export's leftover is deleted by the next one, and a
    folder holding something other than an export is refused, not deleted."""
    import subprocess
    import sys

    import eyas.export as E
    import eyas.fresh_folder as F

    save_drafter(drafter, tmp_path / "draft")
    cfg = Config()
    cfg.out, cfg.target.name, cfg.export.formats = str(tmp_path), "tiny", ["vllm"]
    run_export(cfg)
    vllm = tmp_path / "export" / "vllm"
    good = load_file(str(vllm / "model.safetensors"))
    save_file({"fc.weight": torch.zeros_like(good["fc.weight"])}, str(vllm / "zz-old.safetensors"))
    run_export(cfg)
    assert sorted(_files(vllm)) == ["config.json", "model.safetensors"]
    assert torch.equal(_logits(import_drafter(vllm, target=tiny), tiny), _logits(drafter, tiny))
    # stopped while writing the config (after the weights): the old folder stays as it was, nothing left beside it
    before = _files(vllm)
    save_drafter(_drafter(tiny, seed=5), tmp_path / "draft")

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(E, "atomic_write_json", stop)
    with pytest.raises(KeyboardInterrupt):
        run_export(cfg)
    monkeypatch.undo()
    assert _files(vllm) == before and sorted(p.name for p in vllm.parent.iterdir()) == ["target", "vllm"]
    # what an export killed outright left (its process is gone) is deleted by the next export; where the system
    # cannot swap two folders in one step, the old one is moved aside first
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = vllm.parent / f".vllm.{int(gone.stdout)}.tmp"
    left.mkdir()
    (left / "config.json").write_text("{}")
    monkeypatch.setattr(F, "_exchange", lambda a, b: False)
    run_export(cfg)
    assert sorted(p.name for p in vllm.parent.iterdir()) == ["target", "vllm"] and _files(vllm) != before
    assert torch.equal(_logits(import_drafter(vllm, target=tiny), tiny), _logits(_drafter(tiny, seed=5), tiny))
    plain = tmp_path / "plain"
    plain.write_text("x")  # the new folder's files have a plain file's mode (an engine run as another user reads them)
    assert {(vllm / f).stat().st_mode & 0o777 for f in ("config.json", "model.safetensors")} == {
        plain.stat().st_mode & 0o777}
    # a folder that is not an export is refused, and kept
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(EyasError, match=r"mine: holds notes.txt, which is not a drafter export"):
        export_drafter(drafter, other, "vllm", "x")
    assert (other / "notes.txt").read_text() == "keep"


def test_import_reads_only_the_weights_a_folder_names(tiny, drafter, tmp_path):
    """A folder's weights are the files its index names, else model.safetensors, else (neither there) every
    *.safetensors file; a stray file beside them is not merged in, and a tensor found in two files is refused."""
    p = export_drafter(drafter, tmp_path / "vl", "vllm", "x")
    sd = load_file(str(p / "model.safetensors"))
    save_file({"fc.weight": torch.zeros_like(sd["fc.weight"])}, str(p / "zz-old.safetensors"))
    assert torch.equal(_logits(import_drafter(p, target=tiny), tiny), _logits(drafter, tiny))
    # sharded with an index: the two files it names, not the stray one
    (p / "model.safetensors").unlink()
    names = sorted(sd)
    half = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for f, keys in half.items():
        save_file({k: sd[k] for k in keys}, str(p / f))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in half.items() for k in keys}}
    (p / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(_logits(import_drafter(p, target=tiny), tiny), _logits(drafter, tiny))
    index["weight_map"]["fc.weight"] = "model-00003-of-00002.safetensors"
    (p / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EyasError, match=r"index.json: names model-00003-of-00002.safetensors, which is not in"):
        import_drafter(p, target=tiny)
    # no index and no model.safetensors: every file is read, and fc.weight is in two of them
    (p / "model.safetensors.index.json").unlink()
    with pytest.raises(EyasError, match=r"tensor 'fc.weight' is in both model-0000[12]-of-00002.safetensors and "
                                        r"zz-old.safetensors"):
        import_drafter(p, target=tiny)


# --------------------------------------------------------------------------- the target an export is for

def test_export_checks_the_drafter_fits_its_target(tiny, drafter, tmp_path):
    """The export checks the drafter against the target it names as verifier (its config alone), with or without
    the embedding: a drafter trained for tiny (width 64) is refused for SmolLM2 (576), and so is one trained on
    other aux layers than the ones the user names; nothing is written."""
    save_drafter(drafter, tmp_path / "draft")
    cfg = Config()
    cfg.out, cfg.target.name, cfg.export.formats = str(tmp_path), "smollm2", ["vllm"]
    for emb in (False, True):
        cfg.export.include_embeddings = emb
        with pytest.raises(EyasError, match=r"draft does not fit target 'smollm2': hidden size 64 != target's 576"):
            run_export(cfg)
    cfg.target.name, cfg.export.include_embeddings, cfg.target.aux_layers = "tiny", False, [1, 3, 7]
    with pytest.raises(EyasError, match=r"aux layers \[2, 4, 5\] != the target's \[1, 3, 7\]"):
        run_export(cfg)
    assert not (tmp_path / "export").exists()


def test_export_names_eval_k(tiny, drafter, tmp_path):
    save_drafter(drafter, tmp_path / "draft")
    cfg = Config()
    cfg.out, cfg.target.name, cfg.eval.k = str(tmp_path), "tiny", 0
    with pytest.raises(EyasError, match=r"^eval.k must be at least 1 .*got 0$"):
        run_export(cfg)


# --------------------------------------------------------------------------- damaged drafter folders

def _damage(folder, how):
    cfg, weights = folder / "config.json", folder / "model.safetensors"
    raw = json.loads(cfg.read_text())
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "no weights":
        weights.unlink()
    elif how == "array":
        cfg.write_text(json.dumps([raw]))
    else:
        cfg.write_text(json.dumps(how(raw)))


DAMAGE = [
    ("truncated", r"model.safetensors: not a readable safetensors file \(.*\): it is damaged or cut short"),
    ("no weights", r"model.safetensors: not found"),
    ("array", r"config.json: expected a JSON object \(the drafter's settings\), got a JSON array"),
    (lambda r: {k: v for k, v in r.items() if k != "hidden_size"}, r"config.json: field 'hidden_size' is missing"),
    (lambda r: r | {"hidden_size": "64"},
     r"config.json: field 'hidden_size' must be a positive whole number, got '64' \(a string\)"),
    (lambda r: r | {"draft_vocab_size": 1024},
     r"model.safetensors \(against config.json\): tensor 'lm_head.weight' has shape \[2048, 64\], "
     r"expected \[1024, 64\]"),
    (lambda r: r | {"num_attention_heads": 8},
     r"model.safetensors \(against config.json\): tensor 'midlayer.self_attn.q_proj.weight' has shape \[64, 128\], "
     r"expected \[128, 128\]"),
    (lambda r: r | {"eyas_format": 2}, r"config.json: eyas_format is 2, a drafter layout this version of eyas does "
                                       r"not know \(it reads 1\)"),
    (lambda r: r | {"aux_layers": [2, 4]},
     r"config.json: the drafter's aux layers \(aux_layers\) are \[2, 4\], 2 layer\(s\); an EAGLE-3 drafter is fed "
     r"the target's states at 3 layers"),
]


@pytest.mark.parametrize("how,msg", DAMAGE, ids=["truncated", "no-weights", "array", "no-hidden", "string-hidden",
                                                  "draft-vocab", "heads", "format-2", "two-aux"])
def test_a_damaged_drafter_folder_is_refused_naming_the_file(tiny, drafter, tmp_path, capsys, how, msg):
    """Every reader of a drafter folder (eval's, export's, the importer) refuses a damaged one with one message that
    names the file and the field, never a traceback (torch's size mismatch, safetensors' header error, a TypeError
    from the config, an unknown format version read as SGLang's layout)."""
    from eyas.cli import main
    from eyas.draft import load_drafter
    from eyas.evaluate import load_eval_drafter

    run = tmp_path / "run"
    save_drafter(drafter, run / "draft")
    _damage(run / "draft", how)
    loaders = {"load": lambda: load_drafter(run / "draft", tiny), "import": lambda: import_drafter(run / "draft"),
               "eval": lambda: load_eval_drafter(run / "draft", tiny)}
    if how == "array":
        del loaders["eval"]  # eyas.evaluate reads the config itself before it calls the loaders
    for load in loaders.values():
        with pytest.raises(EyasError, match=msg):
            load()
    (run / "eyas.toml").write_text('preset = "tiny"\n[target]\nname = "tiny"\n')
    assert main(["export", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(run / "draft") in err, err


def test_the_eyas_readers_refuse_a_folder_that_is_not_an_eyas_drafter_alike(drafter, tmp_path):
    """load_drafter and check_checkpoint read a folder's config through one function: a missing config and another
    format's folder get the same message from both, naming config.json (and, for another format, the reader)."""
    from eyas.draft import load_drafter

    sg = export_drafter(drafter, tmp_path / "sg", "sglang", "x")
    for read in (load_drafter, check_checkpoint):
        with pytest.raises(EyasError, match=r"nowhere/config.json: not found \(is .*nowhere a trained eyas drafter "
                                            r"folder\? run `eyas train` first\)"):
            read(tmp_path / "nowhere")
        with pytest.raises(EyasError, match=r"sg/config.json: not an eyas drafter's config \(no eyas_format\): an "
                                            r"SGLang, vLLM or EAGLE drafter is read by eyas.formats.import_drafter"):
            read(sg)


def test_aux_layers_the_target_lacks_are_blamed_on_the_drafters_file(tiny, drafter, tmp_path):
    """A drafter recording aux layers its target does not have is refused naming its config file and what the target
    has (the user never set target.aux_layers)."""
    from eyas.draft import load_drafter

    run = tmp_path / "run"
    save_drafter(drafter, run / "draft")
    _damage(run / "draft", lambda r: r | {"aux_layers": [2, 4, 99]})
    msg = (r"draft/config.json: the drafter's aux layers \(aux_layers\) are \[2, 4, 99\]: target 'tiny' has no layer "
           r"99 \(its 8 decoder layers take ids 0..8\), so the drafter was trained for another target")
    with pytest.raises(EyasError, match=msg):
        load_drafter(run / "draft", tiny)
    cfg = Config()
    cfg.out, cfg.target.name = str(run), "tiny"
    with pytest.raises(EyasError, match=msg):
        run_export(cfg)
    p = export_drafter(drafter, tmp_path / "sg", "sglang", "x")
    raw = json.loads((p / "config.json").read_text())
    (p / "config.json").write_text(json.dumps(raw | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3]}}))
    with pytest.raises(EyasError, match=r"sg/config.json: the drafter's aux layers \(eagle_config.eagle_aux_hidden_"
                                        r"state_layer_ids, each \+ 1 as SGLang reads them\) are \[2, 4\], 2 layer"):
        import_drafter(p, target=tiny)


@pytest.mark.parametrize("edit,msg", [
    (lambda r: r["transformer_layer_config"].update(hidden_size="big"),
     r"field 'transformer_layer_config.hidden_size' must be a positive whole number, got 'big' \(a string\)"),
    (lambda r: r.update(eagle_aux_hidden_state_layer_ids="2,4,5"),
     r"field 'eagle_aux_hidden_state_layer_ids' must be a list of layer ids, got '2,4,5' \(a string\)"),
    (lambda r: r.update(eyas_format=2), r"eyas_format is 2, a drafter layout this version of eyas does not know"),
], ids=["string-hidden", "string-ids", "format-2"])
def test_a_damaged_engine_config_is_refused_naming_the_field(tiny, drafter, tmp_path, edit, msg):
    p = export_drafter(drafter, tmp_path / "vl", "vllm", "x")
    raw = json.loads((p / "config.json").read_text())
    edit(raw)
    (p / "config.json").write_text(json.dumps(raw))
    with pytest.raises(EyasError, match=r"vl/config.json: " + msg):
        import_drafter(p, target=tiny)


def _poison(weights, name="fc.weight", value=float("nan")):
    """Set one value of tensor `name` in a safetensors file to `value` (what a diverged training leaves)."""
    sd = load_file(str(weights))
    sd[name] = sd[name].clone()
    sd[name].view(-1)[3] = value
    save_file(sd, str(weights))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_drafter_with_non_finite_weights_is_refused_naming_file_and_tensor(tiny, drafter, tmp_path, capsys, value):
    """A drafter holding NaN or Inf is written by no one (save_drafter, export) and read by no one (eval, export,
    fine-tuning, the importer of each format): eval took one full of Inf for "τ 1.000, lossless", export wrote it
    for both engines."""
    from eyas.cli import main
    from eyas.draft import load_drafter
    from eyas.evaluate import load_eval_drafter
    from eyas.train.drafter_init import initial_drafter

    run = tmp_path / "run"
    save_drafter(drafter, run / "draft")
    for fmt in ("sglang", "vllm"):
        export_drafter(drafter, tmp_path / fmt, fmt, "tiny")
        _poison(tmp_path / fmt / "model.safetensors", "fc.weight", value)
        with pytest.raises(EyasError, match=rf"{tmp_path / fmt / 'model.safetensors'}: tensor 'fc.weight' holds 1 "
                                            r"non-finite values \(NaN or Inf\) of 12,288; the drafter's weights"):
            import_drafter(tmp_path / fmt, tiny)
    _poison(run / "draft" / "model.safetensors", "midlayer.mlp.down_proj.weight", value)
    msg = rf"{run / 'draft' / 'model.safetensors'}: tensor 'midlayer.mlp.down_proj.weight' holds 1 non-finite"
    cfg = C.resolve(preset_name="tiny", overrides={"out": str(tmp_path / "ft"), "train.finetune_from": str(run)})
    for load in (lambda: load_drafter(run / "draft", tiny), lambda: load_eval_drafter(run / "draft", tiny),
                 lambda: import_drafter(run / "draft"), lambda: initial_drafter(cfg, tiny, drafter.draft_ids)):
        with pytest.raises(EyasError, match=msg):
            load()
    (run / "eyas.toml").write_text('preset = "tiny"\n[target]\nname = "tiny"\n')
    capsys.readouterr()
    assert main(["export", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and msg.replace("\\", "") in err and not (run / "export").exists()
    # nor is one written: the drafter in memory with an Inf in it
    bad = copy.deepcopy(drafter)
    with torch.no_grad():
        bad.lm_head.weight[0, 0] = value
    with pytest.raises(EyasError, match=r"export/vllm/model.safetensors: not written: tensor 'lm_head.weight' holds"):
        export_drafter(bad, run / "export" / "vllm", "vllm", "tiny")
    with pytest.raises(EyasError, match=r"draft2/model.safetensors: not written: tensor 'lm_head.weight' holds"):
        save_drafter(bad, tmp_path / "draft2")
    assert not (run / "export").exists() and not (tmp_path / "draft2").exists()
