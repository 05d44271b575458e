"""Every kind of machine's path, forced on this one: STEP14_CPU_FEATURES_OFF turns off the
kernels that need AMX, AVX-512 VNNI or AVX-512 BF16, so the fast layer chooses as a CPU without
them would (fast/paths.py). For each forcing this CPU allows -- all it has, no AMX, AVX-512 F
alone -- and each weight format, ``describe()`` names the kernels of that machine and the
logits stay the plain path's: within the kernels' rounding everywhere, the same top token
wherever the plain path's top two are further apart than twice that position's error.
"""
from __future__ import annotations

import pytest
import torch

from fast.kernels import compiled_kernels
from fast.paths import features_off
from helpers import assert_within_rounding, build_checkpoint, make_llm, random_prompt
from tools.teacher_forced import teacher_forced_logits

FORCINGS = {"all it has": "", "no AMX": "amx", "AVX-512 F alone": "amx,vnni,bf16"}
IDS = random_prompt(48, 21)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint("qwen3", str(tmp_path_factory.mktemp("kernel_paths")))


def logits(llm) -> torch.Tensor:
    return teacher_forced_logits(llm.llm_engine.engine_core.model_runner.backend, IDS, "decode")


def has(probe: str) -> bool:
    module = compiled_kernels().module
    return module is not None and getattr(module, probe)()


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("forcing", list(FORCINGS))
def test_each_forced_path_is_the_plain_path(forcing, quantization, model_dir, monkeypatch):
    if compiled_kernels().module is None:
        pytest.skip(f"no compiled kernels here: {compiled_kernels().reason}")
    monkeypatch.setenv("STEP14_CPU_FEATURES_OFF", FORCINGS[forcing])
    off = set(features_off())
    llm = make_llm(model_dir, dtype="bfloat16", quantization=quantization)
    described = llm.llm_engine.engine_core.model_runner.backend.describe()
    # the kernels this forcing leaves, and only those
    assert ("few-row linear" in described.split("off:")[0]) == (has("small_linear_available") and "bf16" not in off)
    if quantization == "int4":
        vnni = has("block_linear_available") and "vnni" not in off
        assert ("int4 linears: any rows lane_linear" in described) == vnni, described
    if quantization == "int8":
        tiles = has("int8_tiles_available") and "amx" not in off
        assert ("int8_tiles" in described) == tiles, described
    got = logits(llm)
    want = logits(make_llm(model_dir, dtype="bfloat16", quantization=quantization, fast_paths=False))
    assert_within_rounding(got, want)


def test_an_unknown_feature_is_refused_by_name(model_dir, monkeypatch):
    monkeypatch.setenv("STEP14_CPU_FEATURES_OFF", "amx,avx9000")
    with pytest.raises(ValueError, match="unknown feature.*avx9000"):
        make_llm(model_dir, dtype="bfloat16")
