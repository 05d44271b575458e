"""The track's checks: each step's scenarios, run on your cache and on the engine's, compared.

A scenario is a small script (a lookup, a prefill, the chapter's table, a real ``generate``)
that returns what it observed: hash calls, the chain's values, the hits, the map, tokens. The
same script runs on the class under test and on the engine's own ``PrefixCache``, the
oracle, and every observation must agree. A failure names the scenario and what differed,
never the code that would fix it; the chain's hash values are never printed, only which
block is the first to differ.

The prompt is the chapter's table's: the demo model's prompt 0, 527 tokens, block_size 16,
N = 32 full blocks. Every scenario but the real ``generate`` runs without a model
(teaching/model_free.py's idea: hashing never reads K/V), and the real ``generate`` runs on the
plain path (no compiled kernels are built or loaded), so a step's check takes seconds. A lookup's
observations include why it stopped (``PrefixCache.stop_of``, read off your match).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import xxhash

from block_manager import BlockManager
from prefix_cache import PrefixCache
from scheduler import Scheduler, SchedulerConfig, Sequence

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / "demo_model"
BLOCK = 16
POOL = 200  # blocks: room for every scenario's sequences (two copies of the prompt: 66)


@functools.lru_cache(maxsize=None)
def demo_prompt(index: int) -> tuple[int, ...]:
    """The demo model's prompt ``index`` (prompt 0: the chapter's table's, 527 tokens)."""
    prompts = json.loads((DEMO_MODEL / "prompts.json").read_text())["prompts"]
    return tuple(prompts[index]["prompt_ids"])


def prompt() -> list[int]:
    return list(demo_prompt(0))


# ----------------------------------------------------------------------------- observations

class Chain(list):
    """A list of hashes, compared block by block; its values are never printed."""


def describe(name: str, mine, engine) -> str:
    """One line saying how an observation differs, without the chain's values."""
    if isinstance(engine, Chain):
        mine = list(mine) if isinstance(mine, (list, tuple)) else mine
        if not isinstance(mine, list):
            return f"{name}: yours is a {type(mine).__name__}, the engine's a list of {len(engine)} hashes"
        first = next((i for i, (a, b) in enumerate(zip(mine, engine)) if a != b), None)
        if first is not None:
            agree = f"blocks 0 to {first - 1} agree" if first else "it is the first block"
            return f"{name}: block {first}'s hash differs from the engine's ({agree})"
        return f"{name}: yours has {len(mine)} hashes, the engine's {len(engine)}"
    if isinstance(mine, list) and isinstance(engine, list) and len(engine) > 4:  # name the first difference
        first = next((i for i, (a, b) in enumerate(zip(mine, engine)) if a != b), None)
        if first is None:
            return f"{name}: yours has {len(mine)} items, the engine's {len(engine)}"
        return f"{name}: item {first} differs: yours {mine[first]!r}, the engine's {engine[first]!r}"
    return f"{name}: yours {mine!r}, the engine's {engine!r}"


def differences(mine: dict, engine: dict) -> list[str]:
    return [describe(name, mine.get(name), value) for name, value in engine.items()
            if mine.get(name) != value]


# ----------------------------------------------------------------------------- the scenarios

@dataclass(frozen=True)
class Scenario:
    step: int
    name: str
    script: Callable[[type[PrefixCache]], dict]  # cache class -> observations
    needs_model: bool = False
    rule: str = ""  # the rule a failure breaks, said as the docstrings say it (never the code)


SCENARIOS: list[Scenario] = []


def scenario(step: int, name: str, needs_model: bool = False, rule: str = ""):
    def register(script):
        SCENARIOS.append(Scenario(step, name, script, needs_model, rule))
        return script
    return register


def scenarios_of(step: int) -> list[Scenario]:
    return [s for s in SCENARIOS if s.step == step]


