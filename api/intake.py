"""Request intake of step14_5: prompts and sampling parameters, checked completely at submission.

A request that passes ``submit`` can never make a step raise: the prompt is tokenized and
range-checked, the ``SamplingParams`` are copied (a caller mutating its object afterwards
changes nothing queued) and verified against the vocabulary, ``max_tokens=None`` is resolved
to what ``max_model_len`` leaves, and ``n > 1`` becomes n child parameter sets.

Prompts take vLLM's forms: a string, a ``TextPrompt`` / ``TokensPrompt`` dict (``prompt`` or
``prompt_token_ids``, optionally ``cache_salt``), or (our extra) a list / array / tensor of ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import numpy as np
import torch

from api.sampling_params import SamplingParams

PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data",
               "mm_processor_kwargs", "multi_modal_uuids"}


class TextPrompt(TypedDict, total=False):
    """vLLM's text prompt: ``{"prompt": "...", "cache_salt": "..."}``."""
    prompt: str
    cache_salt: str


class TokensPrompt(TypedDict, total=False):
    """vLLM's token prompt: ``{"prompt_token_ids": [...], "cache_salt": "..."}``."""
    prompt_token_ids: list[int]
    prompt: str
    cache_salt: str


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
            raise ValueError("a text prompt needs a tokenizer, but the checkpoint has none; "
                             "pass token ids instead")
        prompt = tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
    return ParsedPrompt(_as_token_ids(prompt, vocab_size), text, salt)


def _check_prompt_dict(prompt: dict) -> None:
    unknown = set(prompt) - PROMPT_KEYS
    if unknown:
        raise ValueError(f"unknown prompt key(s) {sorted(unknown)}; a prompt dict takes "
                         f"'prompt' or 'prompt_token_ids', and 'cache_salt'")
    for key in ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"):
        if prompt.get(key):
            raise ValueError(f"{key}: multimodal inputs are not supported by this engine")
    if "prompt_token_ids" not in prompt and "prompt" not in prompt:
        raise ValueError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids'")


def _as_token_ids(prompt, vocab_size: int) -> np.ndarray:
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.cpu().numpy()
    try:
        token_ids = np.asarray(prompt)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"a prompt must be a string or a flat list of token ids: {exc}") from None
    if token_ids.size and (token_ids.ndim != 1 or not np.issubdtype(token_ids.dtype, np.integer)):
        raise ValueError(f"a prompt must be a string or a flat list of integer token ids, "
                         f"got an array of shape {token_ids.shape} and dtype {token_ids.dtype}")
    if token_ids.size == 0:
        raise ValueError("empty prompt: a request needs at least one token")
    out_of_range = (token_ids < 0) | (token_ids >= vocab_size)
    if out_of_range.any():
        raise ValueError(f"token id {int(token_ids[out_of_range][0])} is out of range "
                         f"for vocab size {vocab_size}")
    return token_ids.astype(np.int64)


@dataclass
class ParamsContext:
    """What verifying parameters needs from the engine."""
    vocab_size: int
    max_logprobs: int
    max_model_len: int
    tokenizer: object | None


def prepare_params(params, num_prompt_tokens: int, ctx: ParamsContext) -> SamplingParams:
    """The engine's own verified copy of ``params`` for a prompt of ``num_prompt_tokens``."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    own = params.clone()
    own.verify(ctx.vocab_size, ctx.max_logprobs, ctx.tokenizer)
    if own.max_tokens is None:  # vLLM: up to max_model_len
        room = ctx.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) leaves no room to generate "
                             f"within max_model_len {ctx.max_model_len}")
        own.max_tokens = room
        if own.min_tokens > room:
            raise ValueError(f"min_tokens ({own.min_tokens}) exceeds the {room} tokens "
                             f"max_model_len {ctx.max_model_len} leaves after the prompt")
    return own


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """One parameter set per sequence of an ``n``-sequence request (vLLM's parallel sampling):
    child i gets seed + i, and only child 0 computes prompt logprobs (they are the request's)."""
    if params.n == 1:
        return [params]
    children = []
    for index in range(params.n):
        child = params.clone()
        child.n = 1
        if params.seed is not None:
            child.seed = (params.seed + index) % (1 << 64)
        if index > 0:
            child.prompt_logprobs = None
        children.append(child)
    return children
