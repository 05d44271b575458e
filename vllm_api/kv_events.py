"""vLLM's KV cache events, from this engine's prefix cache: ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared`` in batches (``KVEventBatch``), with vLLM 0.32's field names, order and
msgpack encoding (vllm.distributed.kv_events), so a consumer written for vLLM -- a KV-aware
router that sends a request to the machine holding its prefix -- reads them unchanged.

``LLM(..., kv_events_config=KVEventsConfig(enable_kv_cache_events=True))`` turns them on;
``publisher="zmq"`` (the default when enabled, as in vLLM) also sends each batch on a ZMQ PUB
socket as vLLM does: frames (topic, sequence number as 8 big-endian bytes, msgpack payload);
``publisher="null"`` keeps them in the process, for ``llm.llm_engine.kv_events.subscribe(fn)``.

The stream listens to the prefix cache's trace (prefix_cache.py): "save" becomes
``BlockStored`` (consecutive saves of one request merge into one event, as vLLM groups a
request's blocks cached in one step), "evict" ``BlockRemoved``, a reset's "forget"s
``BlockRemoved`` -- or, when the reset emptied the map ("clear"), one ``AllBlocksCleared``.
With the disk tier on (core/kv_disk.py), its writes and budget removals are ``BlockStored`` /
``BlockRemoved`` with ``medium="DISK"`` (the pool's carry "GPU", vLLM's name for its own pool).
Batches are flushed by the vLLM layer after each ``LLMEngine.step()``, at the end of each
``generate()`` and after a reset. Block hashes are sent as vLLM sends them: the low 64 bits.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import msgspec
import numpy as np

from core.kv_disk import MEDIUM_DISK
from vllm_api.block_hash import event_block_hash
from vllm_api.errors import refuse

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # vLLM's name for an engine's own KV pool, whatever the device
# The disk tier's blocks carry MEDIUM_DISK ("DISK", core/kv_disk.py): vLLM's own offloading
# names its CPU tier "CPU"; the field is a free string a router matches on.


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Any KV cache event; encoded with its class name as tag."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVEventsConfig(msgspec.Struct, kw_only=True):
    """vLLM's ``KVEventsConfig``: the same fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "null" or "zmq"; None: "zmq" when enabled, as in vLLM
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"publisher must be 'null' or 'zmq', got {self.publisher!r}")


