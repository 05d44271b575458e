"""vLLM's output names beyond the core's (core/outputs.py): the end-of-stream sentinel and
the error type of a failed request."""
from __future__ import annotations

STREAM_FINISHED = object()  # vLLM's end-of-stream sentinel (offline calls never stream)


class RequestError(Exception):
    """vLLM's error for a request that failed inside the engine (here such a request
    finishes alone with ``finish_reason="error"`` instead)."""
