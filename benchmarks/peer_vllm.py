"""Peer: vLLM's CPU build, run by its own interpreter in a subprocess (``vllm_script.py``).

vLLM lives in its own venv (it pins other torch/transformers versions), so this side only
writes a spec, runs the script with ``--vllm-python`` and turns its JSON into ``RunResult``s.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from .ours import kv_bytes_per_token
from .result import RunResult, check_lengths
from .threads import vllm_env
from .workloads import Sizes, Workload, kv_capacity_tokens, warmup_workload

SYSTEM = "vLLM-CPU"
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_script.py")
LOG_TAIL_CHARS = 4000
# vLLM logs its OpenMP binding at start-up, e.g. "local_rank=0, core ids=[0]".
CORE_IDS = re.compile(r"core ids=\[([0-9, ]*)\]")


@dataclass
class VllmPeer:
    python: str             # the interpreter of vLLM's venv
    model_dir: str
    dtype: str
    sizes: Sizes
    repeats: int = 1        # timed runs per workload; the script keeps the fastest
    timeout_s: float = 1800.0

    def spec(self, workloads: list[Workload], vocab: int) -> dict:
        """What the script needs: the checkpoint, the engine settings (like ours), the prompts."""
        kv_tokens = max(kv_capacity_tokens(w) for w in workloads)
        # vLLM insists the pool holds one request of max_model_len: the longest one here.
        longest = max(len(p) + w.max_new_tokens for w in workloads for p in w.prompts)
        return dict(model_dir=os.path.abspath(self.model_dir), dtype=self.dtype,
                    max_num_batched_tokens=self.sizes.max_batched_tokens, max_num_seqs=256,
                    max_model_len=longest, repeats=self.repeats,
                    kv_cache_memory_bytes=kv_tokens * kv_bytes_per_token(self.model_dir, self.dtype),
                    warmup=as_spec(warmup_workload(vocab)),
                    workloads=[as_spec(w) for w in workloads])

    def run(self, workloads: list[Workload], vocab: int, threads: str) -> list[RunResult]:
        """One vLLM process (start-up ~2 min) runs every workload under one thread config."""
        with tempfile.TemporaryDirectory(prefix="bench_vllm_") as tmp:
            spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
            with open(spec_path, "w") as f:
                json.dump(self.spec(workloads, vocab), f)
            log_path = os.path.join(tmp, "vllm.log")
            self.launch(spec_path, out_path, log_path, threads)
            with open(out_path) as f:
                report = json.load(f)
            report["compute_threads"] = compute_threads_from_log(log_path)
        return [to_result(r, w, report, threads) for r, w in zip(report["runs"], workloads)]

    def launch(self, spec_path: str, out_path: str, log_path: str, threads: str) -> None:
        env = dict(os.environ, **vllm_env(threads))
        # cwd is the temp dir: whatever vLLM writes relative to it stays out of the project.
        with open(log_path, "w") as log:
            proc = subprocess.run([self.python, "-P", SCRIPT, spec_path, out_path], env=env,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=self.timeout_s,
                                  cwd=os.path.dirname(spec_path))
        if proc.returncode != 0 or not os.path.exists(out_path):
            with open(log_path) as f:
                tail = f.read()[-LOG_TAIL_CHARS:]
            raise RuntimeError(f"vLLM peer ({self.python}) exited with {proc.returncode}; "
                               f"its log ends with:\n{tail}")


def compute_threads_from_log(log_path: str) -> int | None:
    """How many cores vLLM bound its OpenMP compute threads to, as its own log says."""
    with open(log_path) as f:
        found = CORE_IDS.search(f.read())
    return len([c for c in found.group(1).split(",") if c.strip()]) if found else None


def as_spec(w: Workload) -> dict:
    return dict(name=w.name, prompts=w.prompts, max_tokens=w.max_new_tokens)


def to_result(run: dict, w: Workload, report: dict, threads: str) -> RunResult:
    check_lengths(SYSTEM, run["outputs"], w)
    bind = report["omp_threads_bind"]
    settings = (f"vllm {report['vllm_version']}, enable_prefix_caching=True, max_num_batched_tokens="
                f"{report['max_num_batched_tokens']}, VLLM_CPU_OMP_THREADS_BIND={bind}, greedy, "
                f"ignore_eos, prefix cache reset before the run, start-up {report['startup_s']:.0f} s")
    return RunResult(w.name, SYSTEM, threads, run["wall_s"], w.prompt_tokens, w.output_tokens,
                     ttfts=run["ttfts"], all_first_s=run["all_first_s"], outputs=run["outputs"],
                     settings=settings, compute_threads=report["compute_threads"],
                     extra=dict(prompt_tokens_cached=run["num_cached_tokens"]))
