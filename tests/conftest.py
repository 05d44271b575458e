"""Shared fixtures: tiny random HF checkpoints built on the fly (never downloaded)."""
from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# The models are tiny: with >1 intra-op thread on a small, shared box each
# 64x64 matmul pays OpenMP sync costs (~ms instead of ~us).  One thread keeps
# both the HF reference and the engine fast; it changes no numerics we rely on.
torch.set_num_threads(1)

import hf_reference  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """name -> directory of a random float32 HF checkpoint (see hf_reference.ARCHS)."""
    out = {}
    for name in hf_reference.ARCHS:
        d = tmp_path_factory.mktemp(f"ckpt_{name}")
        out[name] = hf_reference.build_checkpoint(name, str(d))
    return out


@pytest.fixture(scope="session")
def llama_dir(checkpoints) -> str:
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def tokenizer_ckpt(checkpoints, tmp_path_factory) -> str:
    """Copy of the llama checkpoint with a word-level tokenizer (vocab == model vocab)."""
    d = str(tmp_path_factory.mktemp("ckpt_llama_tok"))
    for f in os.listdir(checkpoints["llama"]):
        shutil.copy(os.path.join(checkpoints["llama"], f), d)
    hf_reference.build_tokenizer(d)
    return d