def new_cache(cls: type[PrefixCache], strategy: str = "incremental", hash_fn=None, pool: int = POOL,
              block: int = BLOCK) -> PrefixCache:
    cache = cls(BlockManager(pool, block), strategy)
    if hash_fn is not None:
        cache.hash_fn = hash_fn
    return cache


def new_seq(cache: PrefixCache, tokens, name: str, salt: str | None = None, **kw) -> Sequence:
    return Sequence(list(tokens), kw.pop("max_tokens", 64), request_id=name, cache_salt=salt,
                    root_hash=cache.root_hash(salt), **kw)


def calls(cache: PrefixCache, fn: Callable[[], object]) -> int:
    """The hash calls ``fn()`` makes (the chapter's table counts these)."""
    before = cache.hash_computations
    fn()
    return cache.hash_computations - before


# ------------------------------------------------------------------ step 1: the chain hash

def chain_by_hand(cache: PrefixCache, seq: Sequence, seed: int) -> Chain:
    """Every full block of ``seq`` hashed with ``_chain_hash``, each seeded with the one before."""
    chain, tokens = Chain(), seq.token_view()
    for start in range(0, seq.num_tokens - BLOCK + 1, BLOCK):
        chain.append(cache._chain_hash(tokens, chain[-1] if chain else seed, start, start + BLOCK))
    return chain


@scenario(1, "one block, seed 0")
def one_block(cls):
    cache = new_cache(cls)
    seq = new_seq(cache, prompt(), "a")
    out = {}
    out["hash calls"] = calls(cache, lambda: out.setdefault(
        "the block's hash", Chain([cache._chain_hash(seq.token_view(), 0, 0, BLOCK)])))
    return out


@scenario(1, "the chain of the 527-token prompt")
def whole_chain(cls):
    cache = new_cache(cls)
    seq = new_seq(cache, prompt(), "a")
    out = {}
    out["hash calls"] = calls(cache, lambda: out.setdefault("the chain", chain_by_hand(cache, seq, 0)))
    return out


@scenario(1, "a block after generated tokens, seeded with a salt's hash")
def later_block(cls):
    cache = new_cache(cls)
    seq = new_seq(cache, prompt()[:40], "a", salt="alice")
    for token in range(30):  # tokens sampled after the prompt: the buffer grows in place
        seq.append_token(token)
    return {"block 3's hash": Chain([cache._chain_hash(seq.token_view(), seq._root_hash, 48, 64)])}


@scenario(1, "the cache's hash_fn swapped for xxh64")
def swapped_hash_fn(cls):
    cache = new_cache(cls, hash_fn=xxhash.xxh64_intdigest)
    return {"the chain": chain_by_hand(cache, new_seq(cache, prompt(), "a"), 0)}


# ------------------------------------------------------------------ step 2: the cold precompute

def precompute(cls, tokens, salt=None, times: int = 1) -> dict:
    cache = new_cache(cls)
    seq = new_seq(cache, tokens, "a", salt)
    out = {}
    for n in range(1, times + 1):
        out[f"hash calls of call {n}"] = calls(cache, lambda: cache._precompute_block_hashes(seq))
        out[f"seq._block_hashes after call {n}"] = Chain(seq._block_hashes)
    return out


@scenario(2, "a cold Sequence of 527 tokens")
def cold_sequence(cls):
    return precompute(cls, prompt())


@scenario(2, "the same Sequence, precomputed twice")
def twice(cls):
    return precompute(cls, prompt(), times=2)


@scenario(2, "a Sequence with cache_salt 'alice'")
def salted(cls):
    return precompute(cls, prompt(), salt="alice")


@scenario(2, "a prompt of exactly 32 full blocks")
def exact_blocks(cls):
    return precompute(cls, prompt()[:32 * BLOCK])


@scenario(2, "a prompt shorter than one block")
def short_prompt(cls):
    return precompute(cls, prompt()[:BLOCK - 1])


