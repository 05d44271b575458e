"""Request intake in vLLM's terms: prompts in vLLM's forms become token ids, and the
per-request options vLLM has and this engine lacks are refused by name. What the core checks
of every request (ids in the vocabulary, the parameters verified, fits the pool) is
core/submit.py; its errors reach vLLM's callers in vLLM's words (validation.py).

Prompts take vLLM's forms: a string, a ``TextPrompt`` / ``TokensPrompt`` dict (``prompt`` or
``prompt_token_ids``, optionally ``cache_salt``), or (our extra) a list / array / tensor of ids.
vLLM's other prompt kinds (``EmbedsPrompt``, encoder-decoder prompts, multimodal data) are
importable and refused at submission naming the feature; so are request options this engine
does not serve (``reject_unsupported``: LoRA, ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict, Union

import numpy as np
import torch

from core.sampling_params import SamplingParams
from core.submit import check_prompt_ids
from vllm_api.beam import BeamSearchParams
from vllm_api.errors import refuse
from vllm_api.pooling import POOLING_REASON, PoolingParams
from vllm_api.validation import in_vllms_words

PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data",
               "mm_processor_kwargs", "multi_modal_uuids"}
# Prompt-dict keys of vLLM features this engine lacks -> (feature, reason).
REFUSED_PROMPT_KEYS = {
    "prompt_embeds": ("prompt embeddings", "prompts are token ids or text"),
    "encoder_prompt": ("encoder-decoder prompts", "the engine runs decoder-only models"),
    "decoder_prompt": ("encoder-decoder prompts", "the engine runs decoder-only models"),
    "multi_modal_data": ("multimodal inputs", "the engine runs text-only models"),
    "mm_processor_kwargs": ("multimodal inputs", "the engine runs text-only models"),
    "multi_modal_uuids": ("multimodal inputs", "the engine runs text-only models"),
    "data": ("data prompts", "prompts are token ids or text (no custom input processor)"),
}


class TextPrompt(TypedDict, total=False):
    """vLLM's text prompt: ``{"prompt": "...", "cache_salt": "..."}``."""
    prompt: str
    cache_salt: str


class TokensPrompt(TypedDict, total=False):
    """vLLM's token prompt: ``{"prompt_token_ids": [...], "cache_salt": "..."}``."""
    prompt_token_ids: list[int]
    prompt: str
    cache_salt: str


class EmbedsPrompt(TypedDict, total=False):
    """vLLM's prompt given as embeddings: importable, refused at submission."""
    prompt_embeds: Any
    cache_salt: str


class ExplicitEncoderDecoderPrompt(TypedDict, total=False):
    """vLLM's encoder-decoder prompt: importable, refused at submission."""
    encoder_prompt: Any
    decoder_prompt: Any
    mm_processor_kwargs: dict


class DataPrompt(TypedDict, total=False):
    """vLLM's prompt of raw data for a custom input processor: importable, refused."""
    data: Any
    data_format: str


class TokensInput(TypedDict, total=False):
    """vLLM's processed token input (``tokens_input`` builds one); usable as a prompt here."""
    type: str
    prompt_token_ids: list[int]
    prompt: str
    cache_salt: str


class EmbedsInput(TypedDict, total=False):
    """vLLM's processed embeddings input: importable, refused at submission."""
    type: str
    prompt_embeds: Any
    cache_salt: str


def tokens_input(prompt_token_ids: list[int], prompt: str | None = None,
                 cache_salt: str | None = None) -> TokensInput:
    """A ``TokensInput`` dict, usable as a prompt here."""
    inputs = TokensInput(type="token", prompt_token_ids=list(prompt_token_ids))
    if prompt is not None:
        inputs["prompt"] = prompt
    if cache_salt is not None:
        inputs["cache_salt"] = cache_salt
    return inputs


SingletonPrompt = Union[str, TextPrompt, TokensPrompt, EmbedsPrompt]
PromptType = Union[SingletonPrompt, ExplicitEncoderDecoderPrompt]


@dataclass
class ParsedPrompt:
    token_ids: np.ndarray     # int64, 1-D, every id inside the vocabulary
    text: str | None          # the prompt string when the request came as text
    cache_salt: str | None


def parse_prompt(prompt, tokenizer, vocab_size: int, add_special_tokens: bool = True) -> ParsedPrompt:
    """Token ids, text and salt of one prompt, or a ValueError that names the problem."""
    salt, text = None, prompt if isinstance(prompt, str) else None
    if isinstance(prompt, dict):
        _check_prompt_dict(prompt)
        salt = prompt.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
        text = prompt.get("prompt") if isinstance(prompt.get("prompt"), str) else None
        prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("You cannot pass text prompts when `skip_tokenizer_init=True` "
                             "(vLLM's words; here also when the checkpoint has no tokenizer "
                             "files): pass token ids instead (TokensPrompt)")
        prompt = tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
    return ParsedPrompt(_as_token_ids(prompt, vocab_size), text, salt)


def _check_prompt_dict(prompt: dict) -> None:
    for key, (feature, reason) in REFUSED_PROMPT_KEYS.items():
        if prompt.get(key) is not None and (key not in PROMPT_KEYS or prompt.get(key)):
            refuse(feature, f"a prompt with {key!r}: {reason}")
    unknown = set(prompt) - PROMPT_KEYS - {"type"} - set(REFUSED_PROMPT_KEYS)
    if unknown:
        raise ValueError(f"unknown prompt key(s) {sorted(unknown)}; a prompt dict takes "
                         f"'prompt' or 'prompt_token_ids', and 'cache_salt'")
    if "prompt_token_ids" not in prompt and "prompt" not in prompt:
        raise ValueError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids'")


def _as_token_ids(prompt, vocab_size: int) -> np.ndarray:
    """The core's prompt checks, its errors in vLLM's words ("The decoder prompt cannot be
    empty", "Token id 512 is out of vocabulary (vocab size 512)")."""
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.cpu().numpy()
    with in_vllms_words():
        return check_prompt_ids(prompt, vocab_size)


def check_params_type(params) -> None:
    """vLLM's other parameter kinds are refused by name, anything else is a TypeError."""
    if isinstance(params, PoolingParams):
        refuse("pooling", f"PoolingParams given as sampling_params: {POOLING_REASON}")
    if isinstance(params, BeamSearchParams):
        refuse("beam search through generate()", "BeamSearchParams given as sampling_params; "
                                                  "call LLM.beam_search(prompts, params)")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")


def reject_unsupported(lora_request=None, **others) -> None:
    """Refuse the per-request options of vLLM's ``generate`` / ``chat`` / ``add_request``
    this engine does not serve, naming each: a LoRA adapter, and any other option given a
    value (``others``: name -> value). Priorities are served (``LLMEngine.check_priority``)."""
    if _given(lora_request):
        refuse("LoRA adapters", f"lora_request={_describe(lora_request)}: the engine loads "
                                f"base weights only (no adapters)")
    for name, value in others.items():
        if _given(value):
            refuse(f"the {name} option", f"{name}={_describe(value)} has no counterpart "
                                         f"here (see docs/vllm_api.md)")


def _given(value) -> bool:
    """A per-request option is given unless it is None (or a list of Nones)."""
    if isinstance(value, (list, tuple)):
        return any(v is not None for v in value)
    return value is not None


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
