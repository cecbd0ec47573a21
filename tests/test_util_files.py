"""Disk and files: a write that fails for want of space ends in one line naming the file, the space needed and free,
and leaves nothing half-written; an --out under a file, a target's weights cut short and a target that needs its own
code are refused in one line."""
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from eyas.util import EyasError, atomic_path, atomic_write_json

ROOT = Path(__file__).resolve().parents[1]
# what safetensors' writer raises when the disk fills under it (read from a full tmpfs)
FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def env():
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.startswith("."))


def test_a_full_disk_is_named_with_the_file_and_the_space(tmp_path, monkeypatch):
    """An OSError of a full disk carries no file name when a write or fsync raises it: the message named an empty
    path. Now the file, the space it needed and what is free, the old file kept and no temporary left."""
    from eyas.util import write_error

    target = tmp_path / "run" / "state.json"
    atomic_write_json(target, {"old": True})

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(EyasError, match=rf"^{target}: not written, the disk is full \(about 1\d B needed, [\d.]+ [KMGT]?B "
                                        rf"free on {tmp_path / 'run'}\); nothing half-written is left"):
        atomic_write_json(target, {"new": 1})
    assert json.loads(target.read_text()) == {"old": True} and leftovers(tmp_path) == []
    # safetensors says so only in its message: read there
    weights = tmp_path / "run" / "model.safetensors"
    with pytest.raises(EyasError, match=rf"^{weights}: not written, the disk is full \(about 2.0 KB needed"):
        with atomic_path(weights, needed=2000) as tmp:
            tmp.write_bytes(b"half")
            raise SafetensorError(FULL)
    assert not weights.exists() and leftovers(tmp_path) == []
    quota = write_error(weights, OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert "the disk quota is used up" in str(quota)
    assert write_error(weights, OSError(errno.EIO, "Input/output error")) is None  # not the user's to fix: raised
    assert write_error(weights, SafetensorError("Error while serializing: invalid tensor")) is None


def test_out_under_a_file_is_refused_in_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    for cmd in ("train", "export"):
        r = subprocess.run([sys.executable, "-m", "eyas", cmd, "--preset", "tiny", "--out", str(tmp_path / "afile" /
                            "run")], env=env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.strip() == (
            f"eyas: error: {tmp_path / 'afile' / 'run'}: cannot be written: {tmp_path / 'afile'} is a file, not a "
            f"folder; give an --out whose folders are folders (made where missing)"), r.stderr[-2000:]


@pytest.fixture
def target_folder(tmp_path, tiny):
    """A transformers model folder: a small random Llama with the tiny preset's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    c = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=tiny.vocab_size)
    folder = tmp_path / "target"
    AutoModelForCausalLM.from_config(c).save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    return folder


def test_a_target_whose_weights_are_cut_short_is_named(target_folder):
    from eyas.config import TargetConfig
    from eyas.target import load_target

    weights = target_folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(EyasError, match=rf"^{weights}: the target's weights cannot be read \({len(data) // 2:,} "
                                        r"bytes\): .*; the file is cut short or damaged: copy or download the "
                                        r"target's weights again$"):
        load_target(TargetConfig(name=str(target_folder), device="cpu"))


def test_a_target_that_needs_its_own_code_names_eyas_flag(target_folder):
    """transformers' advice names its own argument (trust_remote_code=True); an eyas user passes a flag."""
    from eyas.config import TargetConfig
    from eyas.target import load_target

    cfg = json.loads((target_folder / "config.json").read_text())
    cfg |= {"model_type": "mycustom", "architectures": ["MyModel"],
            "auto_map": {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModel"}}
    (target_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EyasError) as e:
        load_target(TargetConfig(name=str(target_folder), device="cpu"))
    said = str(e.value)
    assert "pass --trust-remote-code (or --set target.trust_remote_code=true)" in said
    assert "trust_remote_code=True" not in said and "auto_map" in said


def test_disk_full_while_saving_a_drafter_or_an_export_keeps_the_old_one(tiny, tmp_path, monkeypatch):
    """The drafter's two files are written in full before either replaces the folder's own, and an export's folder
    is swapped in whole: a full disk leaves the old drafter and the old export as they were, nothing beside them."""
    import safetensors.torch as st

    from eyas.draft import build_drafter, load_drafter, save_drafter
    from eyas.export import export_drafter

    torch.manual_seed(0)
    old = build_drafter(tiny, 256)
    save_drafter(old, tmp_path / "draft", extra={"trained": {"step": 1}})
    export_drafter(old, tmp_path / "export" / "vllm", "vllm", "tiny")
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    torch.manual_seed(1)
    new = build_drafter(tiny, 256)
    real = st.save_file

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # what a writer leaves when the disk fills under it
        raise SafetensorError(FULL)

    monkeypatch.setattr(st, "save_file", full)
    monkeypatch.setattr("eyas.draft.save_file", full)  # the drafter's module holds its own name for the writer
    with pytest.raises(EyasError, match=rf"^{tmp_path / 'draft' / 'model.safetensors'}: not written, the disk is full "
                                        r"\(about [\d.]+ KB needed"):
        save_drafter(new, tmp_path / "draft", extra={"trained": {"step": 2}})
    with pytest.raises(EyasError, match=rf"^{tmp_path / 'export' / 'vllm' / 'model.safetensors'}: not written, the "
                                        r"disk is full"):
        export_drafter(new, tmp_path / "export" / "vllm", "vllm", "tiny")
    monkeypatch.setattr(st, "save_file", real)
    monkeypatch.setattr("eyas.draft.save_file", real)
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
    back = load_drafter(tmp_path / "draft", tiny)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in old.trainable_state_dict().items())


def test_a_fallback_names_the_eyas_line_it_failed_at():
    """compile_failure, the one line the graphed and compiled paths log when they fall back to eager: the
    exception, its first line, and for a graph capture the innermost eyas line the error passed through, so a GPU
    log says where."""
    import torch

    from eyas.engine.fastlm import FastLM
    from eyas.util import compile_failure

    try:
        FastLM.forward(None, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1))
    except Exception as e:  # noqa: BLE001
        line = compile_failure(e, where=True)
        assert compile_failure(e) == line.rsplit(" (at ", 1)[0]  # the compiled paths' log: no location
    assert line.startswith("AttributeError: ") and "\n" not in line
    assert line.endswith(")") and "(at fastlm.py:" in line and " in " in line.rsplit("(at ", 1)[1]
    try:
        raise ValueError("first\nsecond")
    except ValueError as e:  # raised here, in the tests: no eyas frame, no location
        assert compile_failure(e, where=True) == "ValueError: first"


def test_a_fallback_names_the_eyas_line_that_called_the_failing_one(tiny, monkeypatch):
    """A failure inside a small eyas helper (FastLM's _norm, which runs every norm) names the helper's line and the
    line that called it: which norm failed."""
    import torch

    import eyas.engine.fastlm
    from eyas.engine.fastlm import FastLM
    from eyas.util import compile_failure

    lm = FastLM(tiny.model, 1, 16)

    def fail(*a, **kw):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(eyas.engine.fastlm, "llama_rms_norm", fail)
    try:
        lm.forward(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    except RuntimeError as e:
        line = compile_failure(e, where=True)
    assert " in _norm, from fastlm.py:" in line and line.endswith(" in _forward)"), line
