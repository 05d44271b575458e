"""What the engine reads from a checkpoint directory besides the weights (model.py loads those):
the tokenizer, generation_config.json (sampling defaults, EOS ids) and the chat template.

Optional inputs fail loudly when they are *named*: a checkpoint without a tokenizer runs on
token ids, but ``tokenizer=<dir>`` that holds none, a ``generation_config=<dir>`` that does
not exist, a chat template path that cannot be opened, or a side file that is not valid
JSON raises, naming the path.
"""
from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

from core.gguf import is_gguf, open_reader
from model import hf_from_pretrained
from vllm_api.intake import TokensPrompt

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
TEMPLATE_MARKERS = ("{", "}", "\n")  # what a template that uses the conversation contains


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The checkpoint's tokenizer, or None when the directory holds no tokenizer files. Its
    own code (an ``auto_map`` in tokenizer_config.json) runs only with ``trust_remote_code``.
    A GGUF file: the tokenizer it carries (``gguf_tokenizer``)."""
    if is_gguf(path):
        return gguf_tokenizer(path)
    if not any((path / n).is_file() for n in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return hf_from_pretrained(AutoTokenizer, path, trust_remote_code, "the tokenizer")


def gguf_tokenizer(path: Path):
    """The tokenizer a GGUF file carries, as transformers builds it (``gguf_file=``), from the
    file alone: transformers is shown a fresh folder holding only a link to the file, so no
    file beside it is read. None when the file carries none (no ``tokenizer.ggml.model``), as
    for a checkpoint folder without tokenizer files; None with a warning saying why when
    transformers cannot build it (then prompts are token ids, or pass ``tokenizer=`` a folder)."""
    from transformers import AutoTokenizer

    if "tokenizer.ggml.model" not in open_reader(path).fields:
        return None
    with tempfile.TemporaryDirectory() as folder:
        link = Path(folder) / "model.gguf"
        link.symlink_to(Path(path).resolve())
        try:
            return AutoTokenizer.from_pretrained(folder, gguf_file=link.name)
        except Exception as err:  # transformers' converters raise many kinds: each means "none"
            warnings.warn(f"GGUF file {path}: transformers cannot build its tokenizer "
                          f"({type(err).__name__}: {err}); running without one: prompts must be "
                          f"token ids, or pass tokenizer=<a tokenizer folder>", stacklevel=3)
            return None


def check_tokenizer_dir(tokenizer: str | os.PathLike) -> None:
    """``tokenizer=`` must name a local directory with tokenizer files (no download here), or
    a GGUF file (the tokenizer it carries)."""
    path = Path(tokenizer)
    if is_gguf(path):
        return
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer={str(tokenizer)!r}: no such directory (this engine "
                                f"loads tokenizers from local directories only)")
    if not any((path / n).is_file() for n in TOKENIZER_FILES):
        raise FileNotFoundError(f"tokenizer={str(tokenizer)!r}: the directory holds no "
                                f"tokenizer files ({', '.join(TOKENIZER_FILES)})")


def check_generation_config_dir(source: str | os.PathLike) -> None:
    """``generation_config=<dir>`` must hold a readable generation_config.json."""
    _read_json(Path(source) / "generation_config.json", f"generation_config={str(source)!r}")


def _read_json(path: Path, what: str) -> dict:
    """A JSON side file, or an error that names it."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc}") from None


def generation_config(model_path: Path, source: str, overrides: dict) -> dict:
    """generation_config.json as vLLM reads it: the model's ("auto"), none ("vllm"), or the one
    in another directory (``source``); then ``overrides`` on top."""
    folder = None if source == "vllm" else model_path if source == "auto" else Path(source)
    found = {}
    if folder is not None:
        path = folder / "generation_config.json"
        if source != "auto" or path.is_file():
            found = _read_json(path, f"generation_config={str(source)!r}")
    return {**found, **overrides}


def eos_token_ids(path: Path, model_config) -> tuple[int, ...]:
    """EOS ids from generation_config.json when it exists (even without an eos_token_id:
    then none, as HF ``generate`` and vLLM do), else from config.json."""
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = _read_json(gen, "the checkpoint's generation config").get("eos_token_id")
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return model_config.eos_token_ids


def read_template(template: str | os.PathLike | None) -> str | None:
    """A chat template given as Jinja text, or as the path of a file holding it.

    Path or text is decided by content, not by whether a file happens to exist: a string
    without braces or a newline cannot be a template that uses the conversation, so it is a
    path, and one that cannot be opened raises (as vLLM's "looks like a file path, but it
    failed to be opened"). A ``Path`` is always a path."""
    if template is None:
        return None
    if isinstance(template, str) and any(m in template for m in TEMPLATE_MARKERS):
        return template
    try:
        return Path(template).read_text()
    except OSError as exc:
        raise ValueError(f"chat_template={str(template)!r} looks like a file path, but it failed "
                         f"to be opened: {exc.strerror or exc} (a template given as text must "
                         f"contain Jinja markers such as '{{{{ ... }}}}')") from None


def render_chat(tokenizer, conversation, template: str | None, add_generation_prompt: bool,
                continue_final_message: bool, tools, extra: dict) -> TokensPrompt:
    """One conversation as a prompt, through the chat template (``template`` or the tokenizer's)."""
    if tokenizer is None:
        raise ValueError("chat() needs a tokenizer with a chat template, but the checkpoint "
                         "has no tokenizer")
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat() needs a chat template: the tokenizer has none; pass "
                         "chat_template=... (to chat() or to LLM)")
    text = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, tools=tools, chat_template=template,
        **extra)
    # The template writes the special tokens itself (BOS included), as in vLLM.
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return TokensPrompt(prompt_token_ids=ids, prompt=text)
