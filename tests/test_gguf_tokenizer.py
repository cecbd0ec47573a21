"""A GGUF target's tokenizer carries the GGUF's own special tokens (eyas.gguf_tokenizer): a DeepSeek-R1-Distill-Qwen
GGUF (its real tokenizer cut down, tests/fixtures/r1_tokenizer, written into a GGUF file with a tiny random Qwen2
model) tokenizes its chat markers to their ids and ends turns with its own EOS; the SmolLM2 preset's tokenizer gets
its GGUF's EOS and padding; a cache made before the repair is repaired once, without dequantizing again."""
import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from eyas.config import TargetConfig
from eyas.target import load_target

FIXTURE = Path(__file__).parent / "fixtures" / "r1_tokenizer"
USER, ASSISTANT, BOS, EOS, THINK = 151644, 151645, 151646, 151643, 151648


def write_r1_gguf(path: Path, layers: int = 2, hidden: int = 16) -> None:
    """The fixture's tokenizer as the R1 GGUF header holds it (dense ids: placeholders where the cut vocabulary has
    none; control and user-defined token types; bos/eos/padding ids; merges; chat template) and a random Qwen2."""
    from gguf import GGUFWriter, TokenType

    tj = json.loads((FIXTURE / "tokenizer.json").read_text())
    conf = json.loads((FIXTURE / "tokenizer_config.json").read_text())
    vocab = tj["model"]["vocab"]
    n = max(vocab.values()) + 1
    tokens, types = [f"<unused_{i}>" for i in range(n)], [int(TokenType.UNUSED)] * n
    for t, i in vocab.items():
        tokens[i], types[i] = t, int(TokenType.NORMAL)
    for a in tj["added_tokens"]:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = int(TokenType.CONTROL if a["special"] else TokenType.USER_DEFINED)
    w = GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("deepseek-r1-qwen")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(vocab[conf["bos_token"]])
    w.add_eos_token_id(vocab[conf["eos_token"]])
    w.add_pad_token_id(vocab[conf["pad_token"]])
    w.add_chat_template((FIXTURE / "chat_template.jinja").read_text())
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    rng = np.random.default_rng(0)
    kv = hidden // 2

    def tensor(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    tensor("token_embd.weight", n, hidden)
    tensor("output_norm.weight", hidden)
    tensor("output.weight", n, hidden)
    for b in range(layers):
        for name, shape in (("attn_norm.weight", (hidden,)), ("ffn_norm.weight", (hidden,)),
                            ("attn_q.weight", (hidden, hidden)), ("attn_q.bias", (hidden,)),
                            ("attn_k.weight", (kv, hidden)), ("attn_k.bias", (kv,)), ("attn_v.weight", (kv, hidden)),
                            ("attn_v.bias", (kv,)), ("attn_output.weight", (hidden, hidden)),
                            ("ffn_gate.weight", (2 * hidden, hidden)), ("ffn_up.weight", (2 * hidden, hidden)),
                            ("ffn_down.weight", (hidden, 2 * hidden))):
            tensor(f"blk.{b}.{name}", *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    """The GGUF file, a TargetConfig of it with its own cache folder, and the tokenizer transformers makes of it
    (each conversion of its 151,665 tokens takes about 20 s, so both are made once)."""
    d = tmp_path_factory.mktemp("r1")
    gguf = d / "r1-distill.gguf"
    write_r1_gguf(gguf)
    cfg = TargetConfig(name=str(gguf), dtype="float32", device="cpu", cache_dir=str(d / "cache"))
    return gguf, cfg, AutoTokenizer.from_pretrained(str(d), gguf_file=gguf.name)


def ids_of(tok, messages, **kw):
    out = tok.apply_chat_template(messages, **kw)
    return out if isinstance(out, list) else out["input_ids"]


CHAT = [{"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"}]


def test_an_r1_gguf_target_tokenizes_its_chat_markers_and_ends_turns_with_its_eos(r1):
    _, cfg, raw = r1  # raw: what transformers makes of the file
    assert raw.encode("<｜User｜>", add_special_tokens=False) != [USER] and raw.eos_token_id != EOS
    target = load_target(cfg)
    tok = target.tokenizer
    assert tok.encode("<｜User｜>Hi<｜Assistant｜><think>\n", add_special_tokens=False)[:1] == [USER]
    assert THINK in tok.encode("<think>\n", add_special_tokens=False)
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS, EOS) and EOS in target.eot_token_ids
    assert len(tok) == target.model.config.vocab_size  # no token past the model's vocabulary
    ref = AutoTokenizer.from_pretrained(str(FIXTURE))  # the model's own tokenizer (cut down)
    for kw in ({"add_generation_prompt": True}, {}):
        assert ids_of(tok, CHAT, **kw) == ids_of(ref, CHAT, **kw)
    assert tok.decode(ids_of(tok, CHAT, add_generation_prompt=True)).endswith("<｜Assistant｜>")


def test_a_cache_made_before_the_repair_is_repaired_once(r1, capsys):
    """A cached folder whose done.json predates the repair (transformers' tokenizer saved as it came) gets the GGUF's
    special tokens on the next load, its weights left as they are; the load after that changes nothing."""
    from eyas.target_source import gguf_to_hf

    gguf, cfg, raw = r1
    out, _ = gguf_to_hf(gguf, cfg)
    raw.save_pretrained(out)  # the tokenizer an older eyas cached
    done = json.loads((out / "done.json").read_text())
    (out / "done.json").write_text(json.dumps({k: v for k, v in done.items() if k != "tokenizer"}))
    weights = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    assert AutoTokenizer.from_pretrained(str(out)).eos_token_id != EOS
    gguf_to_hf(gguf, cfg)
    assert "now has the GGUF's own special tokens" in capsys.readouterr().err
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token_id == EOS and tok.encode("<｜User｜>", add_special_tokens=False) == [USER]
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")} == weights
    assert json.loads((out / "done.json").read_text())["tokenizer"] == 1
    gguf_to_hf(gguf, cfg)
    assert "special tokens" not in capsys.readouterr().err


def test_the_smollm2_preset_ends_turns_with_its_ggufs_eos():
    """SmolLM2's GGUF names <|im_end|> (2) as EOS and padding, as its own tokenizer_config does; transformers' GGUF
    converter names <|im_start|>. The tiny preset's copy of that tokenizer says the same, on a machine whose tiny
    cache predates the repair too."""
    from eyas.target import load_tokenizer

    for name in ("smollm2", "tiny"):
        tok = load_tokenizer(TargetConfig(name=name))
        assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 2, 2), name
        assert tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)[0] == 1
