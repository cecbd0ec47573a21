"""The train stage's shape: `run_train` makes what earlier stages make where a standalone `eyas train` finds none and
says so, the trainer itself never runs them, and eyas/train/ stays a package of small files without import circles."""
import ast
import json
from pathlib import Path

from eyas.config import resolve
from eyas.train import run_train
from eyas.vocab import load_vocab

TRAIN = Path(__file__).resolve().parents[1] / "eyas" / "train"
EARLIER_STAGES = {"ensure_tokens", "ensure_vocab", "run_tokenize", "run_vocab"}


def test_standalone_train_makes_the_tokens_and_vocabulary_it_lacks_and_says_so(tiny, tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Name a colour and a number, please ({i})."},
        {"role": "assistant", "content": f"Blue, and {i * 7}. " * (1 + i % 3)}]}) + "\n" for i in range(12)))
    run = tmp_path / "run"
    cfg = resolve(preset_name="tiny", overrides={"out": str(run), "data.source": str(data), "data.limit": 0,
                                                 "data.test_ratio": 0.0, "train.max_steps": 1, "train.greedy_val": 0,
                                                 "train.batch_tokens": 512, "train.max_seq_len": 256})
    summary = run_train(cfg, tiny)
    said = capsys.readouterr().err
    assert summary["steps"] == 1 and (run / "draft" / "model.safetensors").exists()
    assert (run / "data" / "tokens" / "meta.json").exists() and load_vocab(run).numel() > 0
    assert "\ntokenize: " in f"\n{said}" and "\nvocab: " in f"\n{said}", said


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(TRAIN.glob("*.py"))}


def _own_imports(tree: ast.Module) -> set[str]:
    """The eyas.train modules a module imports at its top level (`from .x import ...`)."""
    return {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module}


def test_the_trainer_runs_no_earlier_stage():
    """Tokens and the vocabulary are made before the trainer starts (the pipeline's stages, or run_train for a
    standalone `eyas train`): nothing the trainer's own files import runs an earlier stage."""
    mods = _modules()
    seen, todo = set(), ["trainer"]
    while todo:  # the trainer and every eyas.train module it imports, through each other
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += [x for x in _own_imports(mods[m]) if x in mods]
    for m in sorted(seen):
        names = {a.name for n in ast.walk(mods[m]) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not names & EARLIER_STAGES, f"eyas/train/{m}.py imports {sorted(names & EARLIER_STAGES)}"
    assert "stage" not in seen


def test_the_train_package_holds_small_files_without_import_circles():
    mods = _modules()
    assert {"stage", "trainer", "checkpoint", "batches", "ttt"} <= set(mods)
    for name, tree in mods.items():
        path = f"eyas/train/{name}.py"
        assert len((TRAIN / f"{name}.py").read_text().splitlines()) <= 600, path
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert n.end_lineno - n.lineno < 100, f"{path}: {n.name} is {n.end_lineno - n.lineno + 1} lines"
                inner = [i for i in ast.walk(n) if isinstance(i, ast.ImportFrom) and i.level > 0]
                assert not inner, f"{path}: {n.name} imports eyas' own modules inside it (line {inner[0].lineno})"
    graph = {m: _own_imports(t) - {"__init__"} for m, t in mods.items() if m != "__init__"}
    state: dict[str, int] = {}

    def visit(m, path):  # depth first; a module met again on the path it started is a circle
        if state.get(m) == 1:
            raise AssertionError("import circle: " + " -> ".join(path + [m]))
        if state.get(m) != 2:
            state[m] = 1
            for x in sorted(graph.get(m, ())):
                visit(x, path + [m])
            state[m] = 2

    for m in sorted(graph):
        visit(m, [])
