"""A target without its weights: the description (eyas.target_spec) that tokenize, vocab, preflight, `eyas target`
and export read, and the head alone (eyas.target_head) that training on stored features holds. Tiny random models
made here (a sharded Llama, tied and untied; Gemma 3 and LLaVA, whose text model sits under `text_config`), with
SmolLM2's tokenizer."""
import contextlib
import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import eyas.target
from eyas.config import TargetConfig, resolve
from eyas.target_head import load_target_head, target_bytes_held
from eyas.target_spec import load_spec
from eyas.util import EyasError

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2)
CHATS = [("What is the capital of France?", "Paris is the capital of France."),
         ("Name a prime number.", "Seven is a prime number."),
         ("How many legs has a spider?", "A spider has eight legs."),
         ("Say hello in Spanish.", "Hola is hello in Spanish.")]


@pytest.fixture(scope="module")
def tokenizer_dir():
    """The tiny preset's folder: SmolLM2's tokenizer files are copied from it."""
    return Path(load_spec(TargetConfig(name="tiny", device="cpu")).source)


def save_target(model, out: Path, tokenizer_dir: Path, shard: str = "60KB") -> Path:
    """`model` saved as a sharded transformers folder with SmolLM2's tokenizer beside it."""
    model.save_pretrained(out, max_shard_size=shard)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def llama(vocab: int, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, tie_word_embeddings=tied, eos_token_id=2, **SMALL))


def gemma3(vocab: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    conf = AutoConfig.for_model("gemma3", text_config=dict(vocab_size=vocab, head_dim=8, **SMALL),
                                vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                   num_attention_heads=2, image_size=28, patch_size=14))
    return AutoModelForCausalLM.from_config(conf)


def llava(vocab: int):
    from transformers import AutoConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    conf = AutoConfig.for_model("llava", text_config=dict(model_type="llama", vocab_size=vocab,
                                                          tie_word_embeddings=False, **SMALL),
                                vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                                                   num_hidden_layers=1, num_attention_heads=2, image_size=28,
                                                   patch_size=14))
    return LlavaForConditionalGeneration(conf)


def no_model_loads(monkeypatch):
    """Any load of the whole target fails the test."""
    from transformers import AutoModelForCausalLM

    def refuse(*a, **k):
        raise AssertionError("the whole target was loaded")

    monkeypatch.setattr(eyas.target, "load_target", refuse)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def write_chats(path: Path, n: int = 24) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            q, a = CHATS[i % len(CHATS)]
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"{q} ({i})"},
                                                            {"role": "assistant", "content": a}]}) + "\n")
    return path


def test_stages_run_on_a_target_whose_weights_are_absent(tmp_path, tokenizer_dir, monkeypatch):
    """tokenize, vocab, preflight, `eyas target` and export's check of a folder that holds config.json, the
    tokenizer and an index naming a terabyte of shards, none of them here: no weight is read."""
    from eyas.cli import main
    from eyas.data.prepare import run_tokenize
    from eyas.export import export_target
    from eyas.pipeline import preflight
    from eyas.vocab import run_vocab

    folder = save_target(llama(49152, tied=False), tmp_path / "big", tokenizer_dir)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # sharded
    index["metadata"]["total_size"] = 10 ** 12
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    for f in folder.glob("*.safetensors"):
        f.unlink()
    no_model_loads(monkeypatch)

    spec = load_spec(TargetConfig(name=str(folder), device="cpu"))
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size, spec.aux_layers) == (6, 32, 49152, [1, 3, 5])
    assert spec.sha256.startswith("meta:") and spec.has_chat_template and spec.weights["present"] == 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["target", "--target", str(folder), "--device", "cpu", "--json"]) == 0
    info = json.loads(out.getvalue())
    assert info["layers"] == 6 and info["weights"].endswith("0 on this machine") and "1.0 TB" in info["weights"]

    run = tmp_path / "run"
    cfg = resolve(preset_name="tiny", overrides={
        "out": str(run), "target.name": str(folder), "target.device": "cpu", "target.aux_layers": [1, 3, 4],
        "data.source": str(write_chats(tmp_path / "chats.jsonl")), "data.limit": 0, "data.test_ratio": 0.0,
        "train.val_ratio": 0.1, "eval.prompts": "humaneval", "regen.enabled": False, "vocab.draft_vocab_size": 64})
    assert preflight(cfg, run, {}).identity() == load_spec(cfg.target).identity()
    assert run_tokenize(cfg)["conversations"] == 24
    assert run_vocab(cfg)["draft_vocab_size"] == 64
    fit = export_target(cfg.target, SimpleNamespace(aux_layers=[1, 3, 4]), folder / "config.json")
    assert (fit.num_layers, fit.hidden_size, fit.aux_layers) == (6, 32, [1, 3, 4])


