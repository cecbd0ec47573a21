"""bench/gpu_run.sh, the GPU job runner: a job list run detached, its jobs logged with their exit codes, and the
results packed into $OUT; and every maintained bench script documents itself with --help."""
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "bench" / "gpu_run.sh"
SCRIPTS = ["bench_decode", "bench_train", "bench_regen", "bench_extract", "speculators_train", "interop_speculators",
           "interop_specforge", "profile_round", "random_target", "bench_serving", "stage_vllm", "stage_sglang"]


def runner(tmp_path: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, GPU_RUN_DIR=str(tmp_path / "r"), OUT=str(tmp_path / "out"),
               EYAS_STAGE_DIR=str(tmp_path / "stage"), HOME=str(tmp_path))
    return subprocess.run(["bash", str(RUNNER), *args], cwd=ROOT, env=env, input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_runner_runs_a_job_list_detached_and_collects_the_results(tmp_path):
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("# a comment, then a blank line\n\n"
                    "first   echo hello > $R/first.json && echo said hello\n"
                    "broken  echo about to fail; exit 3\n"
                    "last    echo still ran after the failure\n")
    got = runner(tmp_path, "start", str(jobs), "60")
    assert got.returncode == 0, got.stderr
    assert "all finished" in got.stdout
    log = (tmp_path / "r" / "runner.log").read_text()
    assert "end first rc=0" in log and "end broken rc=3" in log and "end last rc=0" in log
    assert log.index("start broken") < log.index("start last")
    with tarfile.open(tmp_path / "out" / "results.tgz") as t:
        names = set(t.getnames())
        assert {"first.json", "first.log", "broken.log", "last.log", "runner.log", "machine.txt"} <= names
        assert t.extractfile("first.json").read().decode() == "hello\n"  # $R expanded to the results folder
        assert "still ran" in t.extractfile("last.log").read().decode()
    again = runner(tmp_path, "poll", "5")  # a later call polls the same results
    assert again.returncode == 0 and "all finished" in again.stdout and "end last rc=0" in again.stdout


def test_runner_takes_a_list_on_standard_input(tmp_path):
    got = runner(tmp_path, "start", "-", "60", stdin="one echo from stdin\n")
    assert got.returncode == 0, got.stderr
    assert "end one rc=0" in (tmp_path / "r" / "runner.log").read_text()


def test_runner_refuses_what_it_cannot_do(tmp_path):
    missing = runner(tmp_path, "start", str(tmp_path / "nope.txt"))
    assert missing.returncode == 2 and "nope.txt not found" in missing.stderr
    assert not (tmp_path / "r" / "runner.log").exists()
    unknown = runner(tmp_path, "launch")
    assert unknown.returncode == 2 and "unknown command launch" in unknown.stderr
    polled = runner(tmp_path / "fresh", "poll", "1")
    assert polled.returncode == 2 and "nothing started" in polled.stderr
    unpack = runner(tmp_path, "unpack", str(tmp_path / "piece"))
    assert unpack.returncode == 2 and "unpack.sh not found" in unpack.stderr


def test_runner_documents_itself():
    got = subprocess.run(["bash", str(RUNNER), "--help"], capture_output=True, text=True, timeout=30)
    assert got.returncode == 0
    for word in ("unpack", "start", "poll", "stage.py", "$R"):
        assert word in got.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_scripts_document_themselves(script):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    got = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("usage:") and len(got.stdout.splitlines()) > 5
