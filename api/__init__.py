"""The vLLM-facing surface: engine arguments and config, sampling parameters, prompt intake,
request outputs and checkpoint side files. ``engine.py`` re-exports the public names, so
``from engine import LLM, SamplingParams`` reads as ``from vllm import LLM, SamplingParams``."""
