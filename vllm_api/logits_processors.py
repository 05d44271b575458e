"""vLLM's custom logits processor interface (``vllm.v1.sample.logits_processor``), served.

``LLM(model, logits_processors=[MyProcessor])`` (a ``LogitsProcessor`` subclass, or its name as
"package.module:Class" / "package.module.Class") builds each one as vLLM does --
``MyProcessor(vllm_config, device, is_pin_memory)`` -- and runs it on every step's batch:
``update_state(BatchUpdate | None)``, then ``apply(logits)`` on the rows being sampled. The
class's ``validate_params(params)`` runs on each request at submission.

vLLM's batch is persistent: a request keeps its slot while it runs, new ones fill the holes
left by those removed, and the batch is condensed by moving the last rows into the remaining
holes. The core samples only the sequences a step completes, in the scheduler's order, so
``ProcessorAdapter`` keeps vLLM's slots itself, tells the processor the changes in vLLM's
terms (removed, then added, then moved) and hands ``apply`` the logits in slot order. Each added
request's output token list is live, as vLLM's: it grows as tokens are committed. A sequence
not sampled in a step (a prefill chunk that does not complete, a preempted one) leaves the
batch, as an unscheduled request leaves vLLM's. A processor that raises fails the step before
its commit: nothing of it is kept, and the engine reports the error to the caller.
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


# ---------------------------------------------------------------------------- the engine's side


def load_processor_classes(entries) -> list[type]:
    """The classes of ``logits_processors=[...]``: classes, or their fully qualified names."""
    if entries is None:
        return []
    if isinstance(entries, (str, type)):
        entries = [entries]
    classes = []
    for entry in entries:
        cls = _import_class(entry) if isinstance(entry, str) else entry
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"{entry!r} is not a subclass of LogitsProcessor "
                             f"(vllm.v1.sample.logits_processor.LogitsProcessor): "
                             f"logits_processors takes the classes (or their qualified names), "
                             f"which the engine builds")
        classes.append(cls)
    return classes


def _import_class(name: str) -> type:
    """"package.module:Class" or "package.module.Class"."""
    import importlib

    module_name, sep, qualname = name.partition(":")
    if not sep:
        module_name, _, qualname = name.rpartition(".")
    try:
        target = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"Failed to load LogitsProcessor plugin {name!r}: {exc}") from exc
    return target


class ProcessorAdapter:
    """One vLLM ``LogitsProcessor`` as the core sampler's batch processor (core/sampler.py):
    ``update_batch(rows)``, ``apply(logits)``, ``is_argmax_invariant()``."""

    def __init__(self, processor: LogitsProcessor) -> None:
        self.processor = processor
        self.slots: list = []            # slot -> the sequence's record (None: a hole)
        self.outputs: dict = {}          # record -> its live output token list
        self.order: list[int] | None = None  # this step's row of each slot (None: identity)

    def is_argmax_invariant(self) -> bool:
        return bool(self.processor.is_argmax_invariant())

    def update_batch(self, rows) -> None:
        """Tell the processor how the batch changed since the last step (vLLM's
        ``BatchUpdate``: removed, then added, then moved; None when nothing changed)."""
        present = {row: i for i, row in enumerate(rows)}
        removed = self._remove_absent(present)
        added = self._add_new(rows, removed)
        moved = self._condense()
        for row in rows:
            self._sync_outputs(row)
        update = None
        if removed or added or moved:
            update = BatchUpdate(len(self.slots), removed, added, moved)
        self.processor.update_state(update)
        order = [present[row] for row in self.slots]
        self.order = None if order == list(range(len(rows))) else order

    def apply(self, logits):
        """The processor's ``apply`` on the rows in slot order, handed back in row order."""
        if self.order is None:
            return self.processor.apply(logits)
        index = torch_index(self.order, logits.device)
        out = logits.clone()
        out[index] = self.processor.apply(logits[index])
        return out

    def _remove_absent(self, present: dict) -> list[int]:
        removed = []
        for slot, row in enumerate(self.slots):
            if row is not None and row not in present:
                removed.append(slot)
                self.slots[slot] = None
                self.outputs.pop(row, None)
        return removed

    def _add_new(self, rows, removed: list[int]) -> list[tuple]:
        """New rows fill the holes first; a hole refilled is no longer reported removed (vLLM's
        builder consumes it: the added entry replaces the state there)."""
        known = {row for row in self.slots if row is not None}
        added = []
        for row in rows:
            if row in known:
                continue
            slot = self.slots.index(None) if None in self.slots else len(self.slots)
            if slot in removed:
                removed.remove(slot)
            if slot == len(self.slots):
                self.slots.append(None)
            self.slots[slot] = row
            self.outputs[row] = []
            added.append((slot, row.sampling_params, row.tokens[:row.num_prompt_tokens].tolist(),
                          self.outputs[row]))
        return added

    def _condense(self) -> list[tuple]:
        """Move the last rows into the holes, as vLLM condenses its batch."""
        moved = []
        self._drop_trailing_holes()
        while None in self.slots:
            hole = self.slots.index(None)
            moved.append((len(self.slots) - 1, hole, MoveDirectionality.UNIDIRECTIONAL))
            self.slots[hole] = self.slots.pop()
            self._drop_trailing_holes()
        return moved

    def _drop_trailing_holes(self) -> None:
        while self.slots and self.slots[-1] is None:
            self.slots.pop()

    def _sync_outputs(self, row) -> None:
        live = self.outputs[row]
        done = row.num_prompt_tokens + len(live)
        if done < row.num_tokens:
            live.extend(int(t) for t in row.tokens[done:row.num_tokens])


def torch_index(order: list[int], device):
    import torch

    return torch.tensor(order, dtype=torch.long, device=device)


def build_processors(classes: list[type], vllm_config, device) -> list[ProcessorAdapter]:
    """Each class built as vLLM builds it, wrapped for the core's sampler."""
    pin = False  # no pinned host buffers: the engine copies nothing to a device asynchronously
    return [ProcessorAdapter(cls(vllm_config, device, pin)) for cls in classes]


def validate_params(classes: list[type], params) -> None:
    """Each class's ``validate_params`` on a request's parameters (at submission, as vLLM)."""
    for cls in classes:
        cls.validate_params(params)
