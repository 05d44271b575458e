"""vLLM's top-level names for parts this engine does not have: the model registry and Ray
clusters (and vLLM's argument parser). They import; using them raises, naming the feature."""
from __future__ import annotations

import argparse

from vllm_api.errors import refuse


class ModelRegistry:
    """vLLM's registry of model classes: the engine's architectures are built in."""

    @staticmethod
    def get_supported_archs() -> list[str]:
        from model import SUPPORTED_ARCHITECTURES
        return sorted(SUPPORTED_ARCHITECTURES)

    @staticmethod
    def register_model(*args, **kwargs) -> None:
        refuse("registering model classes", "only the built-in decoder architectures load")


def initialize_ray_cluster(*args, **kwargs) -> None:
    refuse("Ray clusters", "the engine runs in one process on one device")


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's argument parser (``vllm.utils.argparse_utils``), which its examples build
    ``EngineArgs.add_cli_args`` on; also accepts ``--flag=value`` and underscores."""

    def parse_args(self, args=None, namespace=None):
        import sys
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_args([_dashes(a) for a in args], namespace)


def _dashes(arg: str) -> str:
    """``--max_num_seqs=4`` -> ``--max-num-seqs=4`` (vLLM accepts both spellings)."""
    if not arg.startswith("--"):
        return arg
    flag, sep, value = arg.partition("=")
    return flag.replace("_", "-") + sep + value
