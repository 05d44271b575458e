"""What the exercises share: the demo model and its prompt, a random prompt, and a way to send
requests and keep their ``Sequence`` objects."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine import LLM, SamplingParams, Sequence

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / "demo_model"
GREEDY = dict(temperature=0.0, ignore_eos=True)


def demo_prompt(index: int = 0) -> list[int]:
    """A prompt of the demo model as token ids (prompt 0 has 527 tokens)."""
    prompts = json.loads((DEMO_MODEL / "prompts.json").read_text())["prompts"]
    return prompts[index]["prompt_ids"]


def random_prompt(length: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


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
