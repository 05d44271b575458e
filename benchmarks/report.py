"""The report: per model size and dtype (a section), one table (ours ÷ each peer, per workload
and thread configuration), token agreement request by request, the hashing table, the profile
by phase and the targets' verdicts; then one summary table over every section. The same lines
are printed and, with ``--markdown``, written to a file."""
from __future__ import annotations

from dataclasses import dataclass, field

from .machine_load import describe as describe_load
from .ours import PLAIN_SYSTEM
from .ours import SYSTEM as OURS
from .peer_hf_generate import SYSTEM as HF_GENERATE
from .peer_hf_generate_batch import SYSTEM as HF_GENERATE_BATCH
from .peer_vllm import SYSTEM as VLLM
from .result import RunResult

HF_SYSTEMS = (HF_GENERATE, HF_GENERATE_BATCH)


@dataclass
class Findings:
    """Everything measured in one bench run, as the report and the targets read it."""

    runs: list[RunResult]
    hashing: list[dict] = field(default_factory=list)
    prefill: dict | None = None
    decode: dict | None = None
    peaks: dict | None = None          # matmul peaks of the section's dtype
    bandwidth: dict | None = None      # measured memory bandwidth
    decode_bounds: list[dict] = field(default_factory=list)  # a step vs the streaming bound
    profile_load: dict | None = None   # the machine's load over the profile

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
             "mean TTFT | p90 TTFT | tokens = ours | ours ÷ this | others' cores |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in f.runs:
        lines.append(f"| {r.workload} | {r.threads} | {r.system} | {fmt(r.compute_threads, 'd')} | "
                     f"{r.out_tps:.1f} | {fmt(r.prompt_tps)} | {fmt(r.ttft_mean(), '.2f', ' s')} | "
                     f"{fmt(r.ttft_p90(), '.2f', ' s')} | {same.get(id(r), '-')} | "
                     f"{'-' if r.system == OURS else fmt(f.ratio(r), '.2f', 'x')} | "
                     f"{describe_load(r.load)} |")
    return "\n".join(lines)


TABLE_NOTE = ("out tok/s = generated tokens / generate() wall time; prompt tok/s = prompt tokens / "
              "time until every request had its first token; TTFT from request arrival (padded "
              "generate: the batch's first forward); compute threads = torch intra-op threads "
              "(vLLM: cores its OpenMP threads are bound to); ours ÷ this = ours' out tok/s ÷ this "
              "row's, same workload and threads (the busy-neighbour row: quiet ÷ busy, its slowdown; the "
              "plain row: what the fast paths buy); others' cores = CPU time other processes used "
              "during the run (model loading included) ÷ its wall time, of the machine's cores (vLLM rows: "
              "over its whole process, start-up included, and the CPU of the engine-core process it "
              "spawns and does not reap counts as others', so there it reads high).")


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


def gflops(x: float) -> str:
    return f"{x / 1e9:.1f} GFLOP/s"


def ops(top: dict, n: int = 6) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in list(top.items())[:n])


def prefill_lines(f: Findings, facts: dict) -> list[str]:
    p, k = f.prefill, f.peaks
    return [
        f"- matmul peak ({k['square_n']}^3: {gflops(k['square_flop_s'])}; model-shaped "
        f"{k['model_shape']}: {gflops(k['model_shaped_flop_s'])}) -> roof {gflops(k['peak_flop_s'])}",
        f"- prefill: {gflops(p['dense_flop_s'])} = 2 * {facts['params_without_embedding']:,} params * "
        f"{p['prompt_tokens_computed']} prompt tokens / {p['prefill_s']:.2f} s -> **{p['mfu']:.0%} of "
        f"the roof** (with causal attention FLOPs: {p['mfu_with_attention']:.0%})",
        f"- prefill top ops, self ms over {p['profiled_prompts']} prompts ({p['profiled_tokens']} "
        f"tokens, profiled): {ops(p['top_ops_ms'])}",
    ]


def decode_lines(f: Findings) -> list[str]:
    b, d = f.bandwidth, f.decode
    lines = [f"- memory bandwidth ({b['tensor_mib']} MiB tensor): read (sum) "
             f"{b['read_bytes_s'] / 1e9:.1f} GB/s, copy (read + write) {b['copy_bytes_s'] / 1e9:.1f} "
             f"GB/s -> {b['bytes_s'] / 1e9:.1f} GB/s used"]
    for x in f.decode_bounds:
        lines.append(
            f"- decode step at batch {x['batch']}: {x['step_ms']:.1f} ms; weights "
            f"{x['weight_bytes'] / 1e9:.2f} GB / bandwidth = {x['weight_bound_ms']:.1f} ms -> "
            f"**{x['over_weight_bound']:.2f}x the weight-streaming bound** (with the KV read, "
            f"{x['kv_bytes'] / 1e6:.0f} MB: bound {x['weight_kv_bound_ms']:.1f} ms; compute floor "
            f"at the roof {x['compute_floor_ms']:.1f} ms)")
    if d:
        lines.append(f"- decode at batch {d['batch']}: step {d['step_ms']:.1f} ms, matmuls "
                     f"{d['matmul_ms_per_step']:.1f} ms -> non-matmul share {d['non_matmul_share']:.0%} "
                     f"(profiled wall: {d['non_matmul_share_profiled_wall']:.0%}); top self-time ops "
                     f"(ms per step): {ops(d['top_ops_ms_per_step'])}")
    return lines