@scenario(2, "21 tokens generated after the prompt")
def after_decode(cls):
    cache = new_cache(cls)
    seq = new_seq(cache, prompt(), "a")
    cache._precompute_block_hashes(seq)
    for token in range(21):  # 527 + 21 = 548 tokens: blocks 32 and 33 are now full
        seq.append_token(token)
    return {"hash calls after the tokens": calls(cache, lambda: cache._precompute_block_hashes(seq)),
            "seq._block_hashes": Chain(seq._block_hashes)}


# ------------------------------------------------------------------ step 3: the lookup

def scheduler_for(cache: PrefixCache, budget: int = 2048) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget),
                     cache.block_manager, cache)


def run_to_end(scheduler: Scheduler, *seqs: Sequence) -> int:
    """Admit ``seqs`` and commit their prefills step by step, as ``EngineCore.step`` does minus
    the forward; each finishes once computed. Returns the hash calls made while saving."""
    cache, at_save = scheduler.prefix_cache, 0
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_unfinished:
        chunks = scheduler.schedule()
        if not chunks:
            raise RuntimeError("the scheduler made no progress (a lookup that always says 'in flight'?)")
        at_save += calls(cache, lambda: scheduler.commit(chunks))
        for seq in [s for s in scheduler.running if s.num_computed_tokens == s.num_tokens]:
            scheduler.finish(seq, "length")
    return at_save


def match_of(cache: PrefixCache, seq: Sequence, label: str = "the lookup") -> dict:
    out = {}
    out[f"hash calls of {label}"] = calls(cache, lambda: out.setdefault("match", cache.lookup(seq)))
    match = out.pop("match")
    out[f"cached tokens of {label}"] = match.num_cached_tokens
    out[f"cached block ids of {label}"] = [b.block_id for b in match.blocks]
    out[f"next_in_flight of {label}"] = match.next_in_flight
    out[f"tokens queried by {label}"] = match.queried
    out[f"the chain {label} returns"] = Chain(match.chain)
    stop = cache.stop_of(seq)  # why it stopped there: read off the match and the maps (given code)
    out[f"why {label} stopped"] = None if stop is None else str(stop)
    return out


def seen_then_looked_up(cls, tokens, salt=None, hash_fn=None, first=None) -> dict:
    """The prompt (or ``first``) prefilled and finished, then ``tokens`` looked up as a new Sequence."""
    cache = new_cache(cls, hash_fn=hash_fn)
    run_to_end(scheduler_for(cache), new_seq(cache, first or prompt(), "first"))
    return match_of(cache, new_seq(cache, tokens, "second", salt))


@scenario(3, "a cold lookup")
def cold_lookup(cls):
    cache = new_cache(cls)
    seq = new_seq(cache, prompt(), "a")
    return match_of(cache, seq) | {"seq._block_hashes": Chain(seq._block_hashes)}


@scenario(3, "the same Sequence looked up again")
def lookup_again(cls):
    cache = new_cache(cls)
    seq = new_seq(cache, prompt(), "a")
    return match_of(cache, seq, "the first lookup") | match_of(cache, seq, "the second lookup")


@scenario(3, "same prompt, new Sequence, after the first was computed")
def same_prompt(cls):
    return seen_then_looked_up(cls, prompt())


@scenario(3, "a prompt sharing the first 300 tokens")
def shared_prefix(cls):
    return seen_then_looked_up(cls, prompt()[:300] + list(range(7, 207)))


@scenario(3, "one token changed at position 100")
def one_token_changed(cls):
    tokens = prompt()
    tokens[100] = (tokens[100] + 1) % 2048
    return seen_then_looked_up(cls, tokens)


@scenario(3, "the same prompt with another cache_salt")
def other_salt(cls):
    return seen_then_looked_up(cls, prompt(), salt="bob")


@scenario(3, "a prompt of exactly 32 full blocks, seen before",
          rule="the last token is never served from cache: its logits are needed to sample")
