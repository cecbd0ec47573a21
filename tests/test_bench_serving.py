"""The serving bench scripts: bench/stage_vllm.py's pieces reassemble into the same wheels (the slimmed vLLM wheel
installable, its RECORD without the dropped files), and bench/bench_serving.py counts an OpenAI-compatible server's
completion tokens at each concurrency."""
import hashlib
import http.server
import json
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_serving  # noqa: E402
import stage_vllm  # noqa: E402


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
    slim = stage_vllm.slim(_fake_wheel(tmp_path / "vllm-9-cp38-abi3-linux_x86_64.whl"), tmp_path / "out")
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
    sizes = stage_vllm.pack({"vllm-wheels/big.whl": big, "vllm-wheels/small.whl": small}, tmp_path / "st", 1)
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
    stage_vllm.pack({"vllm-wheels/w.whl": f}, tmp_path / "st", 1)
    piece = next((tmp_path / "st" / "01").glob("*.piece"))
    piece.write_bytes(b"X" + piece.read_bytes()[1:])
    for i in (0, 1):
        r = subprocess.run(["bash", str(tmp_path / "st" / f"{i:02d}" / "unpack.sh"), str(tmp_path / "dest")],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "sha256" in r.stderr
    assert not (tmp_path / "dest" / "vllm-wheels" / "w.whl").exists()


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
