"""Whether the model's weights changed since the last forward: the engine's check between steps.

A parameter counts as changed when it is another tensor (a reassigned parameter), another
storage (``param.data = ...``), or its version counter moved: torch bumps it on every in-place
op on the tensor or a view of it -- ``with torch.no_grad(): p.mul_(2)``, ``load_state_dict``,
``CausalLM.load_weights``. A write through ``p.data`` is not seen: ``.data`` is a tensor with a
version counter of its own (autograd does not see such writes either); docs/vllm_api.md says so.

The engine asks ``changed()`` before it schedules a step, and drops every cached block when
the answer is yes (K/V computed under the old weights is never served); the model runner
``note()``s the weights each forward computes with.
"""
from __future__ import annotations

import operator

from torch import nn


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
