"""`eyas run` end to end on the real SmolLM2 target at tiny scale: the report, skipping, kill + resume."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ARGS = [
    "--preset", "smollm2", "--set", "target.device=cpu", "--set", "target.dtype=float32",
    "--set", "regen.limit=8", "--set", "regen.turns=1", "--set", "regen.max_new_tokens=48",
    "--set", "regen.temperature=0", "--set", "data.max_seq_len=320", "--set", "data.extra_original=0",
    "--set", "vocab.draft_vocab_size=2048",
    "--set", "train.online=false", "--set", "train.epochs=12", "--set", "train.batch_tokens=1024",
    "--set", "train.lr=3e-3", "--set", "train.save_every=4", "--set", "train.eval_every=12",
    "--set", "train.val_ratio=0.15",
    "--set", "eval.limit=2", "--set", "eval.max_new_tokens=24", "--set", "eval.k=3",
    "--set", "eval.prompts=sharegpt", "--set", "eval.turns=1",
]


def eyas(out: Path, *extra, **kw):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "eyas", "run", "--out", str(out), *ARGS, *extra],
                          capture_output=True, text=True, env=env, **kw)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, smol):
    out = tmp_path_factory.mktemp("e2e") / "run"
    r = eyas(out, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def test_report_tau_and_lossless(full_run):
    out, r = full_run
    rep = json.loads((out / "eval" / "report.json").read_text())
    assert rep["lossless"] is True
    assert rep["acceptance_length"] > 1.0, rep["per_position_acceptance"]
    md = (out / "report.md").read_text()
    for section in ("## Result", "## Stages", "## Data", "## Vocabulary", "## Training"):
        assert section in md
    first = rep["by_turn"]["1"]  # the eval's splits of τ are on the page too
    assert f"answer 1: {first['acceptance_length']:.2f} ({first['answers']} answers)" in md
    assert "τ by how much the answer repeats itself" in md
    best = json.loads((out / "train" / "summary.json").read_text())["best"]  # the forecast on greedy answers
    assert f"τ forecast {best['greedy_tau']:.2f} over {best['greedy_rounds']} decoding rounds" in md
    man = json.loads((out / "manifest.json").read_text())
    assert [s for s, v in man["stages"].items() if v["status"] == "done"] == \
        ["regen", "tokenize", "vocab", "extract", "train", "eval", "export"]
    assert (out / "eyas.toml").exists() and (out / "export" / "sglang" / "config.json").exists()
    for stage in ("regen", "train", "eval"):  # one line per stage as it finishes
        assert f"[{stage}] done" in r.stderr
    assert (f"eyas run: {out}; τ {rep['acceptance_length']:.3f} at K=3, {rep['speedup']:.2f}x plain decoding, "
            f"lossless; drafter for sglang and vllm in {out / 'export'}, its target in {out / 'export' / 'target'}; "
            f"report {out / 'report.md'}") in r.stderr
    vllm = json.loads((out / "export" / "vllm" / "config.json").read_text())  # the weights it trained on, to serve
    assert vllm["speculators_config"]["verifier"]["name_or_path"] == str((out / "export" / "target").resolve())
    by = best["by"]  # and training's own last line says which drafter it kept
    assert f"{out / 'draft'} holds the best, step {best['step']} by {by} {best[by]:.3f}" in r.stderr
    lo, hi = rep["acceptance_length_ci95"]  # τ's interval over the eval's two conversations, on the page and the line
    assert lo <= rep["acceptance_length"] <= hi and f"({lo:.2f}-{hi:.2f}) | 3 |" in md
    assert f"acceptance_length_ci95={lo:.3g}-{hi:.3g}" in r.stderr


def test_second_run_skips_every_stage(full_run):
    """Run again with no settings at all: the run directory remembers the preset and settings it was given, sizes
    the rest to this machine as before, and so finds every stage done."""
    out, _ = full_run
    before = {p: p.stat().st_mtime_ns for p in (out / "draft").iterdir()}
    r = subprocess.run([sys.executable, "-m", "eyas", "run", "--out", str(out)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "settings: the run's own" in r.stderr
    assert f"eyas run: {out}; τ " in r.stderr  # the closing line, from the eval's report, with every stage skipped
    for stage in ("regen", "tokenize", "vocab", "extract", "train", "eval", "export"):
        assert f"[{stage}] unchanged, skipped" in r.stderr
    assert before == {p: p.stat().st_mtime_ns for p in (out / "draft").iterdir()}


def test_changed_stage_reruns_it_and_what_follows(full_run, tmp_path):
    out, _ = full_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    r = eyas(copy, "--set", "eval.max_new_tokens=16", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[train] unchanged, skipped" in r.stderr and "[eval] done" in r.stderr and "[export] done" in r.stderr
    # a standalone eval with other settings writes over the run's eval: the next run makes the run's own again
    from eyas.cli import main

    # a standalone command refused before it wrote anything leaves the run's stages as they were
    assert main(["eval", "--out", str(copy), "--turns", "-1"]) == 2
    assert main(["train", "--out", str(copy), "--seed", "7"]) == 2  # a checkpoint of another training run
    statuses = {n: v["status"] for n, v in json.loads((copy / "manifest.json").read_text())["stages"].items()}
    assert statuses["train"] == statuses["eval"] == statuses["export"] == "done"
    assert main(["eval", "--out", str(copy), "--max-new-tokens", "8"]) == 0
    assert json.loads((copy / "eval" / "report.json").read_text())["max_new_tokens"] == 8
    assert main(["report", str(copy)]) == 0  # the page says whose eval it shows
    md = (copy / "report.md").read_text()
    assert "This eval was written by a standalone `eyas eval` after the run" in md
    assert "| eval | replaced by a standalone `eyas eval` (the next `eyas run` makes the run's own again) |" in md
    r = eyas(copy, "--set", "eval.max_new_tokens=16", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[eval] a standalone `eyas eval` wrote over its outputs since: running it again" in r.stderr
    assert "[export] unchanged, skipped" in r.stderr  # the export reads the drafter, not the eval
    assert json.loads((copy / "eval" / "report.json").read_text())["max_new_tokens"] == 16


def test_deleted_output_reruns_its_stage(full_run, tmp_path):
    """A finished stage whose output folder, or a file in it, was removed (e.g. to free disk) runs again, with the
    same result; the stages after it, whose inputs are unchanged, stay skipped."""
    out, _ = full_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    idx = json.loads((copy / "features" / "train" / "index.json").read_text())
    shutil.rmtree(copy / "features")
    r = eyas(copy, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[extract] finished before, but" in r.stderr and "[extract] done" in r.stderr
    assert "[train] unchanged, skipped" in r.stderr
    again = json.loads((copy / "features" / "train" / "index.json").read_text())
    assert [e["sha256"] for e in again["shards"]] == [e["sha256"] for e in idx["shards"]]
    # one file removed from inside an output folder: its stage runs again too (training, finished, writes the best
    # drafter again from its checkpoint); before, every stage was skipped and the run ended without a drafter
    weights = (copy / "draft" / "model.safetensors").read_bytes()
    (copy / "draft" / "model.safetensors").unlink()
    r = eyas(copy, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"[train] finished before, but {copy / 'draft' / 'model.safetensors'} is gone: running it again" in r.stderr
    assert "had lost its weights; wrote the best drafter" in r.stderr and "[eval] unchanged, skipped" in r.stderr
    assert (copy / "draft" / "model.safetensors").read_bytes() == weights


def test_kill_during_training_then_rerun_gives_the_same_result(full_run, tmp_path):
    out, _ = full_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    # forget training and what follows, keep the data stages
    man = json.loads((copy / "manifest.json").read_text())
    for s in ("train", "eval", "export"):
        man["stages"].pop(s)
    (copy / "manifest.json").write_text(json.dumps(man))
    for d in ("ckpt", "draft", "train", "eval", "export"):
        shutil.rmtree(copy / d, ignore_errors=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "eyas", "run", "--out", str(copy), *ARGS],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline and not (copy / "ckpt" / "latest.json").exists():
        time.sleep(0.05)
    assert (copy / "ckpt" / "latest.json").exists(), "training never wrote a checkpoint"
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert not (copy / "draft" / "model.safetensors").exists() or \
        json.loads((copy / "manifest.json").read_text())["stages"]["train"]["status"] != "done"
    r = eyas(copy, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[regen] unchanged, skipped" in r.stderr and "[train] done" in r.stderr
    a = json.loads((out / "eval" / "report.json").read_text())
    b = json.loads((copy / "eval" / "report.json").read_text())
    assert b["acceptance_length"] == a["acceptance_length"]
    assert b["per_position_acceptance"] == a["per_position_acceptance"]
    assert (copy / "draft" / "model.safetensors").read_bytes() == (out / "draft" / "model.safetensors").read_bytes()


def eyas_here(capsys, out: Path, *extra) -> tuple[int, str]:
    """`eyas run` in this process, as `eyas` runs it (its exit code and its stderr), without a fresh interpreter's
    seconds of imports: for runs that stop at preflight or take seconds."""
    from eyas.cli import main

    capsys.readouterr()
    code = main(["run", "--out", str(out), *extra])
    return code, capsys.readouterr().err


def test_bad_inputs_stop_before_expensive_stages(tmp_path, smol, tiny, capsys):
    cases = [
        (["--set", "vocab.draft_vocab_size=60000"], "larger than the target's vocabulary"),
        (["--set", "target.aux_layers=2,15,40"], "out of range"),
        (["--set", "target.aux_layers=0,15,27"], "layer(s) [0] cannot be served"),
        (["--set", "regen.split=all"], "measured on conversations the drafter trained on"),
        (["--set", f"data.source={tmp_path / 'missing.json'}"], "not found"),
        (["--set", "eval.turns=-1"], "eval.turns must be"),
        (["--set", "train.warmup_ratio=2"], "train.warmup_ratio must be between 0 and 1"),
        (["--set", "data.val_ratio=0.6", "--set", "data.test_ratio=0.5"], "with a sum below 1"),
    ]
    from eyas.draft import build_drafter, save_drafter

    other = save_drafter(build_drafter(tiny, 1024), tmp_path / "tiny_drafter")  # another target's drafter
    few = tmp_path / "few.jsonl"  # a data set too small for a 2% held-out test split, the eval's prompts
    few.write_text("".join(json.dumps({"id": f"a{i}", "messages": [{"role": "user", "content": f"question {i}"}]})
                           + "\n" for i in range(5)))
    from eyas.data.readers import split_of
    assert all(split_of(f"a{i}", 0.02, 0.02) != "test" for i in range(5))
    cases += [(["--set", f"data.source={few}"], "the held-out test split of"),
              (["--set", "export.formats=onnx"], "export format 'onnx' is not one of"),
              (["--set", f"eval.draft={tmp_path / 'no_drafter'}"], "eval.draft: "),
              (["--set", f"train.finetune_from={tmp_path / 'no_drafter'}"], "no_drafter does not exist"),
              (["--set", f"train.finetune_from={other}"], "does not fit target 'smollm2': hidden size 64 != "),
              (["--set", f"eval.prompts={tmp_path / 'nope.jsonl'}"], "eval.prompts: file not found")]
    for extra, msg in cases:  # in this process: an exception other than eyas' own error would fail the test
        code, err = eyas_here(capsys, tmp_path / "bad", *ARGS, *extra)
        assert code == 2 and msg in err, err[-2000:]
        assert not (tmp_path / "bad" / "data").exists()
    r = eyas(tmp_path / "bad", *cases[0][0], timeout=300)  # and once as a command: one line, no traceback
    assert r.returncode == 2 and cases[0][1] in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text(json.dumps({"stages": {}, "target": {"name": "qwen", "sha256": "x"}}))
    code, err = eyas_here(capsys, tmp_path / "other", *ARGS)
    assert code == 2 and "made with target 'qwen'" in err


def test_stage_lines_name_regen_left_out_as_its_log_does():
    from eyas.pipeline import one_line

    line = one_line("regen", {"records": 7, "assistant_turns": 17, "errors_total": 1, "tokens_per_s": 177.4})
    assert line == "records=7, assistant_turns=17, left_out=1, tokens_per_s=177"
    assert one_line("eval", {"acceptance_length": 2.5, "acceptance_length_ci95": [2.25, 2.75]}) == \
        "acceptance_length=2.5, acceptance_length_ci95=2.25-2.75"


def test_a_changed_sample_count_or_larger_limit_keeps_the_answers_made(tmp_path, capsys):
    """When regen.samples is the only change, `eyas run` keeps the answers of the samples the old and new counts share
    (their shards untouched), regenerates the new ones or removes those past the new count, and runs the stages after
    regen again; a larger regen.limit keeps the answers made too; any other change to regen, or a smaller limit, still
    clears its answers. On the tiny random target, whose run takes seconds."""
    out = tmp_path / "run"
    d = out / "data" / "regen"

    def run(*extra):
        code, err = eyas_here(capsys, out, "--preset", "tiny", "--set", "regen.temperature=0.8", "--set",
                              "regen.turns=1", "--set", "regen.max_new_tokens=16", "--set", "eval.limit=1", "--set",
                              "eval.max_new_tokens=8", *extra)
        assert code == 0, err[-3000:]
        return err

    def shards(pattern):
        return {f.name: f.read_bytes() for f in d.glob(pattern)}

    run("--set", "regen.samples=2")
    two = json.loads((out / "manifest.json").read_text())["stages"]["regen"]["result"]
    first, second = shards("shard-0*.jsonl"), shards("shard-s2-*.jsonl")
    assert first and second
    err = run("--set", "regen.samples=3")
    assert "[regen] only regen.samples changed (2 -> 3): keeping the answers of samples 1-2, regenerating sample 3" in err
    assert shards("shard-0*.jsonl") == first and shards("shard-s2-*.jsonl") == second and shards("shard-s3-*.jsonl")
    regen = json.loads((out / "manifest.json").read_text())["stages"]["regen"]["result"]
    assert regen["samples"] == 3 and regen["complete"] and regen["records"] == 3 * two["records"] // 2
    assert "[tokenize] done" in err and "[train] done" in err
    err = run("--set", "regen.samples=1")
    assert "(3 -> 1): keeping the answers of sample 1, removing samples 2-3" in err
    assert shards("shard-0*.jsonl") == first and not list(d.glob("*-s[0-9]*"))
    assert json.loads((out / "manifest.json").read_text())["stages"]["regen"]["result"]["samples"] == 1
    # a larger regen.limit (the tiny preset's is 8): the answers made are read back, the others asked for
    err = run("--set", "regen.samples=1", "--set", "regen.limit=11")
    assert "[regen] only regen.limit changed (8 -> 11): keeping the answers made, asking only for the conversations " \
           "added" in err
    assert "the plan grows from 8 to 11 conversations" in err and "8 finished conversations of unfinished shards" in err
    regen = json.loads((out / "manifest.json").read_text())["stages"]["regen"]
    assert regen["result"]["planned"] == 11 and regen["settings"] == {"regen.samples": 1, "regen.limit": 11}
    err = run("--set", "regen.samples=1", "--set", "regen.limit=10")  # fewer: what was made for 11 is made again
    assert "[regen] config or inputs changed: its old outputs moved to" in err
    err = run("--set", "regen.samples=2", "--set", "regen.top_p=0.9")
    assert "[regen] config or inputs changed: its old outputs moved to" in err and "only regen.samples" not in err
    assert not (out / ".replaced").exists()  # removed once the new ones were complete


def test_a_changed_stage_keeps_its_old_outputs_until_the_new_ones_are_complete(tmp_path, monkeypatch):
    """A changed setting moves the stage's outputs aside instead of deleting them: training that fails right after a
    change to its settings, having written nothing, puts the old drafter and checkpoints back at once; a regen killed
    right after a change to its settings leaves the old answers aside, and a run with the old settings puts them back
    and skips every stage as before. On the tiny random target."""
    from eyas.cli import main
    from eyas.util import EyasError

    out = tmp_path / "run"
    base = ["run", "--out", str(out), "--preset", "tiny", "--set", "regen.limit=4", "--set", "eval.limit=1",
            "--set", "eval.max_new_tokens=8"]

    def files(*dirs):
        return {f.relative_to(out).as_posix(): f.read_bytes() for d in dirs for f in sorted((out / d).rglob("*"))
                if f.is_file()}

    def stages():
        return json.loads((out / "manifest.json").read_text())["stages"]

    r = subprocess.run([sys.executable, "-m", "eyas", *base], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    trained, regen, before = files("ckpt", "draft", "train"), files("data/regen"), stages()
    assert trained and regen

    def boom(cfg, **kw):
        raise EyasError("training refused")

    monkeypatch.setattr("eyas.train.run_train", boom)
    assert main([*base, "--set", "train.lr=5e-4"]) == 2
    assert files("ckpt", "draft", "train") == trained and stages()["train"] == before["train"]
    assert not (out / ".replaced").exists()

    p = subprocess.Popen([sys.executable, "-m", "eyas", *base, "--set", "regen.max_new_tokens=20"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    aside = out / ".replaced" / "regen"
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None and not (
            (aside / "data" / "regen").exists() and (out / "data" / "regen" / "plan.json").exists()):  # the new regen
        time.sleep(0.01)
    p.kill()
    p.wait()
    assert {k.removeprefix(".replaced/regen/"): v for k, v in files(".replaced/regen/data/regen").items()} == regen
    assert stages()["regen"]["status"] == "running"
    r = subprocess.run([sys.executable, "-m", "eyas", *base], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[regen] its outputs of these settings, kept aside" in r.stderr and "[train] unchanged, skipped" in r.stderr
    assert "[regen] unchanged, skipped" in r.stderr and not aside.exists()
    assert files("data/regen") == regen and files("ckpt", "draft", "train") == trained


def test_a_killed_standalone_eval_leaves_the_runs_records(tmp_path, monkeypatch, capsys):
    """A standalone `eyas eval` marks the run's eval replaced while it runs; killed (-9) before it wrote anything,
    the next command on the run puts the run's own record back instead of leaving it called replaced."""
    from eyas import config as C
    from eyas.cli import main
    from eyas.util import EyasError

    run = tmp_path / "run"
    cfg = C.resolve(None, "tiny", {"out": str(run)})
    C.save(cfg, run)
    stages = {"eval": {"key": "e", "status": "done", "summary": "acceptance_length=2"},
              "export": {"key": "x", "status": "done"}}
    (run / "manifest.json").write_text(json.dumps({"stages": stages}))
    (run / "eval").mkdir()
    (run / "eval" / "report.json").write_text("{}")
    hang = ("import sys, time, eyas.evaluate as e\n"
            "def hang(cfg):\n    time.sleep(120)\n"
            "e.run_eval = hang\nfrom eyas.cli import main\nsys.exit(main(['eval', '--out', sys.argv[1]]))\n")
    p = subprocess.Popen([sys.executable, "-c", hang, str(run)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and "pending" not in json.loads((run / "manifest.json").read_text()):
        time.sleep(0.02)
    p.kill()
    p.wait()
    assert json.loads((run / "manifest.json").read_text())["stages"]["eval"]["status"] == "replaced"

    def refused(cfg):
        raise EyasError("refused")

    monkeypatch.setattr("eyas.evaluate.run_eval", refused)
    assert main(["eval", "--out", str(run)]) == 2
    assert "a standalone `eyas eval` on" in capsys.readouterr().err
    man = json.loads((run / "manifest.json").read_text())
    assert man["stages"] == stages and "pending" not in man
