"""``pip install -e .`` works: pyproject.toml declares a build system, lists every top-level
module and package of the flat layout (a new one cannot be forgotten), keeps the one list of
dependencies (requirements.txt installs from it), and its commands name real callables. The
install itself was checked in a fresh venv (docs/vllm_api.md, "Installing")."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_module_and_package_is_listed():
    setuptools = PYPROJECT["tool"]["setuptools"]
    top_modules = sorted(p.stem for p in ROOT.glob("*.py"))
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert sorted(setuptools["py-modules"]) == top_modules
    assert sorted(setuptools["packages"]) == packages
    assert PYPROJECT["build-system"]["build-backend"] == "setuptools.build_meta"


def test_dependencies_have_one_source():
    lines = [l for l in (ROOT / "requirements.txt").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    pinned = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch==")]
    assert lines == pinned + ["-e .[test]"]  # torch first, at pyproject's pin, then the rest
    names = {d.split(">")[0].split("=")[0].split("<")[0] for d in PYPROJECT["project"]["dependencies"]}
    assert {"torch", "transformers", "xxhash", "pyzmq", "msgspec", "cbor2"} <= names


def test_the_commands_name_callables():
    for command, target in PYPROJECT["project"]["scripts"].items():
        module, _, attribute = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attribute)), command


def test_a_learners_script_elsewhere_imports_the_engine(tmp_path):
    """After ``pip install -r requirements.txt`` (an editable install of this project), a script
    outside the repository imports the engine's modules, from an installed checkout of it."""
    script = tmp_path / "mine.py"
    script.write_text("import json, engine, teaching, prefix_cache\n"
                      "print(json.dumps([m.__file__ for m in (engine, teaching, prefix_cache)]))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    files = [Path(f) for f in json.loads(run.stdout)]
    checkout = files[0].parent
    assert files == [checkout / "engine.py", checkout / "teaching" / "__init__.py", checkout / "prefix_cache.py"]
    installed = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]["name"]
    assert installed == PYPROJECT["project"]["name"]
