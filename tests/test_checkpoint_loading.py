"""Checkpoint loading beyond one file: sharded safetensors, missing shards and tensors, bfloat16."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import GreedyReference, assert_no_leak, greedy, make_llm, random_prompt


@pytest.fixture(scope="module")
def sharded_dir(checkpoints, tmp_path_factory) -> str:
    """The qwen3 checkpoint re-saved in several shards, with model.safetensors.index.json."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("sharded_qwen3")
    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"], dtype=torch.float32)
    model.save_pretrained(out, max_shard_size="100KB")
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("*.safetensors"))) > 1
    return str(out)


def test_sharded_checkpoint_matches_single_file(checkpoints, sharded_dir):
    prompts = [random_prompt(n, seed=n) for n in (5, 19, 40)]
    outs = make_llm(sharded_dir).generate(prompts, greedy(8), use_tqdm=False)
    GreedyReference(checkpoints["qwen3"]).compare_all(prompts, outs, 8)


def test_missing_shard_is_named(sharded_dir, tmp_path):
    for f in (p for p in Path(sharded_dir).iterdir()):
        shutil.copy(f, tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=shard):
        make_llm(tmp_path)


def test_missing_tensor_is_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    for f in Path(checkpoints["llama"]).iterdir():
        shutil.copy(f, tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.mlp.gate_up_proj.weight"):
        make_llm(tmp_path)


def test_bfloat16_runs_and_leaks_nothing(llama_dir):
    llm = make_llm(llama_dir, dtype="bfloat16", enable_prefix_caching=False)
    assert llm.dtype == torch.bfloat16
    outs = llm.generate([random_prompt(30, seed=1)] * 2, greedy(8), use_tqdm=False)
    assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) == 8
    assert_no_leak(llm)
