"""The tree's promises: three floors whose imports point one way, no import circles, no
sys.path edits, the design card's files at the top.

* the core (the design card's scheduler, block_manager, prefix_cache, model, engine -- the
  loop -- and core/) imports nothing above it, but for one named lazy edge: engine.py's public
  face resolves vLLM's names (vllm_api/public.py) in its module ``__getattr__``, at first use;
* the fast layer (fast/) imports the core and itself;
* the vLLM layer (vllm_api/) imports the core, the fast layer and itself;
* the applications (run.py, bench.py, teaching/, exercises/, track/, benchmarks/, tools/) may
  import any floor; no floor imports them.

Imports are read with ``ast`` (module level and function level alike), so an arrow hidden in a
function-local import counts too.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "fast", "vllm_api", "teaching", "benchmarks", "exercises", "track", "tools")
CORE_FILES = ("scheduler", "block_manager", "prefix_cache", "model", "engine")
# The public face in engine.py: vLLM's names, imported inside its module __getattr__ when a script
# first asks for one -- the one arrow up, lazy, and so no import circle at load time.
LAZY_FACE = ("engine", {"vllm_api", "vllm_api.llm", "vllm_api.llm_engine", "vllm_api.public"})
FLOOR_BELOW = {"core": {"core"}, "fast": {"core", "fast"}, "vllm": {"core", "fast", "vllm"}}


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


def floor_of(module: str) -> str:
    """core, fast, vllm, or app (everything that only uses the engine)."""
    top = module.split(".")[0]
    if top in CORE_FILES or top == "core":
        return "core"
    return {"fast": "fast", "vllm_api": "vllm"}.get(top, "app")


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports, less the public face's lazy edge (``LAZY_FACE``)."""
    modules = project_modules()
    # A package's __init__ is not an edge target for its own members' imports of siblings.
    graph = {name: imports_of(path, set(modules)) - {name} for name, path in modules.items()}
    graph[LAZY_FACE[0]] -= LAZY_FACE[1]
    return graph


