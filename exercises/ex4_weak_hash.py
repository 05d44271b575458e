"""Exercise 4: plug in a 3-value hash and watch verification turn collisions into misses.

``PrefixCache.hash_fn`` is swappable. Replace xxhash with ``(seed + data[0]) % 3``: every
block hash is 0, 1 or 2, so different blocks collide all the time. Send the demo prompt
(527 tokens, 32 full blocks) once, then again as a new request. Predict:

* how many entries the prefix cache can hold at most;
* whether any output token changes (a collision served as a hit would read someone else's K/V);
* how many blocks of the second request hit, and what stops it.

Each cached block keeps its token ids, its parent block and its salt; a hit is checked
against them (``PrefixCache._holds``), and a save that finds another block under its hash
keeps that block private. Check: ``python -m exercises.ex4_weak_hash``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import LLM
from exercises.common import DEMO_MODEL, demo_prompt, send


def three_values(data: bytes, seed: int) -> int:
    return (seed + data[0]) % 3


@dataclass
class WeakHashOutcome:
    cache_entries: int       # after the first request
    hits: int                # blocks of the second request served from cache
    collisions_caught: int   # lookups that found an entry under the hash, holding other tokens
    tokens_identical: bool   # second request's output == the xxhash engine's

    def line(self) -> str:
        return (f"3-value hash: {self.cache_entries} cache entries after the first request; the second "
                f"request hit {self.hits} blocks, then verification rejected a colliding entry "
                f"({self.collisions_caught} caught); tokens identical to xxhash's: {self.tokens_identical}")


def measure(model: str = str(DEMO_MODEL), max_tokens: int = 8) -> WeakHashOutcome:
    prompt = demo_prompt(0)
    reference = send(LLM(model, device="cpu", dtype="float32", max_num_seqs=2), [prompt], max_tokens)[0]
    llm = LLM(model, device="cpu", dtype="float32", max_num_seqs=2)
    llm.prefix_cache.hash_fn = three_values
    send(llm, [prompt], max_tokens)
    entries = llm.prefix_cache.num_cached_blocks
    llm.prefix_cache.events = []
    (again,) = send(llm, [prompt], max_tokens)
    events = [e for e in llm.prefix_cache.events if e.request_id == again.request_id]
    hits = sum(e.kind == "hit" for e in events)
    caught = sum(e.kind == "miss" and e.block_hash in llm.prefix_cache.entries for e in events)
    return WeakHashOutcome(entries, hits, caught, again.output_token_ids == reference.output_token_ids)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(measure().line())
