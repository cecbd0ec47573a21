"""bench/interop_specforge.py: eyas' SGLang export read and run by SpecForge's own EAGLE-3 draft model
(LlamaForCausalLMEagle3, its warm start and TTT loop), and SpecForge's SGLang export read back by eyas, where SpecForge
can be imported. SpecForge pins sglang and a
CUDA torch, so it lives in a virtualenv of its own (the script's docstring says how): EYAS_SPECFORGE_PYTHON names
that virtualenv's python; without it, or where it cannot import specforge, these tests are skipped."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _specforge_python() -> str | None:
    for py in (os.environ.get("EYAS_SPECFORGE_PYTHON"), sys.executable):
        if py and subprocess.run([py, "-c", "import specforge"], capture_output=True, timeout=120).returncode == 0:
            return py
    return None


@pytest.fixture(scope="module")
def specforge_python():
    py = _specforge_python()
    if py is None:
        pytest.skip("specforge is not importable (set EYAS_SPECFORGE_PYTHON to a python that imports it)")
    return py


def _interop(py: str, tmp_path: Path, rope: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    got = subprocess.run([py, str(ROOT / "bench" / "interop_specforge.py"), "--target", "tiny", "--rope", rope,
                          "--out", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    rows = json.loads((tmp_path / "interop.json").read_text())["rows"] if (tmp_path / "interop.json").exists() else []
    return got, rows


@pytest.mark.slow
def test_sglang_export_computes_in_specforge_what_eyas_computes(specforge_python, tmp_path):
    got, rows = _interop(specforge_python, tmp_path, "default")
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert rows and all(r["status"] == "PASS" for r in rows)
    sections = {r["section"] for r in rows}
    assert {"config", "weights sglang/", "d2t/t2d", "forward sglang/ sdpa", "forward sglang/ flex_attention",
            "forward sglang-emb/ sdpa", "import specforge-export/"} <= sections


# each rope kind eyas exports: SpecForge computes the same (linear, llama3; yarn once the two mscale settings it
# needs are given), builds another table (dynamic) or has none (longrope): the last three are SpecForge-side rows
KNOWN = {"linear": None, "llama3": None, "yarn": "load", "dynamic": "config", "longrope": "load"}


@pytest.mark.slow
@pytest.mark.parametrize("rope", list(KNOWN))
def test_every_rope_kind_eyas_exports(specforge_python, tmp_path, rope):
    got, rows = _interop(specforge_python, tmp_path, rope)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert not [r for r in rows if r["status"] == "FAIL"]
    known = [r for r in rows if r["status"] == "KNOWN"]
    if KNOWN[rope] is None:
        assert not known
    else:
        assert known and known[0]["section"] == KNOWN[rope]
        if rope != "longrope":  # SpecForge runs it: the forward is compared, and eyas reads what SpecForge writes
            assert any(r["section"].startswith("forward") for r in rows)
            assert [r["status"] for r in rows if r["section"] == "import specforge-export/"] == ["PASS"] * 5
