"""The engine core on its own: built from parts, around one loaded model shared by several
engines, with either backend; the chapter's state has one writer and the eviction hook is
passed in; recording is a context that always ends."""
from __future__ import annotations

import pytest

from block_manager import BlockManager
from core.backend import Backend
from engine import EngineCore
from helpers import add, drain, greedy, make_core, random_prompt, shared_backend
from invariants import assert_idle, check_accounting
from prefix_cache import PrefixCache
from scheduler import Sequence


def test_a_core_from_parts_generates_hf_greedy(llama_dir, reference):
    core = make_core(llama_dir, block_size=8, num_kv_blocks=40, max_num_batched_tokens=32)
    prompts = [random_prompt(n, seed=n) for n in (5, 17, 40)]
    ids = [add(core, p, greedy(10)) for p in prompts]
    outputs = drain(core)
    reference.compare_all(prompts, [outputs[i] for i in ids], 10)
    assert_idle(core)


def test_engines_share_one_loaded_model(llama_dir):
    """Two cores around the same model weights, each with its own pool: same tokens, and a
    request on one leaves the other's pool untouched."""
    first, second = (make_core(llama_dir, block_size=4, num_kv_blocks=30) for _ in range(2))
    assert first.model is second.model and first.block_manager is not second.block_manager
    prompt = random_prompt(21, seed=3)
    rid = add(first, prompt, greedy(6))
    out_first = drain(first)[rid]
    assert second.block_manager.num_blocks_in_use == 0 and second.stats()["steps"] == 0
    rid = add(second, prompt, greedy(6))
    assert drain(second)[rid].token_ids == out_first.token_ids


def test_plain_and_fast_backends_give_the_same_tokens(llama_dir):
    prompts = [random_prompt(n, seed=40 + n) for n in (3, 16, 33)]
    tokens = {}
    for fast in (False, True):
        core = make_core(llama_dir, fast_paths=fast, block_size=4, num_kv_blocks=60,
                         max_num_batched_tokens=20)
        ids = [add(core, p, greedy(8)) for p in prompts]
        outs = drain(core)
        tokens[fast] = [outs[i].token_ids for i in ids]
    assert tokens[False] == tokens[True]


def test_build_without_a_backend_is_the_plain_path(llama_dir):
    model = shared_backend(llama_dir).model
    core = EngineCore.build(model, 16, block_size=4)
    assert type(core.model_runner.backend) is Backend
    assert core.model_runner.kv_cache.k.shape[2] == 16 * 4


def test_the_pool_never_reaches_up_into_the_cache():
    """The prefix cache rewires nothing of the pool; the pool calls nothing of the cache: a
    cached-and-free block is evicted by the cache (the scheduler asks it), then taken."""
    blocks = BlockManager(num_blocks=2, block_size=4)
    before = dict((name, getattr(blocks, name)) for name in ("blocks", "free_queue", "block_size"))
    cache = PrefixCache(blocks)
    assert {name: getattr(blocks, name) for name in before} == before
    assert not hasattr(blocks, "on_evict")
    seq = Sequence(list(range(9)), max_tokens=1)
    seq.block_table = [blocks.allocate().block_id for _ in range(2)]
    cache.cache_blocks(seq, 0, 8)                  # both full blocks saved
    assert cache.num_cached_blocks == 2
    blocks.release(seq.block_table)
    with pytest.raises(RuntimeError, match="still cached: evict it from the prefix cache first"):
        blocks.allocate()
    cache.evict(blocks.free_queue.head)
    first = blocks.allocate()                      # the LRU block, its entry gone first
    assert first.block_hash is None and cache.num_cached_blocks == 1 and cache.num_evictions == 1
    assert first.ref_count == 1 and first.generation == 2


def test_recording_ends_with_its_block_even_on_an_error():
    cache = PrefixCache(BlockManager(num_blocks=4, block_size=4))
    with pytest.raises(RuntimeError):
        with cache.recording() as events:
            cache.lookup(Sequence(list(range(9)), max_tokens=1))
            raise RuntimeError("stop")
    assert [e.kind for e in events] == ["hash", "hash", "miss"]
    assert cache._listeners == []
    cache.lookup(Sequence(list(range(9, 18)), max_tokens=1))
    assert len(events) == 3  # nothing recorded after the block


def test_sequence_keeps_no_sampling_parameters():
    seq = Sequence([1, 2, 3], max_tokens=4, reads_prefix_cache=False)
    assert seq.max_tokens == 4 and not seq.reads_prefix_cache and not hasattr(seq, "sampling_params")
    with pytest.raises(TypeError, match="max_tokens"):
        Sequence([1, 2, 3], greedy(4))


def test_check_accounting_holds_on_a_fresh_core(llama_dir):
    check_accounting(make_core(llama_dir))
