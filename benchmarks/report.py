"""The report: one table (ours ÷ each peer, per workload and thread configuration), token
agreement request by request, the hashing table, the profile lines and the targets' verdicts."""
from __future__ import annotations

from dataclasses import dataclass, field

from .ours import SYSTEM as OURS
from .peer_hf_generate import SYSTEM as HF_GENERATE
from .peer_hf_generate_batch import SYSTEM as HF_GENERATE_BATCH
from .result import RunResult

HF_SYSTEMS = (HF_GENERATE, HF_GENERATE_BATCH)


@dataclass
class Findings:
    """Everything measured in one bench run, as the report and the targets read it."""

    runs: list[RunResult]
    hashing: list[dict] = field(default_factory=list)
    prefill: dict | None = None
    decode: dict | None = None

    def ours(self, workload: str, threads: str) -> RunResult | None:
        """The quiet run of ours the row is compared with: same workload, same threads."""
        same = [r for r in self.runs if r.system == OURS and r.workload == workload]
        return next((r for r in same if r.threads == threads), same[0] if same else None)

    def find(self, workload_prefix: str, threads: str, system: str) -> RunResult | None:
        return next((r for r in self.runs if r.workload.startswith(workload_prefix)
                     and r.threads == threads and r.system == system), None)

    def ratio(self, r: RunResult) -> float | None:
        """ours out tok/s ÷ this row's; for the busy-neighbour row: quiet ÷ busy (the slowdown)."""
        ours = self.ours(r.workload, r.threads)
        return ours.out_tps / r.out_tps if ours else None


# ----------------------------------------------------------------------------- token agreement

@dataclass
class Agreement:
    """How one peer row's tokens compare with ours, request by request."""

    row: RunResult
    identical: int
    total: int
    first_mismatch: str | None  # "request i, output token j: ours x, this y"


def compare_tokens(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, str | None]:
    identical, first = 0, None
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            identical += 1
        elif first is None:
            j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first = (f"request {i}, output token {j}: ours {a[j] if j < len(a) else 'none'}, "
                     f"this {b[j] if j < len(b) else 'none'}")
    return identical, first


def agreements(f: Findings) -> list[Agreement]:
    """Every row but the quiet runs of ours, against ours on the same workload and threads."""
    out = []
    for r in f.runs:
        ours = f.ours(r.workload, r.threads)
        if r.system != OURS and ours is not None:
            identical, first = compare_tokens(ours.outputs, r.outputs)
            out.append(Agreement(r, identical, len(r.outputs), first))
    return out


# ----------------------------------------------------------------------------- printing

def fmt(x, spec: str = ".1f", unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def results_table(f: Findings) -> str:
    same = {id(a.row): f"{a.identical}/{a.total}" for a in agreements(f)}
    lines = ["| workload | threads | system | compute threads | out tok/s | prompt tok/s | "
             "mean TTFT | p90 TTFT | tokens = ours | ours ÷ this |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in f.runs:
        lines.append(f"| {r.workload} | {r.threads} | {r.system} | {fmt(r.compute_threads, 'd')} | "
                     f"{r.out_tps:.1f} | {fmt(r.prompt_tps)} | {fmt(r.ttft_mean(), '.2f', ' s')} | "
                     f"{fmt(r.ttft_p90(), '.2f', ' s')} | {same.get(id(r), '-')} | "
                     f"{'-' if r.system == OURS else fmt(f.ratio(r), '.2f', 'x')} |")
    return "\n".join(lines)


TABLE_NOTE = ("out tok/s = generated tokens / generate() wall time; prompt tok/s = prompt tokens / "
              "time until every request had its first token; TTFT from request arrival (padded "
              "generate: the batch's first forward); compute threads = torch intra-op threads "
              "(vLLM: cores its OpenMP threads are bound to); ours ÷ this = ours' out tok/s ÷ this "
              "row's, same workload and threads (the busy-neighbour row: quiet ÷ busy, its slowdown).")


def hash_table(rows: list[dict]) -> str:
    lines = ["| (c) hashing, block 16 | cold µs | cold hashes | re-lookup µs | re-lookup hashes | "
             "empty-cache µs | empty-cache hashes |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['cold_us']:.1f} | {r['cold_hashes']} | "
                     f"{r['relookup_us']:.1f} | {r['relookup_hashes']} | {r['empty_cache_us']:.1f} | "
                     f"{r['empty_cache_hashes']} |")
    return "\n".join(lines)


HASH_NOTE = ("cold = first lookup of a fresh request whose whole prefix is cached; re-lookup = the "
             "same request looked up again; empty-cache = first lookup with nothing cached.")


def profile_lines(f: Findings, facts: dict) -> list[str]:
    p, d = f.prefill, f.decode
    return [
        f"prefill MFU: {p['dense_flop_s'] / 1e9:.1f} GFLOP/s = 2 * {facts['params_without_embedding']:,} "
        f"params * {p['prompt_tokens_computed']} prompt tokens / {p['prefill_s']:.2f} s; matmul peak "
        f"{p['matmul_peak_flop_s'] / 1e9:.1f} GFLOP/s -> {p['mfu']:.0%} (with causal attention "
        f"FLOPs: {p['mfu_with_attention']:.0%})",
        f"decode at batch {d['batch']}: step {d['step_ms']:.1f} ms, matmuls {d['matmul_ms_per_step']:.1f} "
        f"ms -> non-matmul share {d['non_matmul_share']:.0%} (profiled wall: "
        f"{d['non_matmul_share_profiled_wall']:.0%}); top self-time ops (ms per step): "
        + ", ".join(f"{k} {v:.1f}" for k, v in list(d["top_ops_ms_per_step"].items())[:5]),
    ]


def print_report(f: Findings, facts: dict, verdicts: list[dict], log) -> None:
    log("\n## Results\n")
    log(results_table(f))
    log("\n" + TABLE_NOTE)
    for a in agreements(f):
        if a.first_mismatch:
            log(f"  tokens: {a.row.workload} / {a.row.threads} / {a.row.system}: "
                f"{a.identical}/{a.total} identical; first mismatch at {a.first_mismatch}")
    if f.hashing:
        log("\n" + hash_table(f.hashing) + "\n" + HASH_NOTE)
    if f.prefill and f.decode:
        log("")
        for line in profile_lines(f, facts):
            log(line)
    log("\nTargets:")
    for v in verdicts:
        log(f"  {v['verdict']:<7}  {v['target']}" + (f": {v['value']}" if v["value"] else ""))

