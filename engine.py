"""The engine's public face: ``from engine import LLM, SamplingParams`` reads as vLLM's
``from vllm import LLM, SamplingParams``, and the same script moves to vLLM unchanged.

The house has three floors, imports pointing down only (tests/test_layout.py checks it):

* the core -- the design card's files (scheduler.py, block_manager.py, prefix_cache.py,
  model.py) and core/, whose ``EngineCore`` (core/engine_core.py) is the step loop;
* the fast layer -- fast/, plugged into the core through one seam (core/backend.py);
* the vLLM layer -- vllm_api/: ``LLM``, ``LLMEngine``, engine arguments, intake, refusals.

The chapter's ``_lookup_prefix_cache`` and ``_do_prefill_step``, which the chapter puts in
engine.py, are in prefix_cache.py (``PrefixCache``); the scheduler calls them through
``lookup`` and ``cache_blocks``.

This file only names what the floors export. ``engine.__version__`` is the vLLM release whose
API the vLLM layer follows (0.32.0), so frameworks' version gates take that branch.
"""
from __future__ import annotations

from core.backend import Backend
from core.engine_core import EngineCore
from scheduler import Sequence
from vllm_api.llm import LLM
from vllm_api.llm_engine import LLMEngine
from vllm_api.public import *  # noqa: F403 -- vLLM's public names, importable from here
from vllm_api.public import __all__ as _VLLM_NAMES
from vllm_api.public import __version__, __version_tuple__  # the vLLM API version followed

__all__ = ["LLM", "LLMEngine", "EngineCore", "Backend", "Sequence", *_VLLM_NAMES]