def test_weightless_identity_is_not_a_weight_hash(tmp_path, tokenizer_dir):
    """A folder's identity is the sha256 of its first safetensors file, as before; without weight files it is a
    hash of its metadata, which differs between two such folders and from the folder with its weights."""
    a = save_target(llama(512, tied=True), tmp_path / "a", tokenizer_dir, shard="10GB")
    with_weights = load_spec(TargetConfig(name=str(a), device="cpu")).sha256
    from eyas.util import sha256_file

    assert with_weights == sha256_file(a / "model.safetensors")[:16]
    (a / "model.safetensors").unlink()
    b = save_target(llama(640, tied=True), tmp_path / "b", tokenizer_dir, shard="10GB")
    (b / "model.safetensors").unlink()
    ids = {load_spec(TargetConfig(name=str(p), device="cpu")).sha256 for p in (a, b)}
    assert len(ids) == 2 and with_weights not in ids


@pytest.mark.parametrize("kind", ["llama_tied", "llama_untied", "gemma3", "llava"])
def test_head_from_the_shards_equals_the_models(kind, tmp_path, tokenizer_dir, monkeypatch):
    """The embedding, final norm and output layer read from a sharded checkpoint by name equal the model's own,
    tied or not, and under a multimodal wrapper (its names prefixed language_model.*), and the description gives
    the text model's layers, width and vocabulary."""
    model = {"llama_tied": lambda: llama(512, True), "llama_untied": lambda: llama(512, False),
             "gemma3": lambda: gemma3(512), "llava": lambda: llava(512)}[kind]()
    folder = save_target(model, tmp_path / kind, tokenizer_dir)
    assert len(list(folder.glob("*.safetensors"))) > 2
    no_model_loads(monkeypatch)
    head = load_target_head(TargetConfig(name=str(folder), device="cpu", dtype="float32"))
    assert (head.num_layers, head.hidden_size, head.vocab_size) == (6, 32, 512)
    decoder = model.get_decoder()
    torch.testing.assert_close(head.embed_tokens().weight, model.get_input_embeddings().weight, rtol=0, atol=0)
    torch.testing.assert_close(head.lm_head().weight, model.get_output_embeddings().weight, rtol=0, atol=0)
    torch.testing.assert_close(head.final_norm_weight(), decoder.norm.weight, rtol=0, atol=0)
    tied = kind in ("llama_tied", "gemma3")
    assert (head.lm_head().weight is head.embed_tokens().weight) == tied
    assert head.bytes_held() == 4 * (512 * 32 * (1 if tied else 2) + 32)
    assert head.names[0].startswith("language_model.") == (kind in ("gemma3", "llava"))


def test_nested_target_loads_whole_with_its_text_model(tmp_path, tokenizer_dir):
    """A Gemma 3 target (text model under text_config) loaded whole: its layers, width and vocabulary are the text
    model's, its capture gives three aux states of that width, its head equals the one read from the shards, and
    a drafter is built for it."""
    from eyas.draft import build_drafter
    from eyas.target import load_target

    folder = save_target(gemma3(49152), tmp_path / "g3", tokenizer_dir, shard="2MB")
    tcfg = TargetConfig(name=str(folder), device="cpu", dtype="float32")
    whole, head = load_target(tcfg), load_target_head(tcfg)
    assert whole.identity() == head.identity() == load_spec(tcfg).identity()
    assert (whole.num_layers, whole.hidden_size, whole.vocab_size) == (6, 32, 49152)
    aux, final = whole.capture(torch.tensor([[1, 5, 9, 200]]))
    assert aux.shape == (1, 4, 3 * 32) and final.shape == (1, 4, 32)
    assert torch.equal(whole.lm_head().weight, head.lm_head().weight)
    assert torch.equal(whole.final_norm_weight(), head.final_norm_weight())
    assert target_bytes_held(head) < target_bytes_held(whole)
    d = build_drafter(head, 64)
    assert (d.config.target_hidden_size, d.config.target_num_layers, d.config.target_vocab_size) == (32, 6, 49152)


