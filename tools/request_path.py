"""How far one request travels through the project's files: the architecture's own measure.

    python -m tools.request_path

A tiny random Llama (built in a temporary folder), the plain path; one 12-token prompt
generated once, then a follow-up of 3 more tokens is traced (``sys.setprofile``): the project
files it enters, the calls from one project file into another, and the JSON files opened.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tiny_llama(out_dir: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=256)).save_pretrained(out_dir)
    return out_dir


def trace_follow_up() -> tuple[list[str], int, list[str]]:
    """(project files entered, file-to-file calls, JSON files opened) of the follow-up request."""
    from engine import LLM, SamplingParams
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(tiny_llama(tmp), dtype="float32", fast_paths=False, num_kv_blocks=64, block_size=4,
                  skip_tokenizer_init=True)
        prompt, params = list(range(5, 17)), SamplingParams(temperature=0, max_tokens=3)
        llm.generate([prompt], params, use_tqdm=False)
        files, calls, opened = set(), [0], []
        own = str(ROOT) + "/"

        def ours(path: str) -> bool:  # a venv inside the checkout is not the project
            return path.startswith(own) and "site-packages" not in path

        def profile(frame, event, arg):
            if event != "call":
                return
            here = frame.f_code.co_filename
            caller = frame.f_back.f_code.co_filename if frame.f_back else ""
            if ours(here):
                files.add(here[len(own):])
                calls[0] += caller != here and ours(caller)

        sys.addaudithook(lambda event, args: opened.append(args[0]) if event == "open" and isinstance(
            args[0], str) and args[0].endswith(".json") and profiling else None)
        profiling = True
        sys.setprofile(profile)
        try:
            llm.generate([prompt + [20, 21, 22]], params, use_tqdm=False)
        finally:
            sys.setprofile(None)
            profiling = False
    return sorted(files), calls[0], opened


def main() -> int:
    files, calls, opened = trace_follow_up()
    print(f"a follow-up 3-token request (plain path) enters {len(files)} project files, with "
          f"{calls} calls from one project file into another; JSON files opened: {len(opened)}")
    for name in files:
        print(f"  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
