"""The serving bench scripts: the staged pieces (bench/stage_wheels.py) reassemble into the same wheels, the slimmed
vLLM and sglang-kernel wheels keep their RECORD in step with the files they keep, the SGLang stage fetches a
package's requirements one level at a time without ever fetching the image's, bench/serve_sglang.sh starts SGLang
with the EAGLE-3 flags, and bench/bench_serving.py counts an OpenAI-compatible server's completion tokens at each
concurrency."""
import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_serving  # noqa: E402
import stage_sglang  # noqa: E402
import stage_vllm  # noqa: E402
import stage_wheels  # noqa: E402


def _fake_wheel(path: Path) -> Path:
    files = {"vllm/__init__.py": b"x = 1\n", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"\0" * 5000,
             "vllm/vllm-rs": b"\1" * 300, "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so": b"a",
             "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so": b"b"}
    record = "".join(f"{n},sha256=x,{len(d)}\n" for n, d in files.items()) + "vllm-9.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr("vllm-9.dist-info/RECORD", record)
    return path


def test_slimmed_wheel_drops_the_unneeded_kernels_and_their_record_lines(tmp_path):
    (tmp_path / "out").mkdir()
    slim = stage_wheels.slim(_fake_wheel(tmp_path / "vllm-9-cp38-abi3-linux_x86_64.whl"), tmp_path / "out",
                             stage_vllm.drop)
    with zipfile.ZipFile(slim) as z:
        names = set(z.namelist())
        record = z.read("vllm-9.dist-info/RECORD").decode()
    assert names == {"vllm/__init__.py", "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so",
                     "vllm-9.dist-info/RECORD"}
    assert "fa2" not in record and "vllm-rs" not in record and "cpython-311" not in record
    assert "vllm/__init__.py" in record and "cpython-312" in record