def as_config(value) -> KVEventsConfig | None:
    """``kv_events_config`` given as vLLM's object, a dict, or None."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, dict):
        return KVEventsConfig(**value)
    fields = {name: getattr(value, name) for name in KVEventsConfig.__struct_fields__
              if hasattr(value, name)}  # vLLM's own KVEventsConfig object
    return KVEventsConfig(**fields)


class KVEventStream:
    """Turns one prefix cache's trace into vLLM's events; ``flush()`` hands the pending ones,
    as one ``KVEventBatch``, to every subscriber. Each event is a change the cache really made:
    a step that fails before its commit saves nothing (its evictions do happen, and are
    published). A subscriber that raises is logged and counted (``failed_sends``); the others
    still get every batch."""

    def __init__(self, prefix_cache, block_size: int) -> None:
        self.blocks = prefix_cache.block_manager.blocks
        self.block_size = block_size
        self.lock = threading.Lock()
        self.pending: list[KVCacheEvent] = []
        self._last_request: str | None = None  # whose BlockStored the last pending event is
        self._forgotten: list[int] = []
        self.subscribers: list[Callable[[KVEventBatch], None]] = []
        self.failed_sends = 0
        prefix_cache.subscribe(self.on_chain_event)
        if prefix_cache.tier.enabled:
            prefix_cache.tier.subscribe(self.on_tier_event)

    def subscribe(self, callback: Callable[[KVEventBatch], None]) -> None:
        self.subscribers.append(callback)

    def unsubscribe(self, callback: Callable[[KVEventBatch], None]) -> None:
        self.subscribers.remove(callback)

    def on_chain_event(self, event) -> None:
        handler = {"save": self._stored, "evict": self._removed, "forget": self._forget,
                   "clear": self._cleared}.get(event.kind)
        if handler is not None:
            with self.lock:
                handler(event)

    def on_tier_event(self, kind: str, block_hash: int, parent: int | None,
                      token_bytes: bytes | None) -> None:
        """The disk tier wrote a block ("stored") or removed one to keep its budget."""
        with self.lock:
            if kind == "stored":
                self._append(BlockStored(
                    block_hashes=[event_block_hash(block_hash)],
                    parent_block_hash=None if parent is None else event_block_hash(parent),
                    token_ids=np.frombuffer(token_bytes, dtype=np.int64).tolist(),
                    block_size=self.block_size, lora_id=None, medium=MEDIUM_DISK,
                    lora_name=None, group_idx=0))
            else:
                self._append(BlockRemoved(block_hashes=[event_block_hash(block_hash)],
                                          medium=MEDIUM_DISK, group_idx=0))

    def _stored(self, event) -> None:
        self._flush_forgotten()
        block = self.blocks[event.block_id]
        parent = self.blocks[block.parent[0]].block_hash if block.parent else None
        tokens = np.frombuffer(block.token_bytes, dtype=np.int64).tolist()
        last = self.pending[-1] if self.pending else None
        if (isinstance(last, BlockStored) and self._last_request == event.request_id
                and parent is not None and last.block_hashes[-1] == event_block_hash(parent)):
            last.block_hashes.append(event_block_hash(event.block_hash))
            last.token_ids.extend(tokens)
            return
        self.pending.append(BlockStored(
            block_hashes=[event_block_hash(event.block_hash)],
            parent_block_hash=None if parent is None else event_block_hash(parent),
            token_ids=tokens, block_size=self.block_size, lora_id=None, medium=MEDIUM_GPU,
            lora_name=None, group_idx=0))
        self._last_request = event.request_id

    def _removed(self, event) -> None:
        self._flush_forgotten()
        self._append(BlockRemoved(block_hashes=[event_block_hash(event.block_hash)],
                                  medium=MEDIUM_GPU, group_idx=0))

    def _forget(self, event) -> None:
        self._forgotten.append(event_block_hash(event.block_hash))

    def _cleared(self, event) -> None:
        self._forgotten.clear()  # the reset emptied the map: one AllBlocksCleared says it all
        self._append(AllBlocksCleared())

    def _flush_forgotten(self) -> None:
        for block_hash in self._forgotten:
            self._append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU, group_idx=0))
        self._forgotten.clear()

    def _append(self, event: KVCacheEvent) -> None:
        self.pending.append(event)
        self._last_request = None

    def flush(self) -> KVEventBatch | None:
        """Send what is pending as one batch (None if nothing is)."""
        with self.lock:
            self._flush_forgotten()
            if not self.pending:
                return None
            batch = KVEventBatch(ts=time.time(), events=self.pending, data_parallel_rank=0)
            self.pending, self._last_request = [], None
        for callback in list(self.subscribers):
            self._send(callback, batch)
        return batch

    def _send(self, callback: Callable[[KVEventBatch], None], batch: KVEventBatch) -> None:
        """One subscriber's failure is its own: logged and counted, as vLLM's publisher does."""
        try:
            callback(batch)
        except Exception as exc:  # noqa: BLE001 -- any subscriber error; the others go on
            self.failed_sends += 1
            logger.warning("a KV event subscriber (%r) raised %r; batch %s skipped for it",
                           callback, exc, batch.ts)


def start_publisher(config):
    """The ZMQ publisher of ``kv_events_config``, bound now (None when off or not ZMQ): the
    engine starts it before it loads the model, as vLLM binds during start-up, so a subscriber
    that connects early misses no batch of the first ``generate()``."""
    config = as_config(config)
    if config is None or not config.enable_kv_cache_events or config.publisher != "zmq":
        return None
    if config.replay_endpoint is not None:
        refuse("replaying KV events (replay_endpoint)", "subscribers get the live stream only")
    from vllm_api.kv_events_zmq import ZmqEventPublisher
    return ZmqEventPublisher(config.endpoint, config.topic, config.hwm)


def build_stream(config, prefix_cache, block_size: int, publisher=None):
    """The event stream for ``kv_events_config`` (None when off), feeding ``publisher``."""
    config = as_config(config)
    if config is None or not config.enable_kv_cache_events:
        return None
    if not prefix_cache.enabled:
        raise ValueError("kv_events_config needs prefix caching: cache events name cached "
                         "blocks (enable_prefix_caching=False)")
    stream = KVEventStream(prefix_cache, block_size)
    if publisher is not None:
        stream.publisher = publisher
        stream.subscribe(publisher.publish)
    return stream