def test_head_names_refuse_what_they_cannot_tell(tmp_path):
    from eyas.target_head import head_names

    with pytest.raises(EyasError, match="cannot tell the target's input embedding: 2 tensors"):
        head_names(["model.embed_tokens.weight", "mtp.embed_tokens.weight"], tied=True)
    with pytest.raises(EyasError, match="not tied to its embedding"):
        head_names(["model.embed_tokens.weight", "model.norm.weight"], tied=False)
    # a numbered layer's (a multi-token-prediction layer's) own embedding and head are not the target's
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.61.embed_tokens.weight",
             "model.layers.61.shared_head.head.weight", "model.visual.merger.norm.weight"]
    assert head_names(names, tied=False) == ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def _losses(run: Path) -> list[float]:
    rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r] + [r["val_al"] for r in rows if "val_al" in r]


@pytest.mark.parametrize("kind", ["tiny", "gemma3"])
def test_training_on_stored_features_holds_only_the_head(kind, tmp_path, tokenizer_dir, monkeypatch):
    """With stored features (and no greedy validation answers to make) the trainer reads the target's embedding,
    final norm and head from its files and never loads the whole model: summary.json's target_bytes_held is those
    tensors' bytes. Its losses equal those of the same training given the whole target (what it held before), for
    the tiny preset and a sharded Gemma 3 whose text model sits under text_config."""
    from eyas.data.prepare import run_tokenize
    from eyas.features import run_extract
    from eyas.target import load_target
    from eyas.train import run_train
    from eyas.vocab import run_vocab

    name = "tiny" if kind == "tiny" else str(save_target(gemma3(49152), tmp_path / "g3", tokenizer_dir, shard="2MB"))
    base = tmp_path / "base"

    def cfg(run: Path):
        return resolve(preset_name="tiny", overrides={
            "out": str(run), "target.name": name, "target.device": "cpu", "target.dtype": "float32",
            "data.source": str(write_chats(tmp_path / "chats.jsonl", 16)), "data.limit": 0, "data.test_ratio": 0.0,
            "train.val_ratio": 0.25, "train.online": False, "train.greedy_val": 0, "train.max_steps": 2,
            "train.eval_every": 2, "train.batch_tokens": 256, "vocab.draft_vocab_size": 256})

    whole = load_target(cfg(base).target)
    run_tokenize(cfg(base))
    run_vocab(cfg(base))
    run_extract(cfg(base), whole)
    runs = {}
    for held in ("head", "whole"):
        runs[held] = tmp_path / held
        shutil.copytree(base, runs[held])
    run_train(cfg(runs["whole"]), whole)
    with monkeypatch.context() as m:
        no_model_loads(m)
        summary = run_train(cfg(runs["head"]))
    H, V = whole.hidden_size, whole.vocab_size
    assert summary["target_held"] == "head" and summary["target_bytes_held"] == 4 * (V * H + H)  # tied: one matrix
    saved = json.loads((runs["head"] / "train" / "summary.json").read_text())
    assert saved["target_bytes_held"] == summary["target_bytes_held"]
    assert json.loads((runs["whole"] / "train" / "summary.json").read_text())["target_bytes_held"] == sum(
        p.numel() * 4 for p in whole.model.parameters())
    head_losses, whole_losses = _losses(runs["head"]), _losses(runs["whole"])
    assert len(head_losses) >= 3 and head_losses == whole_losses


def qwen2_5_vl(vocab: int):
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    rope = dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=10000.0)
    conf = AutoConfig.for_model("qwen2_5_vl", text_config=dict(vocab_size=vocab, rope_parameters=rope, **SMALL),
                                vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                                   out_hidden_size=32))
    return Qwen2_5_VLForConditionalGeneration(conf)


