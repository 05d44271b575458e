"""Request intake: the one door from vLLM's calls into the core, and the one place vLLM's
wording is applied.

``add_requests`` is every vLLM entry point's submission (``LLM.generate``, ``LLMEngine.add_request``,
``AsyncLLM.generate``, ...): prompts in vLLM's forms become token ids, the parameters' vLLM-only
fields are checked and the per-request options vLLM has and this engine lacks are refused by
name, then the core queues the requests (core/submit.py: ids in the vocabulary, the parameters
verified on the engine's own copy, fits the pool). A core error leaves here once, in vLLM's words
(validation.py, only when there is an error).

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

from core.errors import ParameterError
from core.sampling_params import SamplingParams, as_int, check_bool, require
from core.submit import Request, check_prompt_ids
from vllm_api.beam import BeamSearchParams
from vllm_api.errors import VLLMValidationError, refuse
from vllm_api.pooling import POOLING_REASON, PoolingParams
from vllm_api.structured import check_structured
from vllm_api.validation import as_vllm_error

# vLLM SamplingParams fields this engine does not implement: accepted only at their default,
# else refused at submission naming the field.
UNSUPPORTED_FIELDS = {
    "logprob_token_ids": "logprobs of chosen token ids are not implemented; use logprobs=N",
    "prompt_logprob_token_ids": "use prompt_logprobs=N",
    "prompt_logprob_start": "use prompt_logprobs=N",
    "thinking_token_budget": "reasoning budgets are not implemented",
    "repetition_detection": "repetition detection is not implemented",
    "watermarking": "watermarking is not implemented",
    "flat_logprobs": "logprobs always come as a list of dicts here",
    "trace_decode_token_ids": "trace replay is not implemented",
    "routed_experts_prompt_start": "mixture-of-experts routing records are not implemented",
}
# Unsupported fields whose "off" value is neither None nor False (vLLM's defaults).
OFF_VALUES = {"routed_experts_prompt_start": 0}
# The feature each unsupported field stands for, as its refusal names it (else its name).
UNSUPPORTED_FEATURES: dict[str, str] = {}

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
    """The core's prompt checks (their errors leave ``add_requests`` in vLLM's words: "The
    decoder prompt cannot be empty", "Token id 512 is out of vocabulary (vocab size 512)")."""
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.cpu().numpy()
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


# ------------------------------------------------------------------ the door

def add_requests(engine, requests: list, output_kind=None, sink=None, request_ids=None,
                 priorities=None) -> list:
    """Queue ``requests`` ((prompt, params) pairs) on ``engine`` (an ``LLMEngine``): every one
    checked first, then all queued (one bad request queues nothing). ``output_kind`` None: each
    request's own; ``sink`` None: ``step()``'s caller; ``priorities``: one per request (None: 0
    each); ``request_ids``: None entries get automatic ids. The core's errors leave in vLLM's
    words."""
    priorities = list(priorities) if priorities is not None else [0] * len(requests)
    try:
        for priority in priorities:
            check_priority(priority, engine.config.scheduling_policy)
        parsed = [_parse(engine, prompt, params) for prompt, params in requests]
        core = engine.engine_core
        with core.operation():
            ids = _claim_ids(engine, request_ids or [None] * len(requests))
            return core.add_requests(
                [Request(rid, p.token_ids, params, p.text, p.cache_salt, output_kind, priority)
                 for rid, (p, params), priority in zip(ids, parsed, priorities)], sink)
    except ParameterError as error:
        if isinstance(error, VLLMValidationError):
            raise
        raise as_vllm_error(error) from error


def check_priority(priority, policy: str) -> None:
    """An integer; other than 0 only under scheduling_policy="priority" (vLLM's words)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an int, got {type(priority).__name__}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")


def _parse(engine, prompt, params):
    params = params if params is not None else engine.get_default_sampling_params()
    check_params_type(params)
    check_vllm_fields(params)
    refuse_unserved(params)
    if engine.logits_processor_classes:  # each custom processor's own check (vLLM's)
        for cls in engine.logits_processor_classes:
            cls.validate_params(params)
    return parse_prompt(prompt, engine.tokenizer, engine.engine_core.limits.vocab_size), params


def _claim_ids(engine, wanted: list) -> list[str]:
    """Automatic ids skip every id in use or asked for (ids name requests only: a child
    sequence's "{i}_{id}" label never collides with anything)."""
    taken = set(engine.engine_core.output_processor.requests) | {r for r in wanted if r is not None}
    ids = []
    for rid in wanted:
        if rid is None:
            rid = str(next(engine.request_counter))
            while rid in taken:
                rid = str(next(engine.request_counter))
            taken.add(rid)
        ids.append(rid)
    return ids


# ------------------------------------------------------------------ vLLM's own fields

def check_vllm_fields(params) -> None:
    """The values of the fields vLLM's ``SamplingParams`` has beyond the core's (when
    ``params`` is one), at construction and again at submission, as the core's are."""
    if not hasattr(params, "skip_clone"):
        return  # the core's own SamplingParams: nothing more to check
    check_bool("skip_clone", params.skip_clone)
    if params.stream_interval is not None:
        params.stream_interval = as_int("stream_interval", params.stream_interval)
        require(params.stream_interval >= 1, "stream_interval", params.stream_interval,
                f"stream_interval must be at least 1, got {params.stream_interval}.")
    if params.extra_args is not None and not isinstance(params.extra_args, dict):
        raise VLLMValidationError(f"extra_args must be a dict, got "
                                  f"{type(params.extra_args).__name__}",
                                  parameter="extra_args", value=params.extra_args)


def refuse_unserved(params) -> None:
    """At submission: a structured output this engine cannot compile, and each vLLM field this
    engine does not serve set to anything but its default, refused by name."""
    if params.structured_outputs is not None:
        check_structured(params.structured_outputs)
    for name, reason in UNSUPPORTED_FIELDS.items():
        value = getattr(params, name, None)
        if value is not None and value is not False and value != OFF_VALUES.get(name):
            refuse(UNSUPPORTED_FEATURES.get(name, name), f"{name}={value!r}: {reason}")
