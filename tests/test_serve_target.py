"""The target a run trained on, written as a transformers folder for the engines (eyas.serve_target): the real
SmolLM2 GGUF, dequantized by eyas, loads from that folder with transformers alone and computes the same logits as
eyas' own target; its tokenizer, chat template and end-of-turn tokens are eyas'; `eyas export` names the folder as
both exports' target."""
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from eyas.config import Config, TargetConfig
from eyas.draft import build_drafter, save_drafter
from eyas.export import run_export
from eyas.serve_target import MARKER, needs_folder, write_target_folder
from eyas.util import EyasError

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit, then a colour."},
        {"role": "assistant", "content": "Apple. Green.\nBoth <b>are</b> fine: 1 + 2 = 3, naïve café."}]


def test_smollm2_folder_serves_the_weights_eyas_trained_on(smol, tmp_path):
    out = write_target_folder(TargetConfig(name="smollm2"), tmp_path / "target")
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", MARKER} <= \
        {p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = smol.tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    ids = torch.tensor(ids)[None]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, smol.model(ids).logits)

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == smol.tokenizer.chat_template
    for add in (False, True):
        assert tok.apply_chat_template(CHAT, add_generation_prompt=add, tokenize=False) == \
            smol.tokenizer.apply_chat_template(CHAT, add_generation_prompt=add, tokenize=False)
    text = smol.tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert tok(text).input_ids == smol.tokenizer(text).input_ids
    assert tok.decode(ids[0]) == smol.tokenizer.decode(ids[0])
    # the engines stop where eyas ends a turn: at SmolLM2's EOS as its GGUF names it (eyas.gguf_tokenizer)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert smol.tokenizer.eos_token == "<|im_end|>" and smol.eot_token_ids == [im_end]
    assert tok.eos_token == "<|im_end|>"
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == smol.eot_token_ids[0]
    marker = json.loads((out / MARKER).read_text())
    assert marker["target"] == "smollm2" and marker["sha256"] == smol.sha256
    assert marker["eos_token_ids"] == smol.eot_token_ids


def test_export_names_the_target_folder_in_both_formats(tiny, tmp_path):
    torch.manual_seed(0)
    save_drafter(build_drafter(tiny, 512, draft_ids=torch.randperm(tiny.vocab_size)[:512].sort().values),
                 tmp_path / "draft")
    cfg = Config()
    cfg.out, cfg.target.name = str(tmp_path), "tiny"
    res = run_export(cfg)
    folder = (tmp_path / "export" / "target").resolve()
    assert res["serve_target"] == str(folder)
    vllm = json.loads((tmp_path / "export" / "vllm" / "config.json").read_text())
    sglang = json.loads((tmp_path / "export" / "sglang" / "config.json").read_text())
    assert vllm["speculators_config"]["verifier"]["name_or_path"] == str(folder)
    assert vllm["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert vllm["eyas"]["serve_target"] == sglang["eyas"]["serve_target"] == str(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ids = torch.randint(0, tiny.vocab_size, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny.model(ids).logits)
    from eyas.util import FILE_MODE

    assert (folder / "model.safetensors").stat().st_mode & 0o777 == FILE_MODE  # an engine run as another user reads it
    run_export(cfg)  # written again over its own earlier folder

    cfg.export.target_folder = False  # named by the preset's name instead, the folder left as it is
    res = run_export(cfg)
    assert res["serve_target"] == "tiny" and (folder / MARKER).exists()


def test_target_folder_only_for_targets_eyas_builds_and_never_over_a_foreign_folder(tmp_path):
    assert needs_folder(TargetConfig(name="smollm2")) and needs_folder(TargetConfig(name="tiny"))
    assert needs_folder(TargetConfig(name=str(tmp_path / "m.gguf")))
    assert not needs_folder(TargetConfig(name=str(tmp_path))) and not needs_folder(TargetConfig(name="org/model"))
    foreign = tmp_path / "target"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(EyasError, match=r"target: exists and is not a target folder eyas wrote .*"
                                        r"export.target_folder=false"):
        write_target_folder(TargetConfig(name="tiny"), foreign)
    assert (foreign / "notes.txt").read_text() == "mine" and not (foreign / MARKER).exists()
    assert not list(Path(tmp_path).glob(".target.*"))  # nothing left beside it


def test_target_folder_copies_where_it_cannot_link(tmp_path, monkeypatch):
    """Across file systems (no hard link to eyas' cache) the weights are copied, byte for byte."""
    import os

    from eyas.target import resolve_source

    def no_link(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    out = write_target_folder(TargetConfig(name="tiny"), tmp_path / "target")
    source = Path(resolve_source(TargetConfig(name="tiny"))[0])
    copied, cached = out / "model.safetensors", source / "model.safetensors"
    assert copied.stat().st_ino != cached.stat().st_ino and copied.read_bytes() == cached.read_bytes()
