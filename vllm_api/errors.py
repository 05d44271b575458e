"""The exception types vLLM clients catch, and the one way this engine refuses a feature.

vLLM 0.32 raises ``VLLMValidationError`` for a bad request value; here it is a subclass of
the core's ``ParameterError``, a ``ValueError``, so ``except ValueError`` and
``except VLLMValidationError`` both catch it. The core words its errors its own way;
vllm_api/validation.py rewords them in vLLM's texts wherever the vLLM layer calls the core's
checks. A feature this engine does not serve (LoRA,
structured outputs, beam search, pooling, ...) is refused when it is *used* -- its parameter
objects construct fine -- with an ``UnsupportedFeatureError`` whose message names the feature.
An attribute of vLLM's classes that this engine has no counterpart for raises
``UnsupportedAttributeError``, an ``UnsupportedFeatureError`` that is also an
``AttributeError``, so ``getattr(obj, name, None)`` and ``hasattr`` still answer.
``EngineDeadError`` is vLLM's: the engine failed in a step and serves nothing more.
"""
from __future__ import annotations

from core.errors import ParameterError


class VLLMValidationError(ParameterError):
    """vLLM's error for a bad request value, in vLLM's words; ``parameter`` and ``value`` name
    it (and ``rule`` / ``bound``, from the core's error it rewords)."""


class UnsupportedFeatureError(ValueError):
    """A vLLM feature this engine does not serve was used; ``feature`` names it."""

    def __init__(self, feature: str, reason: str) -> None:
        super().__init__(f"{feature} are not supported by this engine: {reason}"
                         if feature.endswith("s") else
                         f"{feature} is not supported by this engine: {reason}")
        self.feature = feature


def refuse(feature: str, reason: str) -> None:
    """Raise the refusal for ``feature`` ("structured outputs", "LoRA", ...)."""
    raise UnsupportedFeatureError(feature, reason)


class UnsupportedAttributeError(UnsupportedFeatureError, AttributeError):
    """A vLLM attribute read here: refused naming the feature, and an AttributeError."""


class EngineGenerateError(RuntimeError):
    """vLLM's recoverable ``generate()`` failure, for ``except`` clauses: a request here fails
    with its own error (a ValueError at submission), the engine serving on."""


class EngineDeadError(RuntimeError):
    """vLLM's ``EngineDeadError``: a step failed, the engine is stopped for every caller;
    ``__cause__`` is what the step raised."""

    def __init__(self, cause: BaseException | None = None) -> None:
        detail = f" The step raised {cause!r}." if cause is not None else ""
        super().__init__("EngineCore encountered an issue. See stack trace (above) for the "
                         "root cause." + detail)
        self.__cause__ = cause
