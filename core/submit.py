"""A request at submission: everything that can fail about it is checked here, before anything
is queued or allocated, so a request the core accepts can never make a step raise.

``Request`` is what a caller hands the engine core: token ids (text prompts are the vLLM
layer's to tokenize), ``SamplingParams`` and an optional ``cache_salt``. ``make_request``
checks the ids against the vocabulary, takes the engine's own verified copy of the
parameters (a caller mutating its object afterwards changes nothing queued), checks that the
request fits the model and the pool, and builds the records: one ``RequestState`` and a
``Sequence`` per each of its ``n`` samples.

Errors are the core's, in its own words: a ``ValueError`` naming what is wrong, and where a
caller may want to word it otherwise, one of core/errors.py's that carries it as fields
(``ParameterError`` with a ``rule``, ``OutOfVocabularyError``, ``PromptTooLongError``). The
vLLM layer rewords those in vLLM's texts (vllm_api/validation.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.detokenizer import IncrementalDetokenizer
from core.grammar import GrammarCompiler, SequenceGrammar
from core.requests import OutputSink, RequestState, SequenceState
from core.errors import OutOfVocabularyError, ParameterError, PromptTooLongError
from core.sampling_params import RequestOutputKind, SamplingParams
from scheduler import Sequence

DETOKENIZE_CONTEXT = 5  # prompt tokens the output text is decoded after (vLLM's offset)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: object          # a 1-D list / array of ints
    params: SamplingParams
    prompt: str | None = None         # the text, when it came as text
    cache_salt: str | None = None
    output_kind: RequestOutputKind | None = None  # None: the params' own
    priority: int = 0                 # scheduling_policy="priority": lower runs first


@dataclass
class Limits:
    """What a request is checked against: the model, the pool and the engine's settings."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    max_logprobs: int = 20


def make_request(request: Request, limits: Limits, tokenizer, root_hash, sink: OutputSink,
                 grammars: GrammarCompiler | None = None) -> RequestState:
    """The records of one valid request, or a ValueError that names what is wrong.
    ``root_hash(cache_salt)``: the seed of its chain (the prefix cache's). A constrained
    request's grammar is compiled here, by ``grammars`` (once per constraint), and each of its
    sequences gets its own matcher."""
    ids = check_prompt_ids(request.prompt_token_ids, limits.vocab_size)
    check_prompt_length(ids.size, limits.max_model_len)
    check_cache_salt(request.cache_salt)
    params = own_params(request.params, ids.size, limits, tokenizer)
    budget = check_fits(ids.size, params.max_tokens, limits)
    compiled = compile_constraint(params, grammars)
    state = RequestState(request.request_id, request.prompt, ids.tolist(), params,
                         request.output_kind or params.output_kind, sink)
    root = root_hash(request.cache_salt)
    for index, child in enumerate(child_params(params)):
        label = request.request_id if params.n == 1 else f"{index}_{request.request_id}"
        seq = Sequence(ids, min(child.max_tokens, budget), request_id=label, cache_salt=request.cache_salt,
                       root_hash=root, reads_prefix_cache=child.reads_prefix_cache,
                       priority=request.priority)
        detok = (IncrementalDetokenizer(tokenizer, child, ids[-DETOKENIZE_CONTEXT:])
                 if tokenizer is not None and child.detokenize else None)
        state.sequences.append(SequenceState(index, seq, state, child, detok,
                                             [] if child.logprobs is not None else None,
                                             grammar=None if compiled is None
                                             else SequenceGrammar(compiled)))
    return state


def compile_constraint(params: SamplingParams, grammars: GrammarCompiler | None):
    """The compiled grammar of the request's ``structured_outputs`` (None: unconstrained)."""
    if params.structured_outputs is None:
        return None
    if grammars is None:
        raise ValueError("structured outputs need a grammar compiler (EngineCore builds one)")
    return grammars.compile(params.structured_outputs)


def check_prompt_ids(token_ids, vocab_size: int) -> np.ndarray:
    """The prompt as a 1-D int64 array of ids inside the vocabulary."""
    try:
        ids = np.asarray(token_ids)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"a prompt must be a flat list of token ids: {exc}") from None
    if ids.size and (ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"a prompt must be a flat list of integer token ids, got an array of "
                         f"shape {ids.shape} and dtype {ids.dtype}")
    if ids.size == 0:
        raise ParameterError("the prompt has no tokens; a request needs at least one",
                             parameter="prompt_token_ids", value=[], rule="empty")
    out_of_range = (ids < 0) | (ids >= vocab_size)
    if out_of_range.any():
        raise OutOfVocabularyError("prompt_token_ids", [int(t) for t in ids[out_of_range]],
                                   vocab_size)
    return ids.astype(np.int64)


def check_cache_salt(salt) -> None:
    """A salt seeds the chain as its UTF-8 bytes: a string that has them."""
    if salt is None:
        return
    if not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"cache_salt cannot be encoded as UTF-8 (character {salt[exc.start]!r} "
                         f"at position {exc.start}); use a string of valid text") from None


def own_params(params: SamplingParams, num_prompt_tokens: int, limits: Limits, tokenizer) -> SamplingParams:
    """The engine's verified copy of ``params``; ``max_tokens=None`` becomes what
    ``max_model_len`` leaves after the prompt (vLLM's)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    own = params.clone()
    # The core's checks, whatever the class: a subclass's own fields are its layer's to check
    # (the vLLM layer's, at its intake), so a request never bounces back up through it.
    SamplingParams.check_against(own, limits.vocab_size, limits.max_logprobs, tokenizer)
    if own.max_tokens is None:
        room = limits.max_model_len - num_prompt_tokens  # >= 1: check_prompt_length ran first
        own.max_tokens = room
        if own.min_tokens > room:
            raise ValueError(f"min_tokens ({own.min_tokens}) exceeds the {room} tokens "
                             f"max_model_len {limits.max_model_len} leaves after the prompt")
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


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    """A prompt must leave room for one generated token within ``max_model_len``: else a
    ``PromptTooLongError`` (its ``exceeds`` tells a prompt over the limit from one that fills
    it, which vLLM words differently)."""
    if num_prompt_tokens >= max_model_len:
        raise PromptTooLongError(num_prompt_tokens, max_model_len)


def check_fits(num_prompt_tokens: int, max_tokens: int, limits: Limits) -> int:
    """How many tokens the request may generate: ``max_tokens``, capped at what
    ``max_model_len`` leaves after the prompt (vLLM runs such a request and finishes it with
    finish_reason "length" at the limit). Raises if even that could never fit the pool."""
    budget = min(max_tokens, limits.max_model_len - num_prompt_tokens)
    total = num_prompt_tokens + budget
    needed = -(-(total - 1) // limits.block_size)  # the last generated token needs no K/V slot
    if needed > limits.num_blocks:
        raise ValueError(f"request needs {needed} KV blocks (prompt + max_tokens = {total} "
                         f"tokens) but the whole pool has {limits.num_blocks}; raise num_kv_blocks")
    return budget
