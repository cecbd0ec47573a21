"""The engines that run a target sit below the stages that use them: eyas.engine imports no stage, and the regen
modules and the engines form no import circle, whether an import is at the top of a file or inside a function."""
import ast
from pathlib import Path

import eyas

ROOT = Path(eyas.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every eyas module -> the eyas modules it imports anywhere in its file."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                for alias in node.names:
                    deps.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for d in graph[todo.pop()]:
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def test_engine_imports_no_stage():
    graph = _imports()
    stages = {"eyas.data.regen", "eyas.data.prepare", "eyas.decode", "eyas.evaluate", "eyas.pipeline", "eyas.cli"}
    for name in (m for m in graph if m == "eyas.engine" or m.startswith("eyas.engine.")):
        assert not _reaches(graph, name) & stages, name


def test_no_import_circle_through_regen_or_the_engines():
    graph = _imports()
    ours = [m for m in graph
            if m == "eyas.engine" or m.startswith(("eyas.engine.", "eyas.data.regen", "eyas.data.prepare"))
            or m in ("eyas.decode", "eyas.greedyval")]
    assert "eyas.data.regen_plan" in ours and "eyas.engine.generate" in ours
    for name in ours:
        assert name not in _reaches(graph, name), f"{name} imports itself through {sorted(_reaches(graph, name))}"
