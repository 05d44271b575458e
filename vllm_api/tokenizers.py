"""vLLM's ``get_tokenizer`` (``vllm.get_tokenizer``, ``vllm.tokenizers`` and
``vllm.transformers_utils.tokenizer``): a checkpoint's Hugging Face tokenizer by its path.

Evaluation harnesses (lighteval's vLLM model) build their tokenizer with it before the engine.
Here it loads from a local directory (nothing is downloaded), with transformers' AutoTokenizer,
as the engine loads its own: the same object type ``LLM.get_tokenizer()`` returns. vLLM's
options that pick a tokenizer are honoured where they mean something locally
(``trust_remote_code``, ``tokenizer_mode="slow"``, the keyword arguments given to
``from_pretrained``); those that choose a download (``revision``, ``download_dir``) change
nothing; a custom ``tokenizer_cls`` is loaded with its own ``from_pretrained``.
"""
from __future__ import annotations

import os
from pathlib import Path

from vllm_api.checkpoint_files import check_tokenizer_dir

TOKENIZER_MODES = ("auto", "hf", "slow")


def get_tokenizer(tokenizer_name: str | os.PathLike, *args, tokenizer_cls=None,
                  trust_remote_code: bool = False, revision: str | None = None,
                  download_dir: str | None = None, tokenizer_mode: str = "auto", **kwargs):
    """The tokenizer in directory ``tokenizer_name`` (vLLM's signature)."""
    check_tokenizer_dir(tokenizer_name)
    if tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode={tokenizer_mode!r} is not supported here (accepted: "
                         f"{', '.join(TOKENIZER_MODES)}): tokenizers load with transformers")
    if tokenizer_mode == "slow":
        if kwargs.get("use_fast", False):
            raise ValueError("Cannot use the fast tokenizer in slow tokenizer mode.")
        kwargs["use_fast"] = False
    kwargs.setdefault("truncation_side", "left")  # vLLM's for generative models
    if tokenizer_cls is not None:
        return tokenizer_cls.from_pretrained(tokenizer_name, *args,
                                             trust_remote_code=trust_remote_code, **kwargs)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(Path(tokenizer_name), *args,
                                         trust_remote_code=bool(trust_remote_code), **kwargs)


cached_get_tokenizer = get_tokenizer  # vLLM's lru-cached twin; a fresh load is the same here