def profile_lines(f: Findings, facts: dict) -> list[str]:
    return prefill_lines(f, facts) + decode_lines(f)


@dataclass
class Section:
    """One model size in one dtype: what was measured and the verdicts."""

    model_size: str
    dtype: str
    scale: str
    facts: dict
    findings: Findings
    verdicts: list[dict]
    load: dict | None = None  # the machine's load over the whole section

    @property
    def title(self) -> str:
        return f"{self.model_size}, {self.dtype}, {self.scale} scale"


def section_lines(sec: Section) -> list[str]:
    f, facts = sec.findings, sec.facts
    lines = [f"## {sec.title}", "",
             f"random Qwen3 {sec.model_size}: {facts['params']:,} params "
             f"({facts['params_without_embedding']:,} without embedding); others' cores over the "
             f"section: {describe_load(sec.load)}", "", results_table(f), "", TABLE_NOTE]
    for a in agreements(f):
        if a.first_mismatch:
            lines.append(f"- tokens: {a.row.workload} / {a.row.threads} / {a.row.system}: "
                         f"{a.identical}/{a.total} identical; first mismatch at {a.first_mismatch}")
    if f.hashing:
        lines += ["", hash_table(f.hashing), "", HASH_NOTE]
    if f.prefill and f.peaks:
        lines += ["", f"### Profile by phase ({sec.dtype}, torch default threads; others' cores "
                      f"meanwhile {describe_load(f.profile_load)})", ""]
        lines += profile_lines(f, facts)
    lines += ["", "Targets:", ""]
    lines += [f"- {v['verdict']}: {v['target']}" + (f" ({v['value']})" if v["value"] else "")
              for v in sec.verdicts]
    return lines


def report_lines(sections: list[Section]) -> list[str]:
    """The summary over every section, then each section (the markdown body)."""
    lines = ["", "## Summary: out tok/s, every size and dtype", ""] + summary_table(sections)
    for sec in sections:
        lines += [""] + section_lines(sec)
    return lines


def print_report(sections: list[Section], log) -> list[str]:
    """Prints the report; returns its lines."""
    lines = report_lines(sections)
    for line in lines:
        log(line)
    return lines


# ----------------------------------------------------------------------------- the summary

SUMMARY_SYSTEMS = (OURS, PLAIN_SYSTEM, HF_GENERATE_BATCH, HF_GENERATE, VLLM)


def summary_table(sections: list[Section]) -> list[str]:
    """One row per section, workload and thread configuration: every system's out tok/s,
    ours ÷ vLLM (when run) and ours ÷ the faster HF mode, and token agreement."""
    systems = SUMMARY_SYSTEMS
    lines = ["| model | dtype | scale | workload | threads | " + " | ".join(systems) +
             " | ours ÷ vLLM | ours ÷ faster HF | tokens = ours | others' cores (ours) |",
             "|---|---|---|---|---|" + "---:|" * (len(systems) + 4)]
    for sec in sections:
        f = sec.findings
        for ours in (r for r in f.runs if r.system == OURS):
            lines.append(summary_row(sec, ours, systems))
    return lines


def summary_row(sec: Section, ours: RunResult, systems: tuple) -> str:
    f = sec.findings
    rows = {s: f.find(ours.workload[:3], ours.threads, s) for s in systems}
    hf = [f.ratio(rows[s]) for s in HF_SYSTEMS if rows[s]]
    same = [f"{a.row.system}: {a.identical}/{a.total}" for a in agreements(f)
            if a.row.workload == ours.workload and a.row.threads == ours.threads
            and a.row.system in systems]
    cells = [fmt(rows[s].out_tps) if rows[s] else "-" for s in systems]
    return (f"| {sec.model_size} | {sec.dtype} | {sec.scale} | {ours.workload} | {ours.threads} | "
            + " | ".join(cells) +
            f" | {fmt(f.ratio(rows[VLLM]), '.2f', 'x') if rows[VLLM] else '-'} | "
            f"{fmt(min(hf), '.2f', 'x') if hf else '-'} | {'; '.join(same) or '-'} | "
            f"{describe_load(ours.load)} |")
