"""A numeric standard for bfloat16 and float16: the engine's logits are as close to float32 as
Hugging Face's own logits in that dtype are.

Teacher forcing: the same token ids go through HF in float32 (the reference), HF in the low
dtype, and this engine in the low dtype by every schedule it runs (whole prompt, chunked
prefill, after a prefix-cache hit, decode steps; engine_logits.py), fast paths on and off.
Per position the error is the largest |logit - reference logit| over the vocabulary.

The factors: each implementation's error is the sum of many roundings at the dtype's unit
roundoff (2^-8 in bfloat16, 2^-11 in float16), and a different but equally valid order of
operations (fused QKV and gate/up weights, another attention kernel, chunked keys) draws those
roundings afresh. Over a few hundred positions the mean of such errors moves by a few percent
between valid orders, so the mean may exceed HF's by at most a quarter; the maximum is the
extreme of the sample and moves more, so it may exceed HF's by at most half. A real bug (a
wrong mask, a RoPE position off by one, a dropped norm weight) errs by the order of the
logits themselves, many times these bounds: the last test shows one caught.
"""
from __future__ import annotations

import pytest
import torch

import helpers
from tools.teacher_forced import MODES, hf_logits, position_error, teacher_forced_logits
from fast.backend import build_backend
from model import load_model

MEAN_FACTOR, MAX_FACTOR = 1.25, 1.5
PROMPT_LEN = 160
CPU = torch.device("cpu")
# A wider, deeper model beside the 2-layer test checkpoints: errors grow with depth and width.
WIDER = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, initializer_range=0.05)


@pytest.fixture(scope="module")
def wider_llama(tmp_path_factory) -> str:
    return helpers.build_checkpoint("llama", str(tmp_path_factory.mktemp("wider_llama")), **WIDER)


def backend(model_dir: str, dtype: torch.dtype, fast_paths: bool, kernels: bool = False):
    model = load_model(model_dir, dtype, CPU)
    return build_backend(model, fast_paths=fast_paths, enforce_eager=not kernels)


def assert_within_hf(model_dir: str, ids: list[int], dtype: torch.dtype, fast_paths: bool,
                     kernels: bool = False) -> None:
    reference = hf_logits(model_dir, tuple(ids), torch.float32)
    hf = position_error(hf_logits(model_dir, tuple(ids), dtype), reference)
    runs = backend(model_dir, dtype, fast_paths, kernels)
    for mode in MODES:
        ours = position_error(teacher_forced_logits(runs, ids, mode), reference)
        what = f"{dtype} {mode} fast_paths={fast_paths} kernels={kernels}: " \
               f"ours mean/max {ours.mean():.4f}/{ours.max():.4f}, " \
               f"HF's {hf.mean():.4f}/{hf.max():.4f}"
        assert ours.mean() <= MEAN_FACTOR * hf.mean(), what
        assert ours.max() <= MAX_FACTOR * hf.max(), what


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_low_precision_error_within_hf_own(checkpoints, arch, dtype):
    ids = helpers.random_prompt(PROMPT_LEN, seed=5)
    for fast_paths, kernels in ((True, False), (True, True), (False, False)):
        assert_within_hf(checkpoints[arch], ids, dtype, fast_paths, kernels)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernels", [False, True])
def test_low_precision_error_within_hf_own_wider_model(wider_llama, dtype, kernels):
    """kernels: the compiled decode attention, and in bfloat16 the few-row linears, at every
    decode step."""
    assert_within_hf(wider_llama, helpers.random_prompt(PROMPT_LEN, seed=6), dtype, True, kernels)


def test_float32_logits_equal_hf(checkpoints):
    """The float32 baseline the standard leans on: every schedule matches HF's float32 logits."""
    ids = helpers.random_prompt(PROMPT_LEN, seed=7)
    reference = hf_logits(checkpoints["mistral"], tuple(ids), torch.float32)
    for fast_paths in (True, False):
        runs = backend(checkpoints["mistral"], torch.float32, fast_paths)
        for mode in MODES:
            assert position_error(teacher_forced_logits(runs, ids, mode), reference).max() < 1e-4


def test_the_bound_catches_a_mask_bug(checkpoints):
    """A sliding window of 16 where the model attends fully: in bfloat16 the error is far
    beyond the bound, so the standard would catch such a bug."""
    model_dir, ids = checkpoints["llama"], helpers.random_prompt(PROMPT_LEN, seed=5)
    reference = hf_logits(model_dir, tuple(ids), torch.float32)
    hf = position_error(hf_logits(model_dir, tuple(ids), torch.bfloat16), reference)
    runs = backend(model_dir, torch.bfloat16, fast_paths=False)
    runs.model.layers[0].self_attn.window = 16
    ours = position_error(teacher_forced_logits(runs, ids, "whole"), reference)
    assert ours.max() > 3 * MAX_FACTOR * hf.max() and ours.mean() > 3 * MEAN_FACTOR * hf.mean()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_is_bit_identical_to_hugging_faces(dtype):
    """model.RMSNorm rounds as HF's LlamaRMSNorm does (normalise in float32, cast, then the
    weight in the input dtype): equal bit for bit, for a hidden state and for q/k heads."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from model import RMSNorm
    g = torch.Generator().manual_seed(3)
    for shape in ((5, 1024), (3, 16, 128)):
        ours, hf = RMSNorm(shape[-1], 1e-6), LlamaRMSNorm(shape[-1], eps=1e-6)
        weight = torch.randn(shape[-1], generator=g)
        ours.weight.data, hf.weight.data = weight.clone(), weight.clone()
        ours, hf = ours.to(dtype), hf.to(dtype)
        x = (3 * torch.randn(*shape, generator=g)).to(dtype)
        assert torch.equal(ours(x), hf(x)), shape