def exact_seen(cls):
    return seen_then_looked_up(cls, prompt()[:32 * BLOCK], first=prompt()[:32 * BLOCK])


@scenario(3, "a hash that collides (hash_fn keeps 2 bits)",
          rule="a hit is a cached block that holds this sequence's tokens after the same parents "
               "(_holds), not any block under the same hash")
def collision(cls):
    weak = lambda data, seed: xxhash.xxh3_64_intdigest(data, seed) % 4  # noqa: E731
    return seen_then_looked_up(cls, list(range(100, 400)), hash_fn=weak)


@scenario(3, "the next block in flight (another request is computing it)",
          rule="if another running request is computing the block after the cached prefix, the "
               "lookup says so (next_in_flight): the new request waits a step, then hits")
def in_flight(cls):
    cache = new_cache(cls)
    scheduler = scheduler_for(cache, budget=100)  # the first request computes 100 tokens a step
    scheduler.add(new_seq(cache, prompt(), "first"))
    scheduler.commit(scheduler.schedule())  # admitted, 6 blocks saved, the rest in flight
    return match_of(cache, new_seq(cache, prompt(), "second"))


@scenario(3, "a Sequence with 21 generated tokens looked up again, after a request with the same tokens",
          rule="a lookup may serve every full block before the sequence's last token, generated tokens' "
               "blocks too: a preempted request's generated tokens are cached and served like a prompt's")
def generated_blocks_served(cls):
    cache = new_cache(cls)
    run_to_end(scheduler_for(cache), new_seq(cache, prompt() + list(range(21)), "first"))  # 34 blocks
    seq = new_seq(cache, prompt(), "preempted")
    for token in range(21):  # sampled before the preemption: the same 548 tokens
        seq.append_token(token)
    return match_of(cache, seq)


# ------------------------------------------------------------------ step 4: the save during prefill

def entries(cache: PrefixCache) -> list:
    """The map's (hash, block) pairs, in block id order."""
    return sorted(cache.entries.items(), key=lambda item: item[1].block_id)


def saved(cls, strategy: str, budget: int, tokens=None, decode: int = 0) -> dict:
    """A cold request prefilled in chunks of ``budget`` tokens (then ``decode`` tokens, one per
    step): the hash calls, those made at save, and the map afterwards."""
    cache = new_cache(cls, strategy)
    scheduler = scheduler_for(cache, budget)
    seq = new_seq(cache, tokens or prompt(), "a")
    out = {}
    out["hash calls in all"] = calls(cache, lambda: out.setdefault(
        "hash calls at save", run_prefill_and_decode(scheduler, seq, decode)))
    out["the map: cached block ids"] = [b.block_id for _, b in entries(cache)]
    out["the map: hashes, by block id"] = Chain(h for h, _ in entries(cache))
    out["seq._block_hashes afterwards"] = Chain(seq._block_hashes)
    return out


def run_prefill_and_decode(scheduler: Scheduler, seq: Sequence, decode: int) -> int:
    """Prefill ``seq``, then append ``decode`` tokens, each committed in its own step (a decode
    token is a chunk of one). Returns the hash calls made while saving."""
    cache, at_save = scheduler.prefix_cache, 0
    scheduler.add(seq)
    while seq.num_computed_tokens < seq.num_tokens or decode:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(decode)  # "sampled": any id will do, nothing reads K/V here
            decode -= 1
        chunks = scheduler.schedule()
        at_save += calls(cache, lambda: scheduler.commit(chunks))
    scheduler.finish(seq, "length")
    return at_save


@scenario(4, "a cold request, prefilled in one chunk")
def one_chunk(cls):
    return saved(cls, "incremental", 2048)


@scenario(4, "a cold request, prefilled in 16-token chunks")
def block_chunks(cls):
    return saved(cls, "incremental", 16)


