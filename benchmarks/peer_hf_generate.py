"""Peer: Hugging Face ``model.generate``, padded (left padding, one batch by default)."""
from __future__ import annotations

import time

import torch

from .result import RunResult, check_lengths
from .workloads import HF_ATTENTION, Workload, load_hf, torch_dtype, warmup_workload

SYSTEM = "HF generate (padded)"


def greedy_config(max_new: int):
    """Greedy, never stopping early (eos None, min_new_tokens): like ignore_eos on our side."""
    from transformers import GenerationConfig
    return GenerationConfig(do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                            eos_token_id=None, pad_token_id=0, num_beams=1)


class FirstForwardClock:
    """A logits processor that only notes when it is first called: the end of the prefill."""

    def __init__(self) -> None:
        self.t: float | None = None

    def __call__(self, input_ids, scores):
        if self.t is None:
            if scores.is_cuda:
                torch.cuda.synchronize(scores.device)  # the forward must really be done
            self.t = time.perf_counter()
        return scores


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def generate_padded(model, prompts, max_new: int, batch_size: int, start: float):
    """Batched padded generate; returns outputs and each request's first-token time."""
    from transformers import LogitsProcessorList
    outputs, first = [], []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        ids, mask = left_pad(chunk, model.device)
        clock = FirstForwardClock()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask,
                                 generation_config=greedy_config(max_new),
                                 logits_processor=LogitsProcessorList([clock]))
        outputs += out[:, ids.shape[1]:].tolist()
        first += [clock.t - start] * len(chunk)
    return outputs, first


def run_hf_generate(model_dir: str, w: Workload, dtype: str, device: torch.device, threads: str,
                    batch_size: int | None = None) -> RunResult:
    batch_size = batch_size or len(w.prompts)
    model = load_hf(model_dir, torch_dtype(dtype), device)
    start = time.perf_counter()
    outputs, first = generate_padded(model, w.prompts, w.max_new_tokens, batch_size, start)
    wall = time.perf_counter() - start
    check_lengths(SYSTEM, outputs, w)
    settings = (f"model.generate, left padding, batch_size={batch_size}, greedy, "
                f"eos_token_id=None, min_new_tokens=max_new_tokens={w.max_new_tokens}, "
                f"attn_implementation={HF_ATTENTION}, default (dynamic) cache")
    # Padded generate has no per-request arrival: TTFT is the batch's first forward.
    return RunResult(w.name, SYSTEM, threads, wall, w.prompt_tokens, w.output_tokens,
                     ttfts=first, all_first_s=max(first), outputs=outputs, settings=settings,
                     compute_threads=torch.get_num_threads(),
                     extra=dict(padded_prompt_tokens=padded_tokens(w.prompts, batch_size)))


def padded_tokens(prompts, batch_size: int) -> int:
    return sum(len(prompts[i:i + batch_size]) * max(len(p) for p in prompts[i:i + batch_size])
               for i in range(0, len(prompts), batch_size))


def warmup_hf_generate(model_dir: str, vocab: int, dtype: str, device: torch.device) -> None:
    w = warmup_workload(vocab)
    model = load_hf(model_dir, torch_dtype(dtype), device)
    generate_padded(model, w.prompts, w.max_new_tokens, len(w.prompts), time.perf_counter())
