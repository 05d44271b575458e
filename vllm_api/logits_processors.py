"""vLLM's custom logits processor interface (``vllm.v1.sample.logits_processor``), so a script
that defines one imports and runs up to its use instead of dying at import.

A subclass of ``LogitsProcessor`` defines fine; passing it to the engine
(``LLM(..., logits_processors=[MyProcessor])``) is refused naming the feature
(engine_args.py): the sampler here has no hook for per-batch processors. ``BatchUpdate``,
``MoveDirectionality`` and ``process_dict_updates`` behave as vLLM's, so a processor's own
bookkeeping can be unit-tested with them.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # request a moved to slot b
    SWAP = enum.auto()            # requests a and b swap slots


@dataclass(frozen=True)
class BatchUpdate:
    """The persistent batch's changes in one step: removed, then added, then moved."""
    batch_size: int
    removed: Sequence[int]
    added: Sequence[tuple]  # (index, SamplingParams, prompt token ids | None, output token ids)
    moved: Sequence[tuple]  # (from index, to index, MoveDirectionality)


class LogitsProcessor(ABC):
    """vLLM's interface: ``apply(logits)``, ``is_argmax_invariant()``, ``update_state()``."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """Raise ValueError for parameters this processor cannot serve."""
        return None

    @abstractmethod
    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits):
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        raise NotImplementedError


def process_dict_updates(req_entries: dict, batch_update: BatchUpdate | None,
                         new_state: Callable) -> bool:
    """Apply ``batch_update`` to a per-slot dict of state (``new_state(params, prompt_ids,
    output_ids)`` -> state or None); True if any entry changed."""
    if not batch_update:
        return False
    updated = False
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            updated = True
        elif req_entries.pop(index, None) is not None:
            updated = True
    if req_entries:
        updated = _removed_and_moved(req_entries, batch_update) or updated
    return updated


def _removed_and_moved(req_entries: dict, batch_update: BatchUpdate) -> bool:
    updated = False
    for index in batch_update.removed:
        if req_entries.pop(index, None):
            updated = True
    for a_index, b_index, direction in batch_update.moved:
        a_entry, b_entry = req_entries.pop(a_index, None), req_entries.pop(b_index, None)
        if a_entry is not None:
            req_entries[b_index] = a_entry
            updated = True
        if b_entry is not None:
            updated = True
            if direction == MoveDirectionality.SWAP:
                req_entries[a_index] = b_entry
    return updated
