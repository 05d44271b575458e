"""The fast layer's backend: the core's ``Backend`` seam with faster machinery behind it.

What runs is a ``FastPaths`` (fast/paths.py, chosen once from the engine's settings):

* attention: the kinds of fast/attention.py, planned once per step (``FastAttention``), with
  the compiled kernels' routes where the paths hold them;
* linears: where packed, a replacement per linear part and SiLU MLP of the user's model
  (fast/linear.py); a weight format's linears by its kernels, chosen per row count once per
  linear (fast/format_kernels.py); norms and each head's norm + RoPE by the compiled glue
  (fast/glue.py); at a step of decode rows only, each decoder layer in one compiled call of
  those same kernels (fast/decode_layer.py) -- all through model.py's backend seam, on the
  model's own parameters: no copy of the model;
* the KV pool on huge pages (fast/cpu_memory.py);
* before each step, the CPU tuning's thread check (fast/tuning.py), when an entry point gave one.

``describe()`` prints the paths, why any kernel is off, and each weight format's linears'
kernel per row count. Every part is tested equal to the plain path (tests/test_plain_path.py,
test_attention_kinds.py, test_one_model.py).
"""
from __future__ import annotations

from core.backend import Backend
from fast.attention import FastAttention, FastPlan
from fast.cpu_memory import zeros_on_huge_pages
from fast.decode_layer import layer_replacements
from fast.format_kernels import format_replacements
from fast.glue import glue_replacements
from fast.linear import packed_replacements
from fast.paths import FastPaths, choose_paths
from fast.tuning import CpuTuning
from model import CausalLM, SeqChunk


class FastBackend(Backend):
    name = "fast"

    def __init__(self, model: CausalLM, paths: FastPaths | None = None,
                 tuning: CpuTuning | None = None) -> None:
        """``paths`` None: ``choose_paths`` for the model with the kernels (vLLM's default)."""
        super().__init__(model)
        cfg = model.config
        if paths is None:
            paths = choose_paths(cfg, model.dtype, model.device, enforce_eager=False)
        self.paths, self.tuning = paths, tuning
        self.attention = FastAttention(set(cfg.layer_windows), cfg.num_heads // cfg.num_kv_heads,
                                       model.dtype, model.device, paths.routes)
        self.replacements = self._replacements()

    def _replacements(self) -> dict:
        out = packed_replacements(self.model, self.paths.small_linear) if self.paths.pack_linears else {}
        if self.paths.glue is not None:
            out.update(glue_replacements(self.model, self.paths.glue))
        for kernels in self.paths.formats:
            out.update(format_replacements(self.model, kernels))
        if self.paths.glue is not None and self.paths.routes.decode_kernel is not None:
            out.update(layer_replacements(self.model, out, self.paths.glue))
        return out

    def rederive(self) -> None:
        """Fresh replacements (packed weights are derived again at their next call), installed
        at the next forward."""
        self.replacements = self._replacements()
        with self._lock:
            self._installed[0] = None

    @property
    def pack_linears(self) -> bool:
        return self.paths.pack_linears

    @property
    def kernels(self):
        """The kernel build (fast/kernels.py), None under enforce_eager or off CPU."""
        return self.paths.build

    def plan(self, chunks: list[SeqChunk], block_size: int) -> FastPlan:
        return self.attention.plan(chunks, block_size)

    def kv_zeros(self, shape: tuple[int, ...], *, dtype, device):
        return zeros_on_huge_pages(shape, dtype, device)

    def before_step(self) -> None:
        if self.tuning is not None:
            self.tuning.maybe_update()

    def describe(self) -> str:
        parts = [self.paths.describe()] + self.described_linears()
        parts += [self.tuning.describe()] if self.tuning is not None else []
        return f"{self.name} ({', '.join(parts)})"


def build_backend(model: CausalLM, *, fast_paths: bool, enforce_eager: bool,
                  tuning: CpuTuning | None = None) -> Backend:
    """The backend an engine runs, from its settings: the core's plain ``Backend`` for
    ``fast_paths=False``, else a ``FastBackend`` on the paths ``choose_paths`` picks."""
    if not fast_paths:
        return Backend(model)
    paths = choose_paths(model.config, model.dtype, model.device, enforce_eager=enforce_eager)
    return FastBackend(model, paths, tuning)
