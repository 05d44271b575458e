"""Exercise 4: plug in a 3-value hash. Can a collision ever produce a wrong token?

``llm.prefix_cache.hash_fn`` is swappable: any function (block bytes, seed) -> int. Replace
xxhash with ``(seed + data[0]) % 3``: every block hash is then 0, 1 or 2, so different blocks
collide all the time. Send the demo prompt (527 tokens, 32 full blocks) once; then send it
again as a new request.

Each cached block keeps the token ids it holds, its parent block and its ``cache_salt``. A
lookup that finds an entry under a block's hash checks them (``PrefixCache._holds``) before
it counts a hit; a save that finds another block already under its hash leaves its own
block out of the map.

Predict:

1. the most entries the prefix cache can ever hold with this hash;
2. whether any output token of the second request differs from what the same engine with
   xxhash produces (yes / no);
3. how many blocks of the second request hit, compared with the entries the cache holds
   after the first request (fewer / equal / more).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine import LLM
from exercises.common import DEMO_MODEL, demo_prompt, send

TITLE = "A 3-value hash"
ASKS = ("most entries", "a token differs (yes/no)", "hits vs entries (fewer/equal/more)")
HINT = ("A block is saved only when its parent block is cached. Which blocks of the prompt can "
        "therefore be in the map, and which of them does the second request walk through?")


def three_values(data: bytes, seed: int) -> int:
    return (seed + data[0]) % 3


@dataclass
class WeakHashOutcome:
    max_entries: int         # distinct values the hash can take
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
    engine = dict(device="cpu", dtype="float32", max_num_seqs=2, num_kv_blocks=128, enforce_eager=True)
    reference = send(LLM(model, **engine), [prompt], max_tokens)[0]
    llm = LLM(model, **engine)
    llm.prefix_cache.hash_fn = three_values
    send(llm, [prompt], max_tokens)
    entries = llm.prefix_cache.num_cached_blocks
    with llm.prefix_cache.recording() as recorded:  # what the second request's lookup does
        (again,) = send(llm, [prompt], max_tokens)
    events = [e for e in recorded if e.request_id == again.request_id]
    hits = sum(e.kind == "hit" for e in events)
    caught = sum(e.kind == "miss" and e.block_hash in llm.prefix_cache.entries for e in events)
    values = len({three_values(bytes([b]), s) for b in range(256) for s in range(3)})
    return WeakHashOutcome(values, entries, hits, caught, again.output_token_ids == reference.output_token_ids)


def answer(outcome: WeakHashOutcome) -> list[str]:
    compared = "fewer" if outcome.hits < outcome.cache_entries else (
        "equal" if outcome.hits == outcome.cache_entries else "more")
    return [str(outcome.max_entries), "no" if outcome.tokens_identical else "yes", compared]


def report(outcome: WeakHashOutcome) -> list[str]:
    return [outcome.line()]


if __name__ == "__main__":
    print("\n".join(report(measure())))