@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl"])
def test_wrappers_outside_causal_lm_load_whole_and_capture(kind, tmp_path, tokenizer_dir):
    """LLaVA and Qwen2.5-VL targets, which AutoModelForCausalLM does not map, load whole through
    AutoModelForImageTextToText: the capture's aux states are the text model's hidden states and its final state
    gives the model's logits."""
    from eyas.target import load_target

    folder = save_target({"llava": llava, "qwen2_5_vl": qwen2_5_vl}[kind](512), tmp_path / kind, tokenizer_dir)
    t = load_target(TargetConfig(name=str(folder), device="cpu", dtype="float32", aux_layers=[1, 3, 4]))
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (6, 32, 512)
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    aux, final = t.capture(ids)
    out = t.model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(aux, torch.cat([out.hidden_states[i] for i in (1, 3, 4)], -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t.lm_head()(final), out.logits, rtol=1e-5, atol=1e-5)


def test_spec_is_the_loaded_targets_description(smol, tiny):
    """The description of the presets says what the loaded target says: same identity (so existing runs, their
    features and checkpoints stay theirs), tokens that end a turn, chat template; and it cannot be changed."""
    import dataclasses

    for t in (smol, tiny):
        spec = load_spec(TargetConfig(name=t.name, device="cpu"))
        assert spec.identity() == t.identity() and spec.eot_token_ids == t.eot_token_ids
        assert spec.has_chat_template and spec.describe()["parameters"] == t.describe()["parameters"]
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.sha256 = "other"


def test_a_quantized_head_is_refused(tmp_path, tokenizer_dir):
    from safetensors.torch import load_file, save_file

    folder = save_target(llama(512, tied=True), tmp_path / "q", tokenizer_dir, shard="10GB")
    sd = load_file(folder / "model.safetensors")
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"].to(torch.float8_e4m3fn)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(EyasError, match=r"model.embed_tokens.weight is stored as float8_e4m3fn, a quantized"):
        load_target_head(TargetConfig(name=str(folder), device="cpu"))


@pytest.mark.parametrize("kind", ["llama_untied", "llava", "llama_tied"])
def test_draft_rows_equal_the_heads_rows(kind, tmp_path, tokenizer_dir, monkeypatch):
    """The draft vocabulary's rows of the output layer, read from a sharded checkpoint through safetensors slices
    (in one read or many small ones), equal the model's own rows, and only they are held beside the embedding and
    norm: the whole layer is never read. A tied head is the embedding, held anyway: nothing more is read."""
    from eyas.target_head import HeadRows, read_rows, tensor_files

    model = {"llama_untied": lambda: llama(512, False), "llava": lambda: llava(512),
             "llama_tied": lambda: llama(512, True)}[kind]()
    folder = save_target(model, tmp_path / kind, tokenizer_dir)
    no_model_loads(monkeypatch)
    head = load_target_head(TargetConfig(name=str(folder), device="cpu", dtype="float32"))
    ids = torch.tensor(sorted({0, 1, 2, 3, 40, 41, 77, 300, 301, 302, 480, 511}))
    W = model.get_output_embeddings().weight.detach()
    rows = head.lm_head_rows(ids)
    if kind == "llama_tied":
        assert rows is head.embed_tokens() or rows.weight is head.embed_tokens().weight
        assert head.bytes_held() == 4 * (512 * 32 + 32)
        return
    assert isinstance(rows, HeadRows) and torch.equal(rows.ids, ids) and rows.vocab_size == 512
    assert torch.equal(rows.weight, W[ids]) and rows.bias is None
    assert head.lm_head_rows(ids.clone()) is rows  # read once
    assert head.bytes_held() == 4 * (512 * 32 + 32 + ids.numel() * 32)  # embedding, norm, the rows: no whole head
    files = tensor_files(folder)
    for chunk in (1, 3 * 32 * 4, 1 << 30):  # a span per row, spans of 3 rows, one span
        torch.testing.assert_close(read_rows(files, head.names[2], ids, torch.float32, torch.device("cpu"), chunk),
                                   W[ids], rtol=0, atol=0)
    torch.testing.assert_close(head.lm_head().weight, W, rtol=0, atol=0)  # asked for whole: read whole, rows let go
    assert head.bytes_held() == 4 * (2 * 512 * 32 + 32)


def test_row_spans_cover_the_ids_in_bounded_reads():
    from eyas.target_head import row_spans

    ids = [0, 1, 2, 5, 40, 41, 100]
    assert row_spans(ids, max_rows=1000, gap=4) == [(0, 6), (40, 42), (100, 101)]
    assert row_spans(ids, max_rows=2, gap=4) == [(0, 2), (2, 3), (5, 6), (40, 42), (100, 101)]
    assert row_spans(ids, max_rows=1000, gap=1000) == [(0, 101)]


def test_labels_from_rows_alone_need_the_stored_top_token():
    """The labels from the draft vocabulary's rows equal those from the whole layer (the same rows, the same
    product); without the target's top token, which the rows cannot give, they are refused in words."""
    from eyas.target_head import HeadRows
    from eyas.train.ttt import target_labels

    torch.manual_seed(0)
    V, H = 50, 8
    full = torch.nn.Linear(H, V, bias=True)
    ids = torch.tensor([1, 4, 7, 20, 33, 49])
    rows = HeadRows(ids, full.weight.detach()[ids], full.bias.detach()[ids], V)
    final = torch.randn(10, H)
    top = full(final).argmax(-1).to(torch.int32)
    top[:3] = ids[torch.tensor([0, 2, 5])].to(torch.int32)  # some top tokens inside the draft vocabulary
    a, b = target_labels(final, full, ids, top=top), target_labels(final, rows, ids, top=top)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.draft_idx, b.draft_idx)
    assert b.draft_idx[:3].tolist() == [0, 2, 5]
    with pytest.raises(EyasError, match="do not carry the target's top token"):
        target_labels(final, rows, ids)


