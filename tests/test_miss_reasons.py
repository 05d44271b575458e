"""Every cache miss says why: the reason is on the lookup's "miss" event, on its match, and in
the request's output beside ``num_cached_tokens`` (``cache_miss_reason``) -- one test per
reason: never cached, evicted, dropped by a reset, another cache_salt, a hash collision, the
partial tail, the last token, shorter than a block, a block in flight, a request that reads
no cache, caching off."""
from __future__ import annotations

import pytest

from block_manager import BlockManager
from engine import SamplingParams
from helpers import greedy, make_llm, random_prompt
from prefix_cache import PrefixCache
from scheduler import Sequence

BS = 4


def output_reason(llm, prompt, **params) -> tuple[int, str]:
    out = llm.generate([prompt], greedy(2, **params), use_tqdm=False)[0]
    return out.num_cached_tokens, out.cache_miss_reason


@pytest.fixture
def llm(llama_dir):
    return make_llm(llama_dir, block_size=BS, num_kv_blocks=8)


def test_a_cold_prompt_was_never_cached(llm):
    assert output_reason(llm, random_prompt(10, 1)) == (0, "block 0: no entry for its hash (never cached)")


def test_the_partial_tail_and_the_last_token(llm):
    prompt = random_prompt(10, 2)
    llm.generate([prompt], greedy(1), use_tqdm=False)
    assert output_reason(llm, prompt) == (8, "the last 2 tokens are not a full block")
    exact = random_prompt(12, 3)
    llm.generate([exact], greedy(1), use_tqdm=False)
    assert output_reason(llm, exact) == (8, "block 2 holds the last token, never served (its logits are needed)")


def test_shorter_than_a_block(llm):
    assert output_reason(llm, random_prompt(3, 4)) == (0, "the prompt (3 tokens) is shorter than a block (4): nothing to cache")


def test_evicted_and_dropped_by_a_reset(llm):
    first = random_prompt(9, 5)
    llm.generate([first], greedy(1), use_tqdm=False)  # 2 blocks cached
    llm.generate([random_prompt(28, 6)], greedy(1), use_tqdm=False)  # 7 blocks: 1 of them reused
    # freed tail first, so the first block outlives the second (its head is the most shared)
    assert output_reason(llm, first) == (4, "block 1: no entry for its hash (evicted (its block was reused))")
    again = random_prompt(9, 7)
    llm.generate([again], greedy(1), use_tqdm=False)
    assert llm.reset_prefix_cache()
    assert output_reason(llm, again)[1] == "block 0: no entry for its hash (dropped by reset_prefix_cache())"


def test_another_cache_salt(llm):
    prompt = random_prompt(10, 8)
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}], greedy(1), use_tqdm=False)
    # the salt seeds the chain: another salt's hash has no entry at all; the same salt hits
    out = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}], greedy(1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 8
    out = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "b"}], greedy(1), use_tqdm=False)[0]
    assert out.cache_miss_reason == "block 0: no entry for its hash (never cached)"


def test_an_entry_of_another_salt_or_other_tokens_is_named():
    """Under a hash that collides (every block the same hash), the entry found is another
    request's: other tokens, or the same tokens under another salt."""
    cache = PrefixCache(BlockManager(num_blocks=8, block_size=BS))
    cache.hash_fn = lambda data, seed: 7
    saved = Sequence(list(range(8)), max_tokens=1)
    saved.block_table = [cache.block_manager.allocate().block_id for _ in range(2)]
    cache.lookup(saved)
    cache.cache_blocks(saved, 0, 8)
    with cache.recording() as events:
        match = cache.lookup(Sequence(list(range(100, 109)), max_tokens=1))
    assert match.stop_reason == "block 0: the entry holds other tokens (a hash collision)"
    assert [e.reason for e in events if e.kind == "miss"] == [match.stop_reason]
    salted = Sequence(list(range(9)), max_tokens=1, cache_salt="x", root_hash=cache.root_hash("x"))
    assert cache.lookup(salted).stop_reason == "block 0: the entry was cached under another cache_salt"


def test_a_block_in_flight_is_waited_for_then_served(llama_dir):
    """The engine: the second copy waits while the first computes (the wait's reason is the
    lookup's), then hits; its output gives the reason of the lookup that admitted it."""
    llm = make_llm(llama_dir, block_size=BS, max_num_batched_tokens=8)
    prompt = random_prompt(20, 9)
    with llm.prefix_cache.recording() as events:
        outs = llm.generate([prompt, prompt + [5]], greedy(1), use_tqdm=False)
    assert [e.kind for e in events].count("wait") >= 1
    assert outs[1].num_cached_tokens == 20
    assert outs[1].cache_miss_reason == "the last 1 tokens are not a full block"


def test_a_request_that_reads_no_cache_and_caching_off(llama_dir):
    llm = make_llm(llama_dir, block_size=BS)
    prompt = random_prompt(10, 11)
    llm.generate([prompt], greedy(1), use_tqdm=False)
    cached, why = output_reason(llm, prompt, prompt_logprobs=1)
    assert cached == 0 and why.startswith("this request reads no cache")
    off = make_llm(llama_dir, block_size=BS, enable_prefix_caching=False)
    assert output_reason(off, prompt) == (0, "prefix caching is off")


def test_in_flight_reason_on_the_match():
    cache = PrefixCache(BlockManager(num_blocks=8, block_size=BS))
    first, second = Sequence(list(range(12)), max_tokens=1), Sequence(list(range(12)), max_tokens=1)
    cache.mark_in_flight(first, cache.lookup(first))
    match = cache.lookup(second)
    assert match.next_in_flight
    assert match.stop_reason == "block 0 is being computed by another request: this one waits a step"


def test_sampling_params_are_untouched(llama_dir):
    assert "cache_miss_reason" not in SamplingParams.__struct_fields__


def test_the_chain_view_and_the_step_story_carry_the_reason(llm):
    """run.py --chain's block table keeps each miss's reason; the step page's story tells it."""
    from teaching.chain_view import trace_blocks
    from teaching.step_story import StepStory
    prompt = random_prompt(10, 12)
    with llm.prefix_cache.recording() as events:
        out = llm.generate([prompt], greedy(1), use_tqdm=False)[0]
    blocks = trace_blocks(events, out.request_id)
    assert blocks[0].miss_reason == "block 0: no entry for its hash (never cached)"
    miss = {"kind": "miss", "index": 0, "hash": "ab", "reason": blocks[0].miss_reason}
    assert StepStory._first_miss([miss]) == "; it stops at block 0: no entry for its hash (never cached)"
