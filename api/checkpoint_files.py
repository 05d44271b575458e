"""What the engine reads from a checkpoint directory besides the weights (model.py loads those):
the tokenizer, generation_config.json (sampling defaults, EOS ids) and the chat template."""
from __future__ import annotations

import json
from pathlib import Path

from api.intake import TokensPrompt


def load_tokenizer(path: Path):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def generation_config(model_path: Path, source: str, overrides: dict) -> dict:
    """generation_config.json as vLLM reads it: the model's ("auto"), none ("vllm"), or the one
    in another directory (``source``); then ``overrides`` on top."""
    folder = None if source == "vllm" else model_path if source == "auto" else Path(source)
    found = {}
    if folder is not None:
        path = folder / "generation_config.json"
        if source not in ("auto", "vllm") and not path.is_file():
            raise FileNotFoundError(f"generation_config={source!r}: no generation_config.json there")
        if path.is_file():
            found = json.loads(path.read_text())
    return {**found, **overrides}


def eos_token_ids(path: Path, model_config) -> tuple[int, ...]:
    """EOS ids from generation_config.json when it exists (even without an eos_token_id:
    then none, as HF ``generate`` and vLLM do), else from config.json."""
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return model_config.eos_token_ids


def read_template(template: str | None) -> str | None:
    """A chat template given as text, or as the path of a file holding it."""
    if template is not None and "{" not in template and Path(template).is_file():
        return Path(template).read_text()
    return template


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
