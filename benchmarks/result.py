"""One system's timed run of one workload, whichever system produced it."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

import numpy as np

from .workloads import Workload


@dataclass
class RunResult:
    workload: str
    system: str
    threads: str                   # the thread configuration's label ("default", "1", ...)
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    ttfts: list[float] | None      # per request, seconds from arrival; None when not measurable
    all_first_s: float | None      # from start until every request had its first token
    outputs: list[list[int]]       # every request's output token ids, in prompt order
    settings: str
    compute_threads: int | None = None  # the intra-op threads it really ran with, when known
    extra: dict = field(default_factory=dict)
    load: dict | None = None       # the machine's load meanwhile (machine_load.measure_load)

    @property
    def out_tps(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def prompt_tps(self) -> float | None:
        return self.prompt_tokens / self.all_first_s if self.all_first_s else None

    def ttft_mean(self) -> float | None:
        return statistics.fmean(self.ttfts) if self.ttfts else None

    def ttft_p90(self) -> float | None:
        return float(np.percentile(self.ttfts, 90)) if self.ttfts else None

    def summary(self) -> dict:
        """Everything but the per-request lists, plus the derived rates (for --json)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("outputs", "ttfts")}
        d.update(out_tok_s=self.out_tps, prompt_tok_s=self.prompt_tps,
                 ttft_mean_s=self.ttft_mean(), ttft_p90_s=self.ttft_p90())
        return d


def check_lengths(system: str, outputs: list[list[int]], w: Workload) -> None:
    """Every system must produce exactly max_new_tokens per request, or the rates mean nothing."""
    if len(outputs) != len(w.prompts):
        raise RuntimeError(f"{system} on {w.name}: {len(outputs)} outputs for {len(w.prompts)} prompts")
    bad = [i for i, o in enumerate(outputs) if len(o) != w.max_new_tokens]
    if bad:
        raise RuntimeError(f"{system} on {w.name}: {len(bad)} request(s) did not produce "
                           f"{w.max_new_tokens} tokens (e.g. #{bad[0]}: {len(outputs[bad[0]])})")
