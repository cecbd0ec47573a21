"""eyas' modules form no import circle, whether an import is at the top of a file or inside a function, and the
engines that run a target sit below the stages that use them: eyas.engine imports no stage."""
import ast
from pathlib import Path

import eyas

ROOT = Path(eyas.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every eyas module -> the eyas modules it imports anywhere in its file (at its top or inside a function), with
    the packages that hold them: importing eyas.a.b runs eyas/a/__init__.py first, unless the importer is inside
    eyas.a (then that package is already being imported)."""
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
        deps = {d for d in deps if d in modules}
        packages = {".".join(d.split(".")[:i]) for d in deps for i in range(1, d.count(".") + 1)}
        graph[name] = {d for d in deps | packages if d in modules and d != name and not name.startswith(d + ".")}
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


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules in import order, the first one again at the end), or None."""
    state: dict[str, str] = {}
    for start in sorted(graph):
        path, todo = [], [(start, iter(sorted(graph[start])))]
        state[start] = "open"
        path.append(start)
        while todo:  # depth first, without recursion; a module met again on the open path closes a circle
            node, deps = todo[-1]
            d = next(deps, None)
            if d is None:
                state[node] = "done"
                path.pop()
                todo.pop()
            elif state.get(d) == "open":
                return path[path.index(d):] + [d]
            elif d not in state:
                state[d] = "open"
                path.append(d)
                todo.append((d, iter(sorted(graph[d]))))
    return None


def test_circle_finds_a_circle_and_names_its_modules():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_anywhere():
    graph = _imports()
    # the graph holds imports made inside functions, and the packages that hold an imported module
    assert "eyas.target" in graph["eyas.pipeline"] and "eyas.data" in graph["eyas.pipeline"]
    assert {"eyas.data.regen_plan", "eyas.engine.generate", "eyas.features.extract"} <= set(graph)
    circle = _circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)