def test_pieces_reassemble_byte_for_byte_in_any_order(tmp_path):
    big = tmp_path / "big.whl"
    big.write_bytes(bytes(range(256)) * 9000)  # 2.2 MiB: split over pieces of 1 MiB
    small = tmp_path / "small.whl"
    small.write_bytes(b"small")
    sizes = stage_wheels.pack({"vllm-wheels/big.whl": big, "vllm-wheels/small.whl": small}, tmp_path / "st", 1)
    assert len(sizes) == 3 and max(sizes) <= 1 << 20
    dest = tmp_path / "dest"
    for i in (2, 0, 1):
        r = subprocess.run(["bash", str(tmp_path / "st" / f"{i:02d}" / "unpack.sh"), str(dest)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert ("big.whl (" in r.stdout) == (i == 1), r.stdout  # the big file is ready once its last piece came
    for f in (big, small):
        got = dest / "vllm-wheels" / f.name
        assert hashlib.sha256(got.read_bytes()).digest() == hashlib.sha256(f.read_bytes()).digest()
    assert not list((dest / ".pieces").glob("*.piece"))


def test_a_damaged_piece_is_refused(tmp_path):
    f = tmp_path / "w.whl"
    f.write_bytes(b"0123456789" * 200_000)
    stage_wheels.pack({"vllm-wheels/w.whl": f}, tmp_path / "st", 1)
    piece = next((tmp_path / "st" / "01").glob("*.piece"))
    piece.write_bytes(b"X" + piece.read_bytes()[1:])
    for i in (0, 1):
        r = subprocess.run(["bash", str(tmp_path / "st" / f"{i:02d}" / "unpack.sh"), str(tmp_path / "dest")],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "sha256" in r.stderr
    assert not (tmp_path / "dest" / "vllm-wheels" / "w.whl").exists()


def _meta_wheel(folder: Path, name: str, version: str, requires: list[str], files: dict | None = None) -> Path:
    """A wheel of `name` whose METADATA lists `requires`, with `files` beside its RECORD."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    files = {**(files or {}), f"{dist}.dist-info/METADATA": meta.encode()}
    record = "".join(f"{n},sha256=x,{len(d)}\n" for n, d in files.items()) + f"{dist}.dist-info/RECORD,,\n"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return path


def _fake_index(tmp_path: Path, monkeypatch) -> list[tuple[list[str], bool]]:
    """A local stand-in for PyPI: pip_download copies the newest wheel that meets each requirement; the calls are
    recorded."""
    index = tmp_path / "index"
    _meta_wheel(index, "app", "1.0", ["lib[fast]>=1", "torch==2.11.0", "numpy", 'winonly; sys_platform == "win32"'])
    _meta_wheel(index, "lib", "1.0", ["numpy>=1"])
    _meta_wheel(index, "lib", "2.0", ["numpy>=1", 'accel; extra == "fast"', 'never; extra == "slow"'])
    _meta_wheel(index, "accel", "0.5", ["torch"])
    _meta_wheel(index, "wrapper", "1.0", ["pinned"])
    _meta_wheel(index, "pinned", "1.0", ["lib<1"])
    calls = []

    def download(pip, dest, reqs, prior_to, deps):
        calls.append((list(reqs), deps))
        dest.mkdir(parents=True, exist_ok=True)
        for text in reqs:
            r = Requirement(text)
            found = [w for w in index.glob("*.whl") if parse_wheel_filename(w.name)[0] == r.name
                     and r.specifier.contains(parse_wheel_filename(w.name)[1])]
            assert found, f"nothing meets {text}"
            best = max(found, key=lambda w: parse_wheel_filename(w.name)[1])
            (dest / best.name).write_bytes(best.read_bytes())

    monkeypatch.setattr(stage_wheels, "pip_download", download)
    return calls


def test_closure_fetches_requirements_level_by_level_and_never_the_images(tmp_path, monkeypatch):
    calls = _fake_index(tmp_path, monkeypatch)
    got, skipped = stage_wheels.closure(["pip"], tmp_path / "w", [Requirement("app==1.0")], {"torch", "numpy"}, None)
    assert {n: w.name for n, w in got.items()} == {"app": "app-1.0-py3-none-any.whl",
                                                   "lib": "lib-2.0-py3-none-any.whl",  # newest that meets >=1
                                                   "accel": "accel-0.5-py3-none-any.whl"}  # lib's extra "fast"
    assert all(deps is False for _, deps in calls)  # pip never resolves on its own, so it never fetches torch
    assert not any(r.startswith(("torch", "numpy", "winonly", "never")) for reqs, _ in calls for r in reqs)
    assert ("app", "torch==2.11.0") in {(by, str(r)) for by, r in skipped}
    assert ("accel", "torch") in {(by, str(r)) for by, r in skipped}


def test_closure_stops_on_a_version_that_does_not_meet_every_requirement(tmp_path, monkeypatch):
    _fake_index(tmp_path, monkeypatch)
    with pytest.raises(SystemExit, match="lib 2.0 does not meet lib<1"):
        stage_wheels.closure(["pip"], tmp_path / "w", [Requirement("app"), Requirement("wrapper")],
                             {"torch", "numpy"}, None)


def test_image_conflicts_are_the_known_versions_a_requirement_refuses():
    reqs = [Requirement(r) for r in ("tokenizers<=0.23.0,>=0.22.0", "torch==2.11.0", "numpy<2.4", "timm==1.0.16")]
    assert [str(r) for r in stage_wheels.image_conflicts(reqs)] == ["tokenizers<=0.23.0,>=0.22.0", "numpy<2.4"]


@pytest.mark.parametrize("fa3", [False, True])
def test_slimmed_sglang_kernel_keeps_the_hopper_build(tmp_path, fa3):
    files = {n: b"x" for n in ("sgl_kernel/__init__.py", "sgl_kernel/sm90/common_ops.abi3.so",
                               "sgl_kernel/sm100/common_ops.abi3.so", "sgl_kernel/flash_ops.abi3.so",
                               "sgl_kernel/flashmla_ops.abi3.so", "sgl_kernel/flash_attn.py",
                               "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so", "sgl_kernel/infllm_v2/a.py")}
    wheel = _meta_wheel(tmp_path / "in", "sglang-kernel", "0.4.5", ["torch"], files)
    (tmp_path / "out").mkdir()
    slim = stage_wheels.slim(wheel, tmp_path / "out", stage_sglang.kernel_drop(fa3))
    with zipfile.ZipFile(slim) as z:
        names = {n for n in z.namelist() if not n.startswith("sglang_kernel-")}
        record = {ln.split(",")[0] for ln in z.read("sglang_kernel-0.4.5.dist-info/RECORD").decode().splitlines()}
    kept = {"sgl_kernel/__init__.py", "sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/flash_attn.py",
            "sgl_kernel/infllm_v2/a.py"} | ({"sgl_kernel/flash_ops.abi3.so"} if fa3 else set())
    assert names == kept
    assert {n for n in record if not n.startswith("sglang_kernel-")} == kept


def _serve_sglang(tmp_path: Path, *args: str, port: int | None = None) -> subprocess.CompletedProcess:
    """bench/serve_sglang.sh with a stand-in python3 that records its arguments and answers /health on $PORT."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    fake = bin_ / "python3"
    fake.write_text(f"""#!/bin/sh
printf '%s\\n' "$@" > {tmp_path}/args.txt
env > {tmp_path}/env.txt
exec {sys.executable} -c '
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["SERVE_PORT"])), H).serve_forever()'
""")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", R=str(tmp_path / "r"), WAIT="30",
               EYAS_STAGE_DIR=str(tmp_path / "stage"), SGLANG_ARGS="--dtype bfloat16",
               SGLANG_SITE=str(tmp_path / "site"), SGLANG_TF=str(tmp_path / "tf"))
    if port:
        env.update(PORT=str(port), SERVE_PORT=str(port))
    return subprocess.run(["bash", str(ROOT / "bench" / "serve_sglang.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("fa3", [False, True])
def test_serve_sglang_starts_the_server_with_the_eagle3_flags(tmp_path, fa3):
    target, draft, site = tmp_path / "target", tmp_path / "draft", tmp_path / "site"
    target.mkdir()
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    (site / "sgl_kernel").mkdir(parents=True)
    (site / ".installed").touch()
    if fa3:
        (site / "sgl_kernel" / "flash_ops.abi3.so").touch()
    port = _free_port()
    got = _serve_sglang(tmp_path, "start", str(target), str(draft), "4", port=port)
    assert got.returncode == 0, got.stderr
    assert f"ready on port {port}" in got.stdout and "steps 4, topk 1, tokens 5" in got.stdout
    args = (tmp_path / "args.txt").read_text().split("\n")
    line = " ".join(args)
    assert args[:2] == ["-m", "sglang.launch_server"]
    assert (f"--model-path {target} --port {port}" in line and "--speculative-algorithm EAGLE3" in line
            and f"--speculative-draft-model-path {draft}" in line and "--speculative-num-steps 4" in line
            and "--speculative-eagle-topk 1" in line and "--speculative-num-draft-tokens 5" in line)
    assert ("--attention-backend triton" in line) == (not fa3)  # without FA3's kernels, SGLang's Triton ones
    assert line.rstrip().endswith("--dtype bfloat16")  # $SGLANG_ARGS last, so it overrides
    env = (tmp_path / "env.txt").read_text()
    assert "HF_HUB_OFFLINE=1" in env and f"PYTHONPATH={tmp_path / 'tf'}:{site}" in env
    stopped = _serve_sglang(tmp_path, "stop", port=port)
    assert stopped.returncode == 0 and not (tmp_path / "r" / f"sglang_{port}.pid").exists()


def test_serve_sglang_refuses_what_it_cannot_do(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("{}")
    missing = _serve_sglang(tmp_path, "start", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "nope not found" in missing.stderr
    tree = _serve_sglang(tmp_path, "start", str(target), str(tmp_path / "draft"), "4", "4")
    assert tree.returncode == 2 and "name TOKENS" in tree.stderr
    install = _serve_sglang(tmp_path, "install")
    assert install.returncode == 2 and "stage_sglang.py" in install.stderr
    helped = _serve_sglang(tmp_path, "--help")
    assert helped.returncode == 0 and "--speculative-num-steps" in helped.stdout


class _Server(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self._send({"data": [{"id": "served"}]})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(req)
        n = 0 if "fail" in req["messages"][-1]["content"] else min(req["max_tokens"], len(req["messages"][-1]["content"]))
        if n == 0:
            self.send_response(500)
            self.end_headers()
            return
        self._send({"choices": [{"message": {"content": "x" * n}}], "usage": {"completion_tokens": n}})

    def _send(self, obj):
        b = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)


def test_bench_serving_counts_completion_tokens_per_concurrency(tmp_path, monkeypatch):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    srv.seen = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    prompts = [[{"role": "user", "content": "a" * n}] for n in (5, 7, 9)] + [[{"role": "user", "content": "fail"}]]
    monkeypatch.setattr(bench_serving, "first_turns", lambda name, limit: prompts[:limit])
    out = tmp_path / "r.json"
    try:
        rc = bench_serving.main(["--endpoint", f"http://127.0.0.1:{srv.server_port}", "--limit", "4",
                                 "--concurrency", "1,3", "--max-tokens", "8", "--warmup", "1", "--out", str(out)])
    finally:
        srv.shutdown()
    res = json.loads(out.read_text())
    assert rc == 1  # a failed request is reported, not hidden
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 3]
    for lv in res["levels"]:
        assert lv["completion_tokens"] == 5 + 7 + 8 and lv["prompts"] == 3 and lv["error_count"] == 1
        assert lv["tokens_per_s"] > 0
    assert res["model"] == "served"
    assert all(r["model"] == "served" and r["temperature"] == 0.0 for r in srv.seen)
    assert srv.seen[0]["max_tokens"] == 16 and len(srv.seen) == 1 + 2 * 4  # the warm-up, then each level
