"""One forward for a step: pack the scheduled chunks, run the model once, sample.

The backend (core/backend.py: the plain path, or the fast layer's) plans the step's attention
once and runs the forward, on the user's model itself. The runner also keeps the weights the
cached K/V was computed with (``WeightVersions``, at the end): the engine asks ``weights_changed`` before it
plans a step, and a forward during which they changed (another thread, a hook) gives no
result, so K/V of mixed weights is never committed. Logits are computed only where they are needed: each sampled
sequence's last position, and the prompt positions of requests that asked for prompt logprobs.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from block_manager import KVCachePool
from core.backend import Backend
from core.requests import RequestState, SequenceState
from core.sampler import Sampler, SamplerOutput, TokenLogprobs, prompt_logprobs
from model import SeqChunk
from scheduler import ScheduledChunk, Sequence


@dataclass
class StepResult:
    """What one forward produced: a token for each sequence it completed, and prompt logprobs."""

    sampled: list[SequenceState]
    sample: SamplerOutput
    prompt_rows: list[tuple[RequestState, list[TokenLogprobs]]]


@dataclass
class LogitsPlan:
    """Which packed positions need logits, and which of those rows are sampled."""

    logits_index: list[int]
    sample_rows: list[int]
    prompt_rows: list[tuple[RequestState, int, range]]  # (request, first logits row, positions)

    @property
    def samples_every_row(self) -> bool:
        """Every logits row is sampled, in order: the sampler takes the logits without a copy."""
        return len(self.sample_rows) == len(self.logits_index)

    @classmethod
    def build(cls, chunks: list[ScheduledChunk], request_of) -> "LogitsPlan":
        plan, offset = cls([], [], []), 0
        for chunk in chunks:
            seq, start = chunk.seq, chunk.start
            request = request_of(seq)
            positions = _prompt_positions(request, seq, start, start + chunk.num_tokens)
            if positions:
                plan.prompt_rows.append((request, len(plan.logits_index), positions))
                plan.logits_index += [offset + p - start for p in positions]
            if chunk.completes_sequence:
                plan.sample_rows.append(len(plan.logits_index))
                plan.logits_index.append(offset + chunk.num_tokens - 1)
            offset += chunk.num_tokens
        return plan


def _prompt_positions(state: RequestState, seq: Sequence, start: int, end: int) -> range:
    """Positions p in [start, end) whose logits score prompt token p + 1 and are still missing
    (only the request's first sequence computes them, once, even if it is preempted)."""
    if state.params.prompt_logprobs is None or seq is not state.sequences[0].seq:
        return range(0)
    first_missing = max(state.prompt_logprobs_done, 1) - 1
    return range(max(start, first_missing), min(end, seq.num_prompt_tokens - 1))


class ModelRunner:
    """Runs the model on the KV pool and samples; changes no sequence (the engine commits)."""

    def __init__(self, backend: Backend, kv_cache: KVCachePool, sampler: Sampler) -> None:
        self.backend, self.kv_cache, self.sampler = backend, kv_cache, sampler
        self.model, self.device = backend.model, backend.model.device
        self.weights = WeightVersions(self.model)  # what the K/V in the pool was computed with

    def weights_changed(self) -> bool:
        """Whether a parameter changed (in place, reassigned, loaded) since the K/V in the pool
        was computed: it is then not this model's any more."""
        return self.weights.changed()

    def note_weights(self) -> None:
        """The pool's K/V was dropped: what comes next is computed with the weights as they are."""
        self.weights.note()

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    def run(self, chunks: list[ScheduledChunk], state_of) -> StepResult | None:
        """``state_of(seq)``: the engine's ``SequenceState`` of a scheduled sequence. None when
        the weights changed while the forward ran: its K/V mixes two models."""
        plan = LogitsPlan.build(chunks, lambda seq: state_of(seq).request)
        logits = self._forward(chunks, plan.logits_index)
        sampled = [state_of(c.seq) for c in chunks if c.completes_sequence]
        sample = self.sampler(logits if plan.samples_every_row else logits[plan.sample_rows],
                              sampled)
        if self.weights.changed():
            return None
        return StepResult(sampled, sample, self._prompt_logprobs(logits, plan))

    def _forward(self, chunks: list[ScheduledChunk], logits_index: list[int]) -> torch.Tensor:
        seq_chunks = [SeqChunk(c.start, c.num_tokens, c.block_table) for c in chunks]
        input_ids = np.concatenate([c.seq.tokens[s.start:s.start + s.length]
                                    for c, s in zip(chunks, seq_chunks)])
        self.backend.before_step()
        plan = self.backend.plan(seq_chunks, self.block_size)
        return self.backend.forward(torch.from_numpy(input_ids).to(self.device), plan, self.kv_cache,
                                    torch.tensor(logits_index, dtype=torch.long, device=self.device))

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, plan: LogitsPlan) -> list:
        rows = []
        for state, first_row, positions in plan.prompt_rows:
            seq = state.sequences[0].seq
            targets = seq.tokens[positions.start + 1:positions.stop + 1]
            part = logits[first_row:first_row + len(positions)]
            rows.append((state, prompt_logprobs(part, targets, state.params.prompt_logprobs)))
        return rows


# ------------------------------------------------------------------ the weights' versions
# Whether the model's weights changed since the last forward: the engine's check between steps.
#
# A parameter counts as changed when it is another tensor (a reassigned parameter), another
# storage (``param.data = ...``), or its version counter moved: torch bumps it on every in-place
# op on the tensor or a view of it -- ``with torch.no_grad(): p.mul_(2)``, ``load_state_dict``,
# ``CausalLM.load_weights``. A write through ``p.data`` is not seen: ``.data`` is a tensor with a
# version counter of its own (autograd does not see such writes either); docs/vllm_api.md says so.
#
# The engine asks ``changed()`` before it schedules a step, and drops every cached block when
# the answer is yes (K/V computed under the old weights is never served); the model runner
# ``note()``s the weights each forward computes with.


class WeightVersions:
    """The model's parameters as the last forward saw them."""

    def __init__(self, model: nn.Module) -> None:
        # Each module's own parameter dict and a name in it: a reassigned parameter is found
        # without walking the module tree again.
        self._slots = [(module._parameters, name) for module in model.modules()
                       for name, p in module._parameters.items() if p is not None]
        self.note()

    def _params(self) -> list:
        return [params[name] for params, name in self._slots]

    def changed(self) -> bool:
        """True if any parameter differs from what the last ``note()`` saw."""
        params = self._params()
        return (any(map(operator.is_not, params, self._seen)) or [p._version for p in params] != self._versions
                or [p.data_ptr() for p in params] != self._storages)

    def note(self) -> None:
        """Remember the parameters as they are now (a forward computes with them); held, so an
        id is never reused."""
        self._seen = self._params()
        self._versions = [p._version for p in self._seen]
        self._storages = [p.data_ptr() for p in self._seen]