def _drop_top(features: Path) -> None:
    """Rewrite a split's stored feature shards as extraction wrote them before it stored the target's top token."""
    from safetensors.torch import load_file, save_file

    from eyas.util import sha256_file

    index = json.loads((features / "index.json").read_text())
    for e in index["shards"]:
        f = features / e["file"]
        sd = load_file(f)
        del sd["top"]
        save_file(sd, f)
        e["bytes"], e["sha256"] = f.stat().st_size, sha256_file(f)
    (features / "index.json").write_text(json.dumps(index))


def test_training_on_stored_features_holds_the_draft_rows(tmp_path, tokenizer_dir, monkeypatch):
    """An untied sharded target, stored features: the trainer holds the embedding, the final norm and the draft
    vocabulary's rows of lm_head (summary.json's target_bytes_held counts exactly those), and its losses and
    validation are bit-identical to training given the whole target: the labels multiply the same final states by
    the same rows (W[draft_ids] read from the file instead of gathered from the whole W) and take the argmax from
    the same stored top tokens. Features stored without the top token (an older extraction) make it read the whole
    layer to compute it, with the same losses. The drafter's head starts from the target's rows (train.init_head)."""
    from eyas.data.prepare import run_tokenize
    from eyas.features import run_extract
    from eyas.target import load_target
    from eyas.train import run_train
    from eyas.vocab import run_vocab

    name = str(save_target(llama(49152, tied=False), tmp_path / "untied", tokenizer_dir, shard="2MB"))
    base, V_d = tmp_path / "base", 256

    def cfg(run: Path):
        return resolve(preset_name="tiny", overrides={
            "out": str(run), "target.name": name, "target.device": "cpu", "target.dtype": "float32",
            "target.aux_layers": [1, 3, 4], "data.source": str(write_chats(tmp_path / "chats.jsonl", 16)),
            "data.limit": 0, "data.test_ratio": 0.0, "train.val_ratio": 0.25, "train.online": False,
            "train.greedy_val": 0, "train.max_steps": 2, "train.eval_every": 2, "train.batch_tokens": 256,
            "train.init_head": True, "vocab.draft_vocab_size": V_d})

    whole = load_target(cfg(base).target)
    run_tokenize(cfg(base))
    run_vocab(cfg(base))
    run_extract(cfg(base), whole)
    runs = {}
    for held in ("rows", "whole", "old"):
        runs[held] = tmp_path / held
        shutil.copytree(base, runs[held])
    for split in ("train", "val"):
        _drop_top(runs["old"] / "features" / split)
    run_train(cfg(runs["whole"]), whole)
    with monkeypatch.context() as m:
        no_model_loads(m)
        summary = run_train(cfg(runs["rows"]))
        old = run_train(cfg(runs["old"]))
    H, V = whole.hidden_size, whole.vocab_size
    assert summary["target_held"] == "head" and summary["target_bytes_held"] == 4 * (V * H + H + V_d * H)
    assert old["target_bytes_held"] == 4 * (2 * V * H + H)
    losses = _losses(runs["whole"])
    assert len(losses) >= 3 and _losses(runs["rows"]) == losses and _losses(runs["old"]) == losses


def test_draft_rows_carry_the_heads_bias(tmp_path, tokenizer_dir):
    """An output layer with a bias: its rows come with the bias's same entries, the whole layer with all of it."""
    from safetensors.torch import load_file, save_file

    folder = save_target(llama(512, tied=False), tmp_path / "b", tokenizer_dir, shard="10GB")
    sd = load_file(folder / "model.safetensors")
    sd["lm_head.bias"] = torch.randn(512)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    head = load_target_head(TargetConfig(name=str(folder), device="cpu", dtype="float32"))
    ids = torch.tensor([3, 9, 10, 500])
    rows = head.lm_head_rows(ids)
    assert torch.equal(rows.weight, sd["lm_head.weight"][ids]) and torch.equal(rows.bias, sd["lm_head.bias"][ids])
    assert head.bytes_held() == 4 * (512 * 32 + 32 + 4 * 32 + 4)
    assert torch.equal(head.lm_head().bias, sd["lm_head.bias"])
