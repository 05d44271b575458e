"""KV cache events in vLLM's schema: BlockStored (block hashes, parent, token ids, block size),
BlockRemoved on eviction, AllBlocksCleared on a reset; to an in-process subscriber, and over
ZMQ to a plain pyzmq subscriber on loopback, in vLLM's frames and msgpack encoding."""
from __future__ import annotations

import socket

import msgspec
import pytest
import zmq

from engine import KVEventsConfig
from helpers import greedy, make_llm, random_prompt
from vllm_api.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

NULL = KVEventsConfig(enable_kv_cache_events=True, publisher="null")


def subscribed(llm) -> list:
    batches = []
    llm.llm_engine.kv_events.subscribe(batches.append)
    return batches


def events_of(batches) -> list:
    return [event for batch in batches for event in batch.events]


def test_a_prompt_publishes_its_blocks_as_one_block_stored(llama_dir):
    llm = make_llm(llama_dir, kv_events_config=NULL)
    batches, prompt = subscribed(llm), random_prompt(40, 5)
    llm.generate([prompt], greedy(3), use_tqdm=False)
    (stored,) = events_of(batches)
    chain = [h for h in llm.prefix_cache.entries]
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
    assert stored.block_hashes == chain[:2] and stored.token_ids == prompt[:32]
    assert (stored.block_size, stored.medium, stored.lora_id) == (16, "GPU", None)


def test_a_follow_up_names_its_parent_and_eviction_and_reset_are_published(llama_dir):
    llm = make_llm(llama_dir, kv_events_config={"enable_kv_cache_events": True,
                                                 "publisher": "null"}, num_kv_blocks=6)
    batches, prompt = subscribed(llm), random_prompt(40, 6)
    llm.generate([prompt], greedy(3), use_tqdm=False)
    llm.generate([prompt + random_prompt(20, 7)], greedy(1), use_tqdm=False)
    first, follow_up = events_of(batches)
    assert follow_up.parent_block_hash == first.block_hashes[-1]
    assert follow_up.token_ids == (prompt + random_prompt(20, 7))[32:48]
    llm.generate([random_prompt(70, 8)], greedy(1), use_tqdm=False)  # the pool must evict
    removed = [e for e in events_of(batches) if isinstance(e, BlockRemoved)]
    assert removed and all(len(e.block_hashes) == 1 for e in removed)
    llm.reset_prefix_cache()
    assert isinstance(batches[-1].events[-1], AllBlocksCleared)
    assert len(batches[-1].events) == 1  # the reset's drops are said by AllBlocksCleared alone


def test_events_need_prefix_caching(llama_dir):
    with pytest.raises(ValueError, match="needs prefix caching"):
        make_llm(llama_dir, kv_events_config=NULL, enable_prefix_caching=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def receive(sub, llm) -> list:
    """Frames of the next batch; until the subscription has reached the publisher (ZMQ's slow
    joiner), each empty poll sends an AllBlocksCleared by resetting the empty cache."""
    for _ in range(100):
        if sub.poll(100):
            return sub.recv_multipart()
        llm.reset_prefix_cache()
    raise AssertionError("no KV event batch reached the subscriber")


def test_a_plain_zmq_subscriber_reads_vllms_frames(llama_dir):
    port = free_port()
    llm = make_llm(llama_dir, kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://*:{port}", topic="kv"))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        topic, number, payload = receive(sub, llm)  # the handshake's AllBlocksCleared
        prompt = random_prompt(40, 9)
        llm.generate([prompt], greedy(2), use_tqdm=False)
        while True:
            topic, next_number, payload = sub.recv_multipart()
            raw = msgspec.msgpack.decode(payload)
            if raw[1][0]["type"] == "BlockStored":
                break
        assert topic == b"kv" and int.from_bytes(next_number, "big") > int.from_bytes(number, "big")
        ts, (event,), rank = raw  # an array: [ts, events, data_parallel_rank]
        assert rank == 0 and event["token_ids"] == prompt[:32] and event["block_size"] == 16
        assert event["parent_block_hash"] is None and len(event["block_hashes"]) == 2
        typed = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
        assert typed.events[0].block_hashes == event["block_hashes"]
    finally:
        sub.close()
        llm.llm_engine.shutdown()


def test_a_step_that_fails_before_its_commit_publishes_nothing_of_it(llama_dir):
    """A forward hook raising: the step commits nothing, so it saves (and publishes) nothing;
    the step run again publishes the prompt's blocks, once."""
    llm = make_llm(llama_dir, kv_events_config=NULL)
    batches, prompt, failed = subscribed(llm), random_prompt(40, 9), []

    def fail_once(module, args, output):
        if not failed:
            failed.append(1)
            raise RuntimeError("in the forward")

    handle = llm.llm_engine.model.layers[0].register_forward_hook(fail_once)
    llm.add_request(prompt, greedy(2))
    with pytest.raises(RuntimeError, match="in the forward"):
        llm.step()
    assert llm.prefix_cache.num_cached_blocks == 0 and not llm.llm_engine.kv_events.pending
    while llm.has_unfinished_requests():
        llm.step()
    handle.remove()
    (stored,) = events_of(batches)
    assert stored.block_hashes == list(llm.prefix_cache.entries)[:2]


def test_the_publisher_binds_before_the_model_loads_and_frees_its_port_on_failure(llama_dir, monkeypatch):
    """As vLLM binds during start-up: the port is taken before the checkpoint loads (a subscriber
    that connects early misses no batch of the first generate), and an LLM() that fails after
    binding gives the port back."""
    import vllm_api.llm_engine as llm_engine

    port, seen = free_port(), []
    real = llm_engine.load_checkpoint

    def load_checkpoint(*args, **kwargs):
        probe = zmq.Context.instance().socket(zmq.PUB)
        probe.setsockopt(zmq.LINGER, 0)
        try:
            probe.bind(f"tcp://127.0.0.1:{port}")
            seen.append("free")
        except zmq.ZMQError:
            seen.append("bound")
        finally:
            probe.close()
        if len(seen) == 1:
            raise RuntimeError("the checkpoint failed to load")
        return real(*args, **kwargs)

    monkeypatch.setattr(llm_engine, "load_checkpoint", load_checkpoint)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}", topic="kv")
    with pytest.raises(RuntimeError, match="failed to load"):
        make_llm(llama_dir, kv_events_config=config)
    llm = make_llm(llama_dir, kv_events_config=config)  # the port was given back
    llm.llm_engine.shutdown()
    assert seen == ["bound", "bound"]
