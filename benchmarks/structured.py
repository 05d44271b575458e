"""What a structured-output constraint costs per decode step: the median step with and
without one, on the same prompts and the same number of generated tokens.

    python -m benchmarks.structured [--model DIR] [--threads 1] [--batch 1 8] [--tokens 64]

Rows: batch size, constraint (none, a regex that never completes, a JSON schema), the median
decode step in milliseconds and its ratio to the unconstrained one. The constrained requests
never stop early (the regex has no end; the schema run is cut at ``--tokens`` with EOS
ignored after the grammar ends), so every row times the same steps. Only public calls
(``LLMEngine.add_request`` and ``step``).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

DEMO = Path(__file__).resolve().parent.parent / "demo_model"
SCHEMA = {"type": "object", "required": ["name", "items"],
          "properties": {"name": {"type": "string"},
                         "items": {"type": "array", "items": {"type": "integer"}}}}
CONSTRAINTS = {"none": None, "regex": dict(regex="[a-z_ ]+"), "json": dict(json=SCHEMA)}


def step_times(engine, batch: int, tokens: int, constraint) -> list[float]:
    """Seconds of each decode step (the prefill step left out) of ``batch`` requests."""
    from engine import SamplingParams, StructuredOutputsParams
    structured = None if constraint is None else StructuredOutputsParams(**constraint)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                            structured_outputs=structured)
    for i in range(batch):
        engine.add_request(None, f"def function_{i}(argument):\n    return", params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[1:]


def run(model: str, batches: list[int], tokens: int) -> list[tuple]:
    from engine import LLM
    engine = LLM(model, dtype="float32", num_kv_blocks=512, seed=0).llm_engine
    rows = []
    for batch in batches:
        step_times(engine, batch, 4, None)  # warm-up: kernels, first compilation
        base = None
        for name, constraint in CONSTRAINTS.items():
            step_times(engine, 1, 2, constraint)  # the grammar compiled before timing
            median = statistics.median(step_times(engine, batch, tokens, constraint)) * 1e3
            base = base or median
            rows.append((batch, name, median, median / base))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEMO))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{'batch':>5}  {'constraint':<10} {'median step ms':>14} {'ratio':>6}")
    for batch, name, median, ratio in run(args.model, args.batch, args.tokens):
        print(f"{batch:>5}  {name:<10} {median:>14.3f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
