"""The project's targets, defined once: each names what it measures and its bar."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .ours import BUSY_SYSTEM as BUSY
from .peer_vllm import SYSTEM as VLLM
from .report import HF_SYSTEMS, Findings, agreements
from .threads import DEFAULT


@dataclass(frozen=True)
class Target:
    goal: str
    measure: Callable[[Findings], float | None]
    at_least: float | None = None
    at_most: float | None = None
    unit: str = "x"

    def check(self, f: Findings) -> dict:
        value = self.measure(f)
        if value is None:
            return dict(target=self.goal, value=None, verdict="not run")
        ok = (self.at_least is None or value >= self.at_least) and \
             (self.at_most is None or value <= self.at_most)
        shown = f"{value:.0%}" if self.unit == "%" else f"{value:.2f}x"
        return dict(target=self.goal, value=shown, verdict="PASS" if ok else "MISS")


def ratio_vs(workload: str, threads: str, system: str):
    def measure(f: Findings) -> float | None:
        row = f.find(workload, threads, system)
        return f.ratio(row) if row else None
    return measure


def busy_slowdown(workload: str):
    """Quiet ÷ busy for ours, under whichever configuration the busy neighbour ran."""
    def measure(f: Findings) -> float | None:
        row = next((r for r in f.runs if r.system == BUSY and r.workload.startswith(workload)), None)
        return f.ratio(row) if row else None
    return measure


def ratio_vs_faster_hf(workload: str, threads: str):
    def measure(f: Findings) -> float | None:
        ratios = [ratio_vs(workload, threads, s)(f) for s in HF_SYSTEMS]
        return min((r for r in ratios if r is not None), default=None)
    return measure


def profile_value(part: str, key: str):
    return lambda f: getattr(f, part)[key] if getattr(f, part) else None


def tokens_identical(f: Findings) -> float | None:
    """The lowest share of requests any peer decoded exactly like ours."""
    shares = [a.identical / a.total for a in agreements(f)]
    return min(shares, default=None)


TARGETS = (
    Target("(a) whole machine, each at its default: >= 1.2x vLLM", ratio_vs("(a)", DEFAULT, VLLM), 1.2),
    Target("(b) whole machine, each at its default: >= 1.5x vLLM", ratio_vs("(b)", DEFAULT, VLLM), 1.5),
    Target("(a) one compute thread each: >= 1.0x vLLM", ratio_vs("(a)", "1", VLLM), 1.0),
    Target("(b) one compute thread each: >= 1.0x vLLM", ratio_vs("(b)", "1", VLLM), 1.0),
    Target("(a) a busy neighbour slows ours <= 1.5x", busy_slowdown("(a)"), at_most=1.5),
    Target("(b) a busy neighbour slows ours <= 1.5x", busy_slowdown("(b)"), at_most=1.5),
    Target("(a) >= 1.5x the faster HF mode", ratio_vs_faster_hf("(a)", DEFAULT), 1.5),
    Target("(b) >= 5x the faster HF mode", ratio_vs_faster_hf("(b)", DEFAULT), 5.0),
    Target("every peer's tokens identical to ours, request by request", tokens_identical, 1.0,
           unit="%"),
    Target("prefill >= 50 % of matmul peak", profile_value("prefill", "mfu"), 0.5, unit="%"),
    Target("decode non-matmul share <= 20 % at batch 32",
           profile_value("decode", "non_matmul_share"), at_most=0.2, unit="%"),
)


def decode_over_bound(batch: int):
    def measure(f: Findings) -> float | None:
        row = next((d for d in f.decode_bounds if d["batch"] == batch), None)
        return row["over_weight_bound"] if row else None
    return measure


# Issue 20's goals at the size CPU users run: Qwen3-0.6B's shape in bfloat16.
USER_SIZE = ("0.6b", "bfloat16")
USER_SIZE_TARGETS = (
    Target("0.6B bf16 (a) whole machine, each at its default: >= 1.5x vLLM",
           ratio_vs("(a)", DEFAULT, VLLM), 1.5),
    Target("0.6B bf16 (b) whole machine, each at its default: >= 1.5x vLLM",
           ratio_vs("(b)", DEFAULT, VLLM), 1.5),
    Target("0.6B bf16 prefill >= 80 % of the measured bf16 matmul peak",
           profile_value("prefill", "mfu"), 0.8, unit="%"),
    Target("0.6B bf16 decode step at batch 1 within 1.5x of the weight-streaming bound",
           decode_over_bound(1), at_most=1.5),
)


def targets_for(model_size: str, dtype: str) -> tuple[Target, ...]:
    """Every section is judged on TARGETS; the user size adds issue 20's own."""
    return TARGETS + (USER_SIZE_TARGETS if (model_size, dtype) == USER_SIZE else ())


def check_targets(f: Findings, targets: tuple[Target, ...] = TARGETS) -> list[dict]:
    return [t.check(f) for t in targets]
