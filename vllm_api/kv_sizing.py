"""How many KV blocks the pool gets and how long a request may be, from the engine's config.

Sizing happens once, at start-up: an explicit ``num_kv_blocks``, or a memory budget
(``kv_cache_memory`` bytes; else a fraction of free device memory on CUDA or of available RAM
on CPU) divided by the bytes one block takes in every layer.
"""
from __future__ import annotations

import torch

from block_manager import KVCachePool
from vllm_api.config import EngineConfig


def resolve_max_model_len(wanted: int | None, limit: int) -> int:
    """``max_model_len``: the caller's, never above the checkpoint's trained positions."""
    if wanted is not None and wanted > limit:
        raise ValueError(f"max_model_len={wanted} is greater than the checkpoint's "
                         f"max_position_embeddings ({limit}); positions beyond it were "
                         f"never trained (vLLM raises here too)")
    return wanted or limit


def num_kv_blocks(config: EngineConfig, model_config, dtype: torch.dtype, device: torch.device,
                  max_model_len: int) -> int:
    """The pool's size in blocks: ``num_kv_blocks`` if given, else what the budget holds
    (never more than ``max_num_seqs`` full-length sequences could use)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = KVCachePool.bytes_per_block(model_config.num_layers, config.block_size,
                                            model_config.num_kv_heads, model_config.head_dim, dtype)
    budget = config.kv_cache_memory or _default_budget(config, device)
    blocks = int(budget // per_block)
    if blocks < 1:
        raise ValueError(f"KV budget of {int(budget)} bytes (kv_cache_memory) is too small for one "
                         f"block of {config.block_size} tokens in each of "
                         f"{model_config.num_layers} layers ({per_block} bytes)")
    useful = config.max_num_seqs * -(-max_model_len // config.block_size)
    return min(blocks, useful)


def _default_budget(config: EngineConfig, device: torch.device) -> float:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free * config.gpu_memory_utilization
    return available_ram() * config.cpu_kv_cache_fraction


def available_ram() -> int:
    """Bytes of RAM available now (Linux /proc/meminfo; 4 GiB where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
