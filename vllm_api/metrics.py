"""``LLM.get_metrics()``: the engine's counters as vLLM's metric objects (``vllm.v1.metrics
.reader``: ``Counter``, ``Gauge``, ``Histogram``, ``Vector``), named as vLLM names them, so
vLLM's metrics example runs. Built from ``LLM.stats()``; cumulative over the LLM's life.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    values: list[int] = field(default_factory=list)


@dataclass
class Histogram(Metric):
    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)


# vLLM metric name -> (kind, key of LLM.stats())
COUNTERS = {
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:num_preemptions": "preemptions",
    "vllm:engine_steps": "steps",
    "vllm:prefix_cache_evictions": "evictions",
    "vllm:prefix_cache_hash_computations": "hash_computations",
    # the disk tier under the pool (core/kv_disk.py); zero when it is off
    "vllm:kv_disk_hits": "kv_disk_hits",
    "vllm:kv_disk_misses": "kv_disk_misses",
    "vllm:kv_disk_bad_files": "kv_disk_bad_files",
    "vllm:kv_disk_bytes_read": "kv_disk_bytes_read",
    "vllm:kv_disk_bytes_written": "kv_disk_bytes_written",
}
GAUGES = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:prefix_cache_hit_rate": "prefix_cache_hit_rate",
    "vllm:num_kv_blocks": "num_blocks",
    "vllm:kv_blocks_in_use": "blocks_in_use",
    "vllm:kv_blocks_cached": "blocks_cached",
    "vllm:kv_blocks_free": "free_blocks",
    "vllm:kv_disk_load_seconds": "kv_disk_load_seconds",
    "vllm:kv_disk_place_seconds": "kv_disk_place_seconds",
}


def metrics_from_stats(stats: dict, running: int = 0, waiting: int = 0,
                       model_name: str = "") -> list[Metric]:
    """vLLM-shaped metrics from ``LLM.stats()`` plus the current request counts."""
    values = dict(stats)
    values["kv_cache_usage"] = stats["blocks_in_use"] / max(stats["num_blocks"], 1)
    values["num_requests_running"], values["num_requests_waiting"] = running, waiting
    labels = {"model_name": model_name, "engine": "0"}
    metrics: list[Metric] = [Counter(name, dict(labels), int(values[key]))
                             for name, key in COUNTERS.items()]
    metrics += [Gauge(name, dict(labels), float(values[key])) for name, key in GAUGES.items()]
    return metrics
