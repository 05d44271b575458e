"""The vLLM layer: vLLM's offline API (``LLM``, ``LLMEngine``, engine arguments, prompt
intake, public names and refusals), built on the core from outside. ``engine.py`` re-exports
the public names, so ``from engine import LLM, SamplingParams`` reads as ``from vllm import ...``."""
