"""`eyas run` end to end on a tiny random model of each target family people serve: Llama-3.1 (llama3 rope),
DeepSeek-V3 / Kimi-K2 (MLA, MoE with shared experts, yarn), Qwen3, Qwen3-MoE, Mixtral, Gemma 3 (alternating sliding
and full attention, per-attention-type rope; text-only and nested under `text_config`), gpt-oss (attention sinks,
MoE, yarn, alternating sliding windows) and a LLaVA-style wrapper whose text model is Qwen3. Each model is made here
with `AutoConfig.for_model` (8 layers of width 32, SmolLM2's tokenizer) and goes through every stage with the
smallest settings: the run must finish lossless, with both exports loading back into eyas and shaped as SGLang's and
vLLM's loaders read them, and the drafter's rope of the target's own kind."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.config import TargetConfig
from eyas.draft import load_drafter
from eyas.formats import import_drafter
from eyas.target_spec import load_spec
from test_export import _expected_sglang, _vllm_pretrained_config

VOCAB = 49152  # SmolLM2's tokenizer
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2)
WINDOW = 16  # sliding windows shorter than every prompt, so the window matters in regen, training and eval
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)
DS_YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
               mscale_all_dim=1.0)


def _config(family: str):
    from transformers import AutoConfig

    if family == "llama3":
        return AutoConfig.for_model("llama", vocab_size=VOCAB, rope_scaling=dict(LLAMA3), rope_theta=500000.0,
                                    max_position_embeddings=131072, **SMALL)
    if family == "deepseek_v3":  # MLA (q and kv low-rank, split rope/nope heads), MoE with a shared expert, yarn
        return AutoConfig.for_model("deepseek_v3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                    moe_intermediate_size=16, num_hidden_layers=8, num_attention_heads=4,
                                    num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                    n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                    v_head_dim=8, max_position_embeddings=16384, rope_scaling=dict(DS_YARN))
    if family == "qwen3":
        return AutoConfig.for_model("qwen3", vocab_size=VOCAB, head_dim=8, **SMALL)
    if family == "qwen3_moe":
        return AutoConfig.for_model("qwen3_moe", vocab_size=VOCAB, head_dim=8, moe_intermediate_size=16,
                                    num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, **SMALL)
    if family == "mixtral":
        return AutoConfig.for_model("mixtral", vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2, **SMALL)
    if family == "gemma3_text":
        return AutoConfig.for_model("gemma3_text", vocab_size=VOCAB, head_dim=8, sliding_window=WINDOW, **SMALL)
    if family == "gemma3":
        return AutoConfig.for_model("gemma3", vision_config=VISION,
                                    text_config=dict(vocab_size=VOCAB, head_dim=8, sliding_window=WINDOW, **SMALL))
    if family == "gpt_oss":  # its default rope is yarn (factor 32)
        return AutoConfig.for_model("gpt_oss", vocab_size=VOCAB, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=WINDOW, **SMALL)
    if family == "llava_qwen3":
        return AutoConfig.for_model("llava", vision_config=dict(model_type="clip_vision_model", **VISION),
                                    text_config=dict(model_type="qwen3", vocab_size=VOCAB, head_dim=8,
                                                     tie_word_embeddings=False, **SMALL))
    raise KeyError(family)


# family -> (the drafter's rope kind, whether regen and eval run on eyas' fast engine)
FAMILIES = {"llama3": ("llama3", True), "deepseek_v3": ("yarn", False), "qwen3": ("default", True),
            "qwen3_moe": ("default", True), "mixtral": ("default", False), "gemma3_text": ("default", False),
            "gemma3": ("default", False), "gpt_oss": ("yarn", False), "llava_qwen3": ("default", False)}
ARGS = ["--preset", "tiny", "--set", "target.device=cpu", "--set", "data.limit=16", "--set", "regen.limit=4",
        "--set", "regen.turns=1", "--set", "regen.max_new_tokens=8", "--set", "vocab.draft_vocab_size=256",
        "--set", "train.epochs=1", "--set", "eval.limit=2", "--set", "eval.turns=1", "--set", "eval.max_new_tokens=8"]
# these train on stored features (extract, then training that holds only the target's head); the others capture the
# target's states online while training, as the tiny preset does
STORED = ("deepseek_v3", "mixtral", "gemma3", "gpt_oss", "llava_qwen3")


@pytest.fixture(scope="module")
def tokenizer_dir():
    """The tiny preset's folder: SmolLM2's tokenizer files are copied from it."""
    return Path(load_spec(TargetConfig(name="tiny", device="cpu")).source)


def make_target(family: str, out: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(0)
    conf = _config(family)
    model = (AutoModelForImageTextToText if family.startswith("llava") else AutoModelForCausalLM).from_config(conf)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def _full_attention_rope(text_config) -> tuple[float, dict]:
    """The target's rope settings of its full-attention layers (Gemma 3 keeps one set per attention type)."""
    params = dict(getattr(text_config, "rope_parameters", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        params = params["full_attention"]
    return float(params["rope_theta"]), params


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_runs_end_to_end(family, tmp_path, tokenizer_dir):
    kind, fast = FAMILIES[family]
    folder = make_target(family, tmp_path / family, tokenizer_dir)
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "eyas", "run", "--out", str(out), "--set", f"target.name={folder}",
                        *ARGS, "--set", f"train.online={family not in STORED}"], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    man = json.loads((out / "manifest.json").read_text())
    assert [s for s, v in man["stages"].items() if v["status"] == "done"] == \
        ["regen", "tokenize", "vocab", *(["extract"] if family in STORED else []), "train", "eval", "export"]
    rep = json.loads((out / "eval" / "report.json").read_text())
    assert rep["lossless"] is True and rep["lossless_checked"] == 2, rep.get("lossless_mismatches")
    # the fast engine where it implements the architecture; elsewhere transformers, saying so
    assert ("is not an architecture FastLM implements" not in r.stderr) == fast, r.stderr[-3000:]

    text = _config(family).get_text_config(decoder=True)
    theta, params = _full_attention_rope(text)
    draft = load_drafter(out / "draft")
    assert draft.config.hidden_size == draft.config.target_hidden_size == text.hidden_size
    assert len(set(draft.config.aux_layers)) == 3  # the engines capture each layer once; speculators refuses repeats
    assert draft.config.rope_theta == theta
    assert (draft.config.rope_scaling or {}).get("rope_type", "default") == kind
    if kind == "llama3":
        assert draft.config.rope_scaling == LLAMA3  # (transformers writes rope_theta into the dict it is given)
    if family == "deepseek_v3":  # MLA's own yarn scale belongs to its attention, not to the Llama draft layer
        assert draft.config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings":
                                             4096, "beta_fast": 32.0, "beta_slow": 1.0}
    for fmt in ("sglang", "vllm"):
        p = out / "export" / fmt
        raw = json.loads((p / "config.json").read_text())
        layer = raw if fmt == "sglang" else _vllm_pretrained_config(raw)
        assert layer["rope_theta"] == theta and layer.get("rope_scaling") == draft.config.rope_scaling, fmt
        assert layer["target_hidden_size"] == text.hidden_size and layer["vocab_size"] == VOCAB
        assert layer["draft_vocab_size"] == 256
        if fmt == "sglang":
            assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
            assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [a - 1 for a in draft.config.aux_layers]
            exp = _expected_sglang(raw)
        else:
            assert layer["eagle_aux_hidden_state_layer_ids"] == draft.config.aux_layers
            exp = {k.replace("midlayer.", "layers.0."): v for k, v in _expected_sglang(layer).items()}
        sd = load_file(str(p / "model.safetensors"))
        assert {k: (tuple(v.shape), v.dtype) for k, v in sd.items()} == exp, fmt
        back = import_drafter(p)  # and eyas reads it back as the drafter it trained
        assert back.config.rope_scaling == draft.config.rope_scaling and back.config.rope_theta == theta
        mine = {k: v for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
        assert all(torch.equal(v, back.state_dict()[k]) for k, v in mine.items()), fmt


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_sliding_window_decoding_matches_transformers_generate(family, tmp_path, tokenizer_dir):
    """On transformers' path the decoder's cache rolls back past rejected drafts: with windows shorter than the
    prompt and the answer, plain and speculative decoding (a random drafter, so most drafts are rejected) both give
    the tokens of transformers' own greedy `generate`, the target's embedding table is the drafter's, and the scale
    Gemma's embedding module applies on top (sqrt of the hidden size) is one the drafter's input norm takes out."""
    from eyas.decode import Decoder
    from eyas.draft import build_drafter
    from eyas.target import load_target

    folder = make_target(family, tmp_path / family, tokenizer_dir)
    target = load_target(TargetConfig(name=str(folder), dtype="float32", device="cpu"))
    torch.manual_seed(1)
    drafter = build_drafter(target, 256)
    prompt = torch.randint(100, VOCAB, (2 * WINDOW + 3,))
    ref = target.model.generate(prompt[None], max_new_tokens=2 * WINDOW, min_new_tokens=2 * WINDOW, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    dec = Decoder(target, drafter, k=3, max_len=256)
    try:
        plain = dec.generate(prompt, 2 * WINDOW, speculative=False)
        spec = dec.generate(prompt, 2 * WINDOW, speculative=True)
    finally:
        dec.close()
    assert plain.tokens == ref and spec.tokens == ref
    assert len(spec.accepted) >= WINDOW // 2  # many rounds, so many rollbacks
    emb = target.embed_tokens()
    assert torch.equal(drafter.embed_tokens.weight, emb.weight.float())
    if family.startswith("gemma3"):
        x = drafter.embed_tokens(prompt[None])
        scaled = emb(prompt[None])  # what Gemma 3's first layer reads
        assert torch.allclose(scaled, x * emb.embed_scale)
        norm = drafter.midlayer.input_layernorm
        assert torch.allclose(norm(scaled), norm(x), rtol=1e-2, atol=1e-3)  # equal up to the norm's eps
