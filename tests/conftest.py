"""Shared fixtures: tiny random HF checkpoints built on the fly (never downloaded), and the
greedy reference (see helpers.py)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

# The models are tiny: with >1 intra-op thread on a small, shared box each
# 64x64 matmul pays OpenMP sync costs (~ms instead of ~us).  One thread keeps
# both the HF reference and the engine fast; it changes no numerics we rely on.
torch.set_num_threads(1)

import helpers

# The suite runs on every core (pytest-xdist, see pyproject.toml). A module's tests stay on one
# worker, so a module-scoped fixture (a bench run, a page in a browser) is built once; these
# modules use session fixtures only and spread their tests over the workers.
SPREAD_MODULES = {"test_property", "test_hf_parity", "test_attention_kinds", "test_vllm_surface",
                  "test_interrupts"}


# Checks a test could not make on this machine (a browser missing, say): each test notes them
# with the ``not_checked`` fixture, as a user property so the note travels from an xdist worker
# to the controller, and the run's summary lists them instead of passing in silence.
NOT_CHECKED = "not checked"
_not_checked: dict[str, set[str]] = {}  # what was not checked -> the tests that could not


@pytest.fixture
def not_checked(request):
    """``note(what)``: this test ran every assert it could but could not check ``what``."""
    def note(what: str) -> None:
        request.node.user_properties.append((NOT_CHECKED, what))
    return note


def pytest_runtest_logreport(report):
    for key, what in report.user_properties:
        if key == NOT_CHECKED:
            _not_checked.setdefault(what, set()).add(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    for what, tests in _not_checked.items():
        terminalreporter.write_line(f"NOT CHECKED: {what} ({len(tests)} tests ran without it)",
                                    yellow=True, bold=True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__
        if module not in SPREAD_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """name -> directory of a random float32 HF checkpoint (see helpers.ARCH_CONFIGS)."""
    return {name: helpers.build_checkpoint(name, str(tmp_path_factory.mktemp(f"ckpt_{name}")))
            for name in helpers.ARCHS}


@pytest.fixture(scope="session")
def llama_dir(checkpoints) -> str:
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def tokenizer_ckpt(checkpoints, tmp_path_factory) -> str:
    """Copy of the llama checkpoint with a word-level tokenizer (vocab == model vocab)."""
    d = str(tmp_path_factory.mktemp("ckpt_llama_tok"))
    for f in os.listdir(checkpoints["llama"]):
        shutil.copy(os.path.join(checkpoints["llama"], f), d)
    helpers.build_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def long_ckpt(tmp_path_factory) -> str:
    """A tiny random Qwen3 whose context fits the chapter's 4096-token prompt."""
    return helpers.build_checkpoint("qwen3", str(tmp_path_factory.mktemp("long_qwen3")), seed=0,
                                    **helpers.LONG_QWEN3)


@pytest.fixture(scope="module")
def reference(llama_dir) -> helpers.GreedyReference:
    """HF greedy on the llama checkpoint. One per test module, so each module's
    ``assert_not_vacuous`` counts its own comparisons (the references are memoised globally)."""
    return helpers.GreedyReference(llama_dir)
