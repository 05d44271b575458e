"""The engine's step minus the forward, for questions about hashing that need no model.

Hashing never reads K/V, so admitting a sequence and committing its prefill chunk by chunk
runs the lookup, the in-flight marks and every save exactly as ``EngineCore.step`` does; only
the model is left out (which makes a 4096-token prompt take a blink). The figures and the
exercises use it.
"""
from __future__ import annotations

from scheduler import Scheduler, Sequence


def prefill_without_model(scheduler: Scheduler, seq: Sequence) -> None:
    """Admit ``seq``, commit its whole prefill step by step, then finish it (its blocks freed,
    the cached ones kept for others)."""
    scheduler.add(seq)
    while seq.num_computed_tokens < seq.num_tokens:
        scheduler.commit(scheduler.schedule())
    scheduler.finish(seq, "length")
