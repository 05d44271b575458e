"""The tree's promises: no import circles among the project's modules, and no sys.path edits.

Imports are read with ``ast`` (module level and function level alike), so a circle hidden by a
function-local import fails here too.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "internals", "teaching", "benchmarks", "exercises", "tools")


def project_modules() -> dict[str, Path]:
    files = list(ROOT.glob("*.py")) + [p for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py")]
    names = {}
    for path in files:
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(path: Path, known: set[str]) -> set[str]:
    package = ".".join(path.relative_to(ROOT).parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                base = ".".join(filter(None, [package, base]))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in found if name in known}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circles():
    modules = project_modules()
    # A package's __init__ is not an edge target for its own members' imports of siblings.
    graph = {name: imports_of(path, set(modules)) - {name} for name, path in modules.items()}
    assert "engine" in graph and graph["engine"], "the walk found the engine's imports"
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph))}"


def test_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_sys_path_edits():
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                 if ".git" not in p.parts and "sys.path" in p.read_text()
                 and p.name != "test_layout.py"]
    assert offenders == []


def test_top_level_is_the_design_card():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert top == ["bench.py", "block_manager.py", "engine.py", "model.py", "prefix_cache.py",
                   "run.py", "scheduler.py"]
