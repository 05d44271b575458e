"""The core's request errors: ``ValueError``s worded in the core's own terms that also carry
what is wrong as fields, so a layer above can say it in its own words without parsing a
message (the vLLM layer gives vLLM's texts: vllm_api/validation.py).

``ParameterError``: one value of a request fails a check. ``parameter`` names the value,
``value`` is what was given, ``rule`` names the check it failed ("minimum", "maximum",
"range", "positive", "greedy", "empty", "empty_entry", "needs_detokenize", "key_type"; None
for a check no layer words differently) and ``bound`` is what it was checked against.
Three kinds carry more: ``OutOfVocabularyError`` (token ids outside the vocabulary),
``PromptTooLongError`` (a prompt that leaves no room for an output token) and
``LogprobsLimitError`` (more logprobs per position than ``max_logprobs`` allows).
"""
from __future__ import annotations


class ParameterError(ValueError):
    """A request value is invalid; ``parameter``, ``value``, ``rule`` and ``bound`` say how."""

    def __init__(self, message: str, *, parameter: str | None = None, value=None,
                 rule: str | None = None, bound=None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value
        self.rule = rule
        self.bound = bound


class OutOfVocabularyError(ParameterError):
    """Token ids given in ``parameter`` (``prompt_token_ids``, ``stop_token_ids``,
    ``logit_bias``, ...) lie outside ``[0, vocab_size)``; ``token_ids`` lists them."""

    def __init__(self, parameter: str, token_ids: list[int], vocab_size: int) -> None:
        super().__init__(f"{parameter} holds token id(s) {token_ids[:5]} outside the "
                         f"vocabulary, whose ids are [0, {vocab_size})",
                         parameter=parameter, value=token_ids, rule="vocabulary",
                         bound=vocab_size)
        self.token_ids = token_ids
        self.vocab_size = vocab_size


class PromptTooLongError(ParameterError):
    """A prompt of ``num_prompt_tokens`` tokens leaves no room for one generated token
    within ``max_model_len`` (it exceeds it, or fills it exactly)."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(f"a prompt of {num_prompt_tokens} tokens leaves no room for an output "
                         f"token within max_model_len={max_model_len} (a prompt may have at "
                         f"most {max_model_len - 1} tokens)",
                         parameter="prompt_token_ids", value=num_prompt_tokens,
                         rule="max_model_len", bound=max_model_len)
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len

    @property
    def exceeds(self) -> bool:
        """True when the prompt alone is longer than ``max_model_len`` (else it fills it)."""
        return self.num_prompt_tokens > self.max_model_len


class LogprobsLimitError(ParameterError):
    """``parameter`` (``logprobs`` or ``prompt_logprobs``) asks for ``requested`` logprobs
    per position, over ``limit``: the engine's ``max_logprobs`` (-1: the whole vocabulary),
    capped at the vocabulary size."""

    def __init__(self, parameter: str, value: int, requested: int, limit: int,
                 max_logprobs: int) -> None:
        super().__init__(f"{parameter}={value} asks for {requested} logprobs per position, "
                         f"over the engine's limit of {limit} (max_logprobs={max_logprobs}; "
                         f"max_logprobs=-1 allows the whole vocabulary)",
                         parameter=parameter, value=value, rule="max_logprobs", bound=limit)
        self.requested = requested
        self.limit = limit
        self.max_logprobs = max_logprobs
