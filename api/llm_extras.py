"""vLLM's ``LLM`` methods that scripts touch beyond generating (profiling, metrics), as a mixin
``LLM`` inherits, so engine.py keeps only the engine's own work."""
from __future__ import annotations


class LLMExtras:
    """Mixed into ``engine.LLM``; uses only its public surface (``stats()``, ...)."""
