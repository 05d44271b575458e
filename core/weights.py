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

from torch import nn


class WeightVersions:
    """The model's parameters as the last forward saw them."""

    def __init__(self, model: nn.Module) -> None:
        # (module, name) pairs: a reassigned parameter is found without walking the tree.
        self._slots = [(module, name) for module in model.modules()
                       for name in module._parameters]
        self._seen = self._look()

    def _look(self) -> list:
        """Per slot: the parameter (held, so its id is never reused), its storage, its version."""
        params = [module._parameters[name] for module, name in self._slots]
        return [(p, None if p is None else p.data_ptr(), None if p is None else p._version)
                for p in params]

    def changed(self) -> bool:
        """True if any parameter differs from what the last ``note()`` saw."""
        for (module, name), (p, ptr, version) in zip(self._slots, self._seen):
            now = module._parameters[name]
            if now is not p or (p is not None and (p._version != version or p.data_ptr() != ptr)):
                return True
        return False

    def note(self) -> None:
        """Remember the parameters as they are now (a forward computes with them)."""
        self._seen = self._look()
