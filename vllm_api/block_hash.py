"""vLLM's block hash algorithms (``prefix_caching_hash_algo``) as the prefix cache's hash
functions.

The prefix cache takes any ``hash_fn(block bytes, parent hash) -> int`` (prefix_cache.py). The
engine's own chain, the chapter's and the default, is xxh3_64 of the block's int64 ids seeded
with the parent's hash: one call on bytes that are already packed. vLLM 0.32 offers four
algorithms, each a serialisation of ``(parent hash, token ids, extra keys)`` and a digest:

    sha256       pickle -> SHA-256 (32 bytes)        vLLM's default
    sha256_cbor  canonical CBOR -> SHA-256           reproducible outside Python
    xxhash       pickle -> xxh3_128 (16 bytes)
    xxhash_cbor  canonical CBOR -> xxh3_128

``VllmBlockHash(name)`` computes exactly that: it reads the block's bytes back as token ids,
the parent int as its digest's bytes, and the chain's root (parent 0) as vLLM's ``NONE_HASH``.
So a chain equals vLLM's block for block, for blocks without extra keys (no LoRA, no images,
no cache_salt: here a salt seeds the chain instead of joining the first block's extra keys).
The map keys are ints: each digest read big-endian.

vLLM's root: the digest of ``PYTHONHASHSEED`` if set, else of the fixed "vllm-none-hash" for
the sha256 pair (so machines agree on names) and of random bytes for the xxhash pair (a
predictable seed would let anyone precompute collisions). Here a collision costs a miss
either way: every hit is checked against the block's tokens.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from typing import Callable

import numpy as np
import xxhash

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_ROOT_SEED = "vllm-none-hash"
NON_CRYPTO = ("xxhash", "xxhash_cbor")


def _pickle(value) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(value) -> bytes:
    import cbor2  # only the *_cbor algorithms need it
    return cbor2.dumps(value, canonical=True)


DIGESTS: dict[str, tuple[Callable[[bytes], bytes], int]] = {
    "sha256": (lambda data: hashlib.sha256(data).digest(), 32),
    "xxhash": (xxhash.xxh3_128_digest, 16),
}
SERIALISERS = {"sha256": _pickle, "sha256_cbor": _cbor, "xxhash": _pickle, "xxhash_cbor": _cbor}


def root_seed(algo: str) -> str:
    """What vLLM derives its chain's root from (see the module docstring)."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    return os.urandom(32).hex() if algo in NON_CRYPTO else DEFAULT_ROOT_SEED


class VllmBlockHash:
    """``hash_fn(block bytes, parent) -> int`` computing vLLM's ``hash_block_tokens``."""

    def __init__(self, algo: str) -> None:
        if algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, "
                             f"got {algo!r}")
        self.algo = algo
        self._serialise = SERIALISERS[algo]
        self._digest, self.digest_size = DIGESTS[algo.removesuffix("_cbor")]
        self.none_hash = self.digest(root_seed(algo))  # vLLM's NONE_HASH

    def digest(self, value) -> bytes:
        """vLLM's hash function of this name, on any value it serialises."""
        return self._digest(self._serialise(value))

    def __call__(self, data: bytes, parent: int) -> int:
        parent_bytes = (self.none_hash if parent == 0
                        else parent.to_bytes(self.digest_size, "big"))
        return int.from_bytes(self.digest((parent_bytes, block_tokens(data), None)), "big")

    def __repr__(self) -> str:
        return f"VllmBlockHash({self.algo!r})"


def block_tokens(data: bytes):
    """A block's token ids as vLLM hashes them (a tuple of ints); bytes that are not whole
    int64 ids (a cache_salt seeding a chain) stay bytes."""
    if len(data) % 8:
        return data
    return tuple(np.frombuffer(data, dtype="<i8").tolist())


def event_block_hash(block_hash: int) -> int:
    """A block hash as vLLM's KV events carry it: the digest's last 8 bytes, an int
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default)."""
    return block_hash & ((1 << 64) - 1)


def hash_fn_for(algo: str | None):
    """The prefix cache's hash function for ``prefix_caching_hash_algo`` (None: the engine's
    own xxh3_64 chain)."""
    return None if algo is None else VllmBlockHash(algo)
