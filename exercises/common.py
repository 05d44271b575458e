"""What the exercises share: the demo model and its prompt, a tiny long-context checkpoint,
and a helper that sends requests and hands back their ``Sequence`` objects."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine import LLM, SamplingParams, Sequence

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / "demo_model"
GREEDY = dict(temperature=0.0, ignore_eos=True)


def demo_prompt(index: int = 0) -> list[int]:
    """A prompt of the demo model (prompt 0: 527 tokens, 502 of them shared by all 14)."""
    prompts = json.loads((DEMO_MODEL / "prompts.json").read_text())["prompts"]
    return prompts[index]["prompt_ids"]


def tiny_long_checkpoint(path: str, max_len: int = 4096 + 64) -> str:
    """A random one-layer Llama whose context fits a 4096-token prompt, written to ``path``
    (nothing is downloaded). Its tokens are meaningless; its hashes are the point."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=max_len)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def send(llm: LLM, prompts: list[list[int]], max_tokens: int = 1) -> list[Sequence]:
    """Run ``prompts`` together to completion; their ``Sequence`` objects (chain included)."""
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    seqs = []
    for prompt in prompts:
        llm.add_request(prompt, params)
        seqs.append(llm.scheduler.waiting[-1])
    while llm.has_unfinished_requests():
        llm.step()
    return seqs


def random_prompt(length: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()
