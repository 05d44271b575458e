"""A damaged safetensors file gives an error that names the file (the library's own message
says what is wrong, not where)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import make_llm


def damaged_copy(model_dir: str, tmp_path: Path, damage) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(model_dir, copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    return weights


@pytest.mark.parametrize("damage", [
    lambda data: data[: len(data) // 2],            # truncated: a download cut short
    lambda data: b"\xff" * 8 + data[8:],            # header length garbage
    lambda data: data[:8] + b"{not json" + data[17:],  # header text garbage
], ids=["truncated", "header-length", "header-json"])
def test_damaged_weights_file_is_named(llama_dir, tmp_path, damage):
    weights = damaged_copy(llama_dir, tmp_path, damage)
    with pytest.raises(ValueError, match="cannot read checkpoint file") as err:
        make_llm(weights.parent)
    assert str(weights) in str(err.value)
