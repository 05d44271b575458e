"""The core's request errors in vLLM's words.

The core words its errors its own way and carries what is wrong as fields (core/errors.py).
Where the vLLM layer calls the core's checks (``SamplingParams`` construction and
``check_against``, prompt intake, ``LLMEngine.add_requests``) it runs them ``in_vllms_words()``:
every ``ParameterError`` comes out a ``VLLMValidationError`` whose message is vLLM's text,
word for word, where vLLM has one for that check (vLLM's tests match on them), and the core's
message where it has none.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from core.errors import LogprobsLimitError, OutOfVocabularyError, ParameterError, PromptTooLongError
from vllm_api.errors import VLLMValidationError

# (parameter, rule) of the core's check -> vLLM's text for it ({value}, {bound}: the error's).
VLLM_TEXTS = {
    ("n", "minimum"): "n must be at least 1, got {value}.",
    ("n", "greedy"): "n must be 1 when using greedy sampling, got {value}.",
    ("max_tokens", "minimum"): "max_tokens must be at least 1, got {value}.",
    ("min_tokens", "minimum"): "min_tokens must be greater than or equal to 0, got {value}.",
    ("min_tokens", "maximum"): "min_tokens must be less than or equal to max_tokens={bound}, "
                               "got {value}.",
    ("presence_penalty", "range"): "presence_penalty must be in [-2, 2], got {value}.",
    ("frequency_penalty", "range"): "frequency_penalty must be in [-2, 2], got {value}.",
    ("repetition_penalty", "positive"): "repetition_penalty must be greater than zero, got "
                                        "{value}.",
    ("top_p", "range"): "top_p must be in (0, 1], got {value}.",
    ("min_p", "range"): "min_p must be in [0, 1], got {value}.",
    ("top_k", "minimum"): "top_k must be 0 (disable), or at least 1, got {value}.",
    ("temperature", "minimum"): "temperature must be non-negative, got {value}.",
    ("logprobs", "minimum"): "logprobs must be non-negative or -1, got {value}.",
    ("prompt_logprobs", "minimum"): "prompt_logprobs must be non-negative or -1, got {value}.",
    ("stop", "empty_entry"): "stop cannot contain an empty string.",
    ("stop", "needs_detokenize"): "stop strings are only supported when detokenize is True. "
                                  "Set detokenize=True to use stop.",
    ("logit_bias", "key_type"): "logit_bias contains key(s) that cannot be converted to integer "
                                "token IDs: {value!r}",
    ("allowed_token_ids", "empty"): "allowed_token_ids is not None and empty! (no token could "
                                    "ever be sampled)",
    ("prompt_token_ids", "empty"): "The decoder prompt cannot be empty",
    # structured outputs (core/grammar.py compiles them at submission): vLLM's xgrammar checks
    ("structured_outputs", "json_syntax"): "Invalid JSON grammar specification.",
    ("structured_outputs", "json"): "Failed to transform json schema into a grammar: {value}",
    ("structured_outputs", "regex"): "Failed to transform regex into a grammar: {value}",
    ("structured_outputs", "choice"): "Failed to transform choices into a grammar: {value}",
    ("structured_outputs", "grammar"): "Invalid grammar specification.",
}


@contextlib.contextmanager
def in_vllms_words() -> Iterator[None]:
    """Run the core's checks inside: a ``ParameterError`` leaves as a ``VLLMValidationError``
    (the core's error its ``__cause__``); one already in vLLM's words leaves as it is."""
    try:
        yield
    except VLLMValidationError:
        raise
    except ParameterError as error:
        raise as_vllm_error(error) from error


def as_vllm_error(error: ParameterError) -> VLLMValidationError:
    """``error`` as vLLM raises it: vLLM's text and parameter name where vLLM has them."""
    text, parameter = vllm_text(error)
    return VLLMValidationError(text, parameter=parameter, value=error.value, rule=error.rule,
                               bound=error.bound)


def vllm_text(error: ParameterError) -> tuple[str, str | None]:
    """vLLM's message for ``error`` and the parameter vLLM names in it."""
    if isinstance(error, PromptTooLongError):
        return prompt_too_long_text(error)
    if isinstance(error, OutOfVocabularyError):
        return out_of_vocabulary_text(error), error.parameter
    if isinstance(error, LogprobsLimitError):
        return logprobs_limit_text(error), error.parameter
    template = VLLM_TEXTS.get((error.parameter, error.rule))
    if template is None:
        return str(error), error.parameter
    return template.format(value=error.value, bound=error.bound), error.parameter


def prompt_too_long_text(error: PromptTooLongError) -> tuple[str, str]:
    """vLLM's two messages: a prompt over ``max_model_len``, and one that fills it exactly."""
    length, limit = error.num_prompt_tokens, error.max_model_len
    if error.exceeds:
        return (f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains {length} input tokens, which exceeds this limit even without any "
                f"output tokens. Please reduce the length of the input prompt.", "input_tokens")
    return (f"The decoder prompt (length {length}) plus the number of requested output tokens "
            f"(at least 1) is longer than the maximum model length of {limit}. Make sure that "
            f"`max_model_len` is no smaller than the number of text tokens (prompt + requested "
            f"output tokens).", "prompt")


def out_of_vocabulary_text(error: OutOfVocabularyError) -> str:
    """vLLM's words for a prompt's id (the first) or a parameter's ids outside the vocabulary."""
    if error.parameter == "prompt_token_ids":
        return f"Token id {error.token_ids[0]} is out of vocabulary (vocab size {error.vocab_size})"
    return (f"token_id(s) {error.token_ids[:5]} in {error.parameter} contain out-of-vocab token "
            f"ids. Vocabulary size: {error.vocab_size} (the vocabulary is "
            f"[0, {error.vocab_size}))")


def logprobs_limit_text(error: LogprobsLimitError) -> str:
    """vLLM's words for more logprobs than ``max_logprobs`` allows."""
    what = "sample logprobs" if error.parameter == "logprobs" else "prompt logprobs"
    return (f"Requested {what} of {error.requested}, which is greater than max allowed: "
            f"{error.limit} (the engine argument max_logprobs={error.max_logprobs}, as in vLLM; "
            f"max_logprobs=-1 allows the whole vocabulary)")
