"""What the engine's own bookkeeping costs, apart from the model: the figures of "nothing lost".

    python -m benchmarks.bookkeeping [--model DIR] [--threads 1] [--repeats 5]

Rows (milliseconds, median of ``--repeats``; the demo model, one compute thread):

* one ``add_request`` among 128 and among 512 live requests of 1,000-token prompts;
* an operation that changes nothing (an abort of an unknown id) among 256 live requests;
* a decode step of 16 and of 256 sequences (1,000-token prompts): its time outside the model's
  forward, per step and per sequence.

Only public calls (``LLM``, ``LLMEngine.add_request``, ``abort_request``, ``step``) and the
backend's ``forward``, so the same file measures an older tree of this project as well.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

PROMPT = 1000
DEMO = Path(__file__).resolve().parent.parent / "demo_model"


def engine(model: str, live: int):
    from engine import LLM
    blocks = (live * (PROMPT + 64)) // 16 + 64
    return LLM(model, dtype="float32", num_kv_blocks=blocks, max_num_seqs=max(live, 1),
               max_model_len=PROMPT + 24, max_num_batched_tokens=8192, seed=0).llm_engine


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    return np.random.default_rng(seed).integers(3, vocab - 1, size=(n, PROMPT)).tolist()


def params(max_tokens: int = 16):
    from engine import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def add_cost(model: str, live: int, repeats: int) -> float:
    """ms of one add_request with ``live`` requests queued."""
    eng = engine(model, live)
    batch = prompts(live + repeats, eng.model_config.get_vocab_size())
    for i in range(live):
        eng.add_request(f"live{i}", {"prompt_token_ids": batch[i]}, params())
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        eng.add_request(f"new{i}", {"prompt_token_ids": batch[live + i]}, params())
        times.append(time.perf_counter() - start)
        eng.abort_request([f"new{i}"])
    return 1e3 * statistics.median(times)


def idle_cost(model: str, live: int, repeats: int) -> float:
    """ms of an operation that changes nothing, with ``live`` requests queued."""
    eng = engine(model, live)
    for i, ids in enumerate(prompts(live, eng.model_config.get_vocab_size())):
        eng.add_request(f"live{i}", {"prompt_token_ids": ids}, params())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        eng.abort_request(["no-such-request"])
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def decode_overhead(model: str, seqs: int, repeats: int) -> tuple[float, float]:
    """ms of a decode step of ``seqs`` sequences outside the forward: per step, per sequence."""
    eng = engine(model, seqs)
    for i, ids in enumerate(prompts(seqs, eng.model_config.get_vocab_size())):
        eng.add_request(f"s{i}", {"prompt_token_ids": ids}, params(min(repeats + 4, 24)))
    backend = eng.engine_core.model_runner.backend
    forward, spent = backend.forward, []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    backend.forward = timed
    while eng.engine_core.scheduler.waiting or any(
            s.num_uncomputed_tokens > 1 for s in eng.engine_core.scheduler.running):
        eng.step()  # every prompt prefilled: the steps below decode only
    eng.step()
    outside = []
    for _ in range(repeats):
        spent.clear()
        start = time.perf_counter()
        eng.step()
        outside.append(time.perf_counter() - start - sum(spent))
    per_step = 1e3 * statistics.median(outside)
    return per_step, per_step / seqs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bookkeeping", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEMO))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [("add_request among 128 live", add_cost(args.model, 128, args.repeats)),
            ("add_request among 512 live", add_cost(args.model, 512, args.repeats)),
            ("an idle operation among 256 live", idle_cost(args.model, 256, args.repeats))]
    for seqs in (16, 256):
        step, per_seq = decode_overhead(args.model, seqs, args.repeats)
        rows.append((f"decode step of {seqs}, outside the forward", step))
        rows.append((f"decode step of {seqs}, outside the forward, per sequence", per_seq))
    print(f"| row ({args.threads} thread(s), 1,000-token prompts) | ms |\n|---|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