@scenario(4, "a cold request, prefilled in 100-token chunks (boundaries inside chunks)")
def odd_chunks(cls):
    return saved(cls, "incremental", 100)


@scenario(4, "blocks completed during decode (40 tokens, one per step)")
def decode_blocks(cls):
    return saved(cls, "incremental", 2048, decode=40)


@scenario(4, "a twin: the same prompt computed again without reading the cache",
          rule="an identical cached block replaces the block it twins, and the next block's parent "
               "is then the twin (the cached chain), so every later block finds its twin too")
def twin(cls):
    cache = new_cache(cls)
    scheduler = scheduler_for(cache)
    run_to_end(scheduler, new_seq(cache, prompt(), "first"))
    again = new_seq(cache, prompt(), "again", reads_prefix_cache=False)  # as with prompt logprobs
    scheduler.add(again)
    scheduler.commit(scheduler.schedule())
    cached = {b.block_id for b in cache.entries.values()}
    return {"blocks switched to a cached twin": len(cached.intersection(again.block_table)),
            "its block table after the step": list(again.block_table),
            "blocks in use": cache.block_manager.num_blocks_in_use,
            "cache entries": cache.num_cached_blocks}


TABLE_ROWS = ("cold request", "  of which at save", "same Sequence looked up again",
              "same prompt, new Sequence", "two copies in one step")  # teaching/chapter_table.py's


def chapter_table(cls, strategy: str) -> dict:
    """The chapter's table, model-free: each row's hash calls, as teaching/chapter_table.py
    counts them on a real engine (max_tokens=1: a request finishes when its prompt is computed)."""
    cache = new_cache(cls, strategy)
    scheduler = scheduler_for(cache, budget=2 * len(prompt()))
    rows = {}
    rows[TABLE_ROWS[0]] = calls(cache, lambda: rows.setdefault(
        TABLE_ROWS[1], run_to_end(scheduler, new_seq(cache, prompt(), "cold"))))
    seq = new_seq(cache, prompt(), "looked-up")
    cache.lookup(seq)
    rows[TABLE_ROWS[2]] = calls(cache, lambda: cache.lookup(seq))
    rows[TABLE_ROWS[3]] = calls(cache, lambda: run_to_end(scheduler, new_seq(cache, prompt(), "new")))
    cache.reset()
    copies = (new_seq(cache, prompt(), "copy-1"), new_seq(cache, prompt(), "copy-2"))
    rows[TABLE_ROWS[4]] = calls(cache, lambda: run_to_end(scheduler, *copies))
    out = {f"row {label.strip()!r}: hash calls": rows[label] for label in TABLE_ROWS}
    out["two copies: tokens served from cache"] = scheduler.stats.prefix_cache_hits
    return out


@scenario(4, "the chapter's table, incremental column")
def table_incremental(cls):
    return chapter_table(cls, "incremental")


@scenario(4, "a real generate on the demo model (incremental)", needs_model=True)
def generate_incremental(cls):
    return real_generate(cls, "incremental")


# ------------------------------------------------------------------ step 5: the "before"

@scenario(5, "_rebuild_chain of a cold Sequence, twice")
def rebuild_twice(cls):
    cache = new_cache(cls, "recompute")
    seq = new_seq(cache, prompt(), "a")
    out = {}
    for n in (1, 2):
        out[f"hash calls of rebuild {n}"] = calls(cache, lambda: out.setdefault(
            f"the chain of rebuild {n}", Chain(cache._rebuild_chain(seq))))
    out["seq._block_hashes afterwards"] = Chain(seq._block_hashes)
    return out


@scenario(5, "_rebuild_chain of a Sequence with cache_salt 'alice' and generated tokens")
def rebuild_salted(cls):
    cache = new_cache(cls, "recompute")
    seq = new_seq(cache, prompt(), "a", salt="alice")
    for token in range(21):
        seq.append_token(token)
    return {"the chain": Chain(cache._rebuild_chain(seq))}


