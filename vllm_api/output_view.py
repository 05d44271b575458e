"""vLLM's ``OutputProcessor`` as its users read it (``engine.output_processor`` of ``AsyncLLM``
and ``LLMEngine``: vLLM's tests and OpenRLHF count unfinished requests through it), on the
core's own output processor. Read-only: requests change through the engine."""
from __future__ import annotations


class OutputProcessorView:
    """``request_states``, ``has_request``, ``get_num_unfinished_requests``,
    ``has_unfinished_requests`` and ``tokenizer`` of ``engine`` (an ``LLMEngine``)."""

    log_stats = False
    tracing_enabled = False
    stream_interval = 1

    def __init__(self, engine) -> None:
        self._engine = engine

    @property
    def request_states(self) -> dict:
        """Request id -> the core's ``RequestState`` of each live request."""
        return dict(self._engine.engine_core.output_processor.requests)

    @property
    def tokenizer(self):
        return self._engine.tokenizer

    def has_request(self, request_id: str) -> bool:
        return request_id in self._engine.engine_core.output_processor.requests

    def get_num_unfinished_requests(self) -> int:
        return len(self._engine.engine_core.output_processor.requests)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0
