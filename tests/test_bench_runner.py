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
               GPU_RUN_SEND_DIR=str(tmp_path / "send"), EYAS_STAGE_DIR=str(tmp_path / "stage"), HOME=str(tmp_path))
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


def test_a_folder_sent_back_in_pieces_over_calls_is_taken_and_joined_whole(tmp_path):
    """send packs a device folder into 15 MiB pieces and hands back four a call (a call returns at most 64 MiB);
    the pieces, carried up again a few a call (take), join into the same files (join)."""
    draft = tmp_path / "dev" / "draft"
    draft.mkdir(parents=True)
    weights = os.urandom(70 * 1024 * 1024)  # random: gzip cannot shrink it below 5 pieces
    (draft / "model.safetensors").write_bytes(weights)
    (draft / "config.json").write_text("{}")
    first = runner(tmp_path, "send", str(draft))
    assert first.returncode == 0 and "send " + str(draft) + " 1 next" in first.stdout, first.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"draft.part0{i}.tgz" for i in range(4)]
    rest = runner(tmp_path, "send", str(draft), "1")
    assert "all 5 pieces sent" in rest.stdout
    for n, names in enumerate([[f"draft.part0{i}.tgz" for i in range(4)], ["draft.part04.tgz"]]):
        up = tmp_path / "up" / f"{n:02d}"
        up.mkdir(parents=True)
        for name in names:
            (up / name).write_bytes((tmp_path / "out" / name).read_bytes())
        assert runner(tmp_path, "take", str(up)).returncode == 0
    joined = runner(tmp_path, "join", "draft", str(tmp_path / "here"))
    assert joined.returncode == 0, joined.stderr
    assert (tmp_path / "here" / "draft" / "model.safetensors").read_bytes() == weights
    assert (tmp_path / "here" / "draft" / "config.json").read_text() == "{}"
    missing = runner(tmp_path, "join", "other", str(tmp_path / "here"))
    assert missing.returncode == 2 and "no pieces of other" in missing.stderr


def test_runner_documents_itself():
    got = subprocess.run(["bash", str(RUNNER), "--help"], capture_output=True, text=True, timeout=30)
    assert got.returncode == 0
    for word in ("unpack", "start", "poll", "send", "take", "join", "stage.py", "$R"):
        assert word in got.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_scripts_document_themselves(script):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    got = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("usage:") and len(got.stdout.splitlines()) > 5


def test_random_target_writes_a_cut_moe_shape_that_transformers_builds(tmp_path):
    """bench/random_target.py --shape-only: a Qwen3-30B-A3B-shaped config cut to one layer and 4 experts (the experts a
    token picks cut with them) is one transformers builds as that MoE, with the shape's vocabulary and widths."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path / "q30"
    got = subprocess.run([sys.executable, str(ROOT / "bench" / "random_target.py"), "--shape", "qwen3-30b-a3b",
                          "--layers", "1", "--experts", "4", "--shape-only", "--tokenizer", "tiny", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    conf = json.loads((out / "config.json").read_text())
    assert (conf["model_type"], conf["hidden_size"], conf["vocab_size"]) == ("qwen3_moe", 2048, 151936)
    cfg = AutoConfig.from_pretrained(out)
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (1, 4, 4)
    import torch

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and len(model.model.layers[0].mlp.experts.gate_up_proj) == 4