def test_the_face_names_the_vllm_layer_only_lazily():
    """engine.py imports vllm_api.public in one place, its module __getattr__, and nowhere else."""
    tree = ast.parse((ROOT / "engine.py").read_text())
    lazy = [fn for fn in tree.body if isinstance(fn, ast.FunctionDef) and fn.name == "__getattr__"]
    inside = {id(n) for fn in lazy for n in ast.walk(fn)}
    found = [(node.module or "", id(node) in inside) for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm_api")]
    found += [(a.name, False) for node in ast.walk(tree) if isinstance(node, ast.Import)
              for a in node.names if a.name.startswith("vllm_api")]
    assert found == [("vllm_api", True)], found


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


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Every import that leaves its floor for one it may not use."""
    wrong = []
    for module, targets in graph.items():
        allowed = FLOOR_BELOW.get(floor_of(module))
        if allowed is None:
            continue  # the applications may import any floor
        wrong += [f"{module} -> {t}" for t in sorted(targets) if floor_of(t) not in allowed]
    return wrong


def test_floors_import_downward_only():
    graph = import_graph()
    floors = {floor_of(m) for m in graph}
    assert {"core", "fast", "vllm", "app"} <= floors, "the walk found every floor"
    assert graph["engine"] >= {"scheduler", "core.model_runner"}, "the engine is built from the core"
    assert upward_arrows(graph) == []


def test_the_direction_check_catches_an_upward_arrow():
    graph = {"scheduler": {"vllm_api.sampling_params"}, "fast.attention": {"model"},
             "core.sampler": {"fast.linear"}, "vllm_api.llm": {"fast.backend", "run"},
             "run": {"vllm_api.llm"}}
    assert sorted(upward_arrows(graph)) == ["core.sampler -> fast.linear",
                                            "scheduler -> vllm_api.sampling_params",
                                            "vllm_api.llm -> run"]


def test_no_import_circles():
    graph = import_graph()
    assert graph["engine"], "the walk found the engine's imports"
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph))}"


def test_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def project_files() -> list[Path]:
    """The project's own Python files: none under .git or a virtual environment a user made in
    the checkout (a folder holding pyvenv.cfg, as ``python -m venv venv`` makes)."""
    venvs = {p.parent for p in ROOT.glob("*/pyvenv.cfg")}
    return [p for p in ROOT.rglob("*.py")
            if ".git" not in p.parts and not any(v in p.parents for v in venvs)]


def test_no_sys_path_edits():
    offenders = [str(p.relative_to(ROOT)) for p in project_files()
                 if "sys.path" in p.read_text() and p.name != "test_layout.py"]
    assert offenders == []


def test_top_level_is_the_design_card():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert top == ["bench.py", "block_manager.py", "engine.py", "model.py", "prefix_cache.py",
                   "run.py", "scheduler.py"]


def test_no_module_global_switches_a_path():
    """What path runs is an argument (a backend, its Routes), never a module-level flag that
    code reads at call time: no core or fast module rebinds a global."""
    offenders = []
    for name, path in project_modules().items():
        if floor_of(name) not in ("core", "fast"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                offenders.append(f"{name}: global {', '.join(node.names)}")
    assert offenders == ["fast.cpu_threads: global _callers_threads",
                         "fast.cpu_threads: global _set_by_policy"]  # torch's thread count is per process


def test_importing_the_engine_opens_no_json_and_loads_no_vllm_layer():
    """The step loop is the engine; vLLM's surface (its names, its member tables) is loaded only
    when a script asks for a vLLM name (a fresh interpreter, an audit hook on open)."""
    import subprocess
    import sys
    code = ("import sys; opened = []\n"
            "sys.addaudithook(lambda e, a: opened.append(a[0]) if e == 'open' and str(a[0]).endswith('.json') else None)\n"
            "import engine\n"
            "assert opened == [], opened\n"
            "assert not [m for m in sys.modules if m.startswith('vllm_api')]\n"
            "assert engine.EngineCore and engine.LLM.__name__ == 'LLM' and engine.__version__ == '0.32.0'\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_a_request_travels_through_few_files_and_reads_no_vllm_table():
    """Issue 47's measure (tools/request_path.py): a follow-up 3-token request on the plain path
    enters at most 14 project files with at most 200 calls from one into another, and opens no
    JSON; importing, building the LLM and generating read none of the project's JSON (vLLM's
    listings): a fresh interpreter, an audit hook on open."""
    import subprocess
    import sys
    code = ("import sys; opened = []\n"
            "sys.addaudithook(lambda e, a: opened.append(str(a[0])) if e == 'open' and str(a[0]).endswith('.json') else None)\n"
            "from tools.request_path import tiny_llama, trace_follow_up\n"
            "files, calls, during = trace_follow_up()\n"
            "assert len(files) <= 14 and calls <= 200 and during == [], (files, calls, during)\n"
            "import os; ours = [p for p in opened if os.path.abspath(p).startswith(os.getcwd() + os.sep)\n"
            "        and 'site-packages' not in p]\n"
            "assert ours == [], ours\n"
            "print(len(files), calls)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


# Each fact has one owner: the only files (of the engine's floors) that may change it.
OWNERS = {
    "a block's ref count (retain / release, take)": (r"\.ref_count\s*[-+]?=(?!=)", {"block_manager.py"}),
    "a cached block's identity (hash, tokens, parent lifetime, salt)":
        (r"\.(set_identity|forget_identity)\(", {"prefix_cache.py"}),
    "the hash -> block map": (r"\b_prefix_cache\[", {"prefix_cache.py"}),
    "evictions": (r"num_evictions\s*\+=", {"prefix_cache.py"}),
    "vLLM's wording of the core's errors":
        (r"\b(as_vllm_error|in_vllms_words)\(", {"vllm_api/validation.py", "vllm_api/intake.py",
                                                   "vllm_api/sampling_params.py"}),
    "8-bit weights' storage dtype": (r"torch\.int8\b", {"core/int8_format.py", "core/q8_0_format.py"}),
}


def engine_sources() -> dict[str, str]:
    """The floors' files (core, fast, vLLM layer, the design card's), by path from the root."""
    files = [p for p in ROOT.glob("*.py") if p.stem in CORE_FILES]
    files += [p for pkg in ("core", "fast", "vllm_api") for p in (ROOT / pkg).glob("*.py")]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def test_each_fact_has_one_owner():
    """Block identity and eviction live with the map (prefix_cache.py: the pool never writes
    them and never calls up into the cache), ref counts with the pool (block_manager.py),
    vLLM's words at the vLLM layer's door (vllm_api/intake.py, and SamplingParams' own
    construction), a weight format's dtype in its own file(s)."""
    import re
    sources = engine_sources()
    wrong = [f"{fact}: {path}" for fact, (pattern, owners) in OWNERS.items()
             for path, text in sources.items() if path not in owners and re.search(pattern, text)]
    assert wrong == []
    pool = ast.parse(sources["block_manager.py"])  # no call from the pool up into the cache
    imported = {a.name for n in ast.walk(pool) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} | {n.module for n in ast.walk(pool) if isinstance(n, ast.ImportFrom)}
    assert not {"prefix_cache", "PrefixCache", "scheduler"} & imported


def test_the_owner_check_catches_a_second_writer():
    import re
    pattern, owners = OWNERS["a block's ref count (retain / release, take)"]
    assert re.search(pattern, "    block.ref_count += 1\n") and "scheduler.py" not in owners
    assert not re.search(pattern, "if block.ref_count == 0:")