@scenario(5, "lookups under recompute: cold, again, and a new Sequence after a prefill")
def recompute_lookups(cls):
    cache = new_cache(cls, "recompute")
    seq = new_seq(cache, prompt(), "a")
    out = match_of(cache, seq, "the cold lookup") | match_of(cache, seq, "the second lookup")
    run_to_end(scheduler_for(cache), new_seq(cache, prompt(), "first"))
    return out | match_of(cache, new_seq(cache, prompt(), "new"), "the new Sequence's lookup")


@scenario(5, "a cold request under recompute, prefilled in 100-token chunks")
def recompute_chunks(cls):
    return saved(cls, "recompute", 100)


@scenario(5, "blocks completed during decode under recompute (40 tokens)")
def recompute_decode(cls):
    return saved(cls, "recompute", 2048, decode=40)


@scenario(5, "the chapter's table, recompute column")
def table_recompute(cls):
    return chapter_table(cls, "recompute")


@scenario(5, "a real generate on the demo model (recompute)", needs_model=True)
def generate_recompute(cls):
    return real_generate(cls, "recompute")


# ----------------------------------------------------------------------------- a real generate

# Two rounds on the demo model: three prompts sharing their first 506 tokens, then the same
# three again plus a salted copy: hits, misses, waits and saves all happen, and the tokens
# must be the engine's.
GENERATE_ROUNDS = (((0, None), (1, None), (2, None)), ((0, None), (1, None), (2, None), (0, "alice")))
GENERATE_TOKENS = 6


@functools.lru_cache(maxsize=1)
def demo_backend():
    """The demo model on the plain path (model.py's attention and linears): a check never builds
    or loads the fast layer's C++ kernels (fast/kernels.py), so it never waits for a compiler."""
    import torch

    from core.backend import Backend
    from model import load_model

    return Backend(load_model(str(DEMO_MODEL), "float32", torch.device("cpu")))


def engine_core_class():
    """``EngineCore``: the step loop, engine.py."""
    from engine import EngineCore
    return EngineCore


def real_generate(cls, strategy: str) -> dict:
    """Greedy tokens of the two rounds on an engine core built around ``cls``, and its counters."""
    from core.sampling_params import RequestOutputKind, SamplingParams
    from core.submit import Request

    backend = demo_backend()
    core = engine_core_class().build(backend.model, 160, block_size=BLOCK, backend=backend,
                                     max_num_batched_tokens=1024, hash_strategy=strategy,
                                     eos_token_ids=backend.model.config.eos_token_ids,
                                     prefix_cache_cls=cls)
    params = SamplingParams(temperature=0.0, max_tokens=GENERATE_TOKENS, ignore_eos=True)
    out = {}
    for r, requests in enumerate(GENERATE_ROUNDS, 1):
        core.add_requests([Request(f"round {r}, prompt {i}" + (f" salted {salt}" if salt else ""),
                                   list(demo_prompt(i)), params, cache_salt=salt,
                                   output_kind=RequestOutputKind.FINAL_ONLY) for i, salt in requests])
        while core.has_unfinished:
            for o in core.step():
                out[f"tokens of {o.request_id}"] = o.token_ids
                out[f"cached tokens of {o.request_id}"] = o.num_cached_tokens
                out[f"why {o.request_id}'s cached prefix ends there"] = str(o.cache_miss_reason)
    stats = core.stats()
    for key in ("hash_computations", "prefix_cache_hits", "prompt_tokens_computed", "blocks_cached"):
        out[f"stats()[{key!r}]"] = stats[key]
    return out


def oracle(script: Callable[[type[PrefixCache]], dict]) -> dict:
    """The engine's own observations of a scenario (memoised: they never change in a process)."""
    return _oracle(script)


@functools.lru_cache(maxsize=None)
def _oracle(script) -> dict:
    return script(PrefixCache)
