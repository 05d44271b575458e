"""vLLM's ZMQ publisher of KV cache events: each ``KVEventBatch`` goes out on a PUB socket as
three frames -- the topic, a sequence number (8 bytes, big-endian, from 0), and the batch as
msgpack -- exactly as vLLM's ``ZmqEventPublisher`` sends them, so vLLM's subscribers (and
KV-aware routers) read this engine's events unchanged.

The endpoint follows vLLM's rule: one with ``*`` (``tcp://*:5557``), ``::``, ``ipc://`` or
``inproc://`` is bound, any other is connected to. Sends never block: past the high-water mark
a slow subscriber loses batches, as with vLLM. Publishing is synchronous under a lock (a ZMQ
socket serves one thread at a time), so there is no publisher thread to stop.
"""
from __future__ import annotations

import itertools
import threading
import time

import msgspec


class ZmqEventPublisher:
    def __init__(self, endpoint: str = "tcp://*:5557", topic: str = "", hwm: int = 100_000) -> None:
        import zmq  # pyzmq: only the zmq publisher needs it

        self.endpoint = endpoint
        self._topic = topic.encode("utf-8")
        self._encoder = msgspec.msgpack.Encoder()
        self._sequence = itertools.count()
        self._lock = threading.Lock()
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        if is_bind_endpoint(endpoint):
            bind_when_free(self._socket, endpoint)
        else:
            self._socket.connect(endpoint)

    def publish(self, batch) -> None:
        import zmq

        payload = self._encoder.encode(batch)
        with self._lock:
            if self._socket is None:
                raise RuntimeError("the KV event publisher is shut down")
            number = next(self._sequence).to_bytes(8, "big")
            try:
                self._socket.send_multipart((self._topic, number, payload), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # past the high-water mark: this batch is dropped, as vLLM's would be

    def shutdown(self) -> None:
        with self._lock:
            if self._socket is not None:
                self._socket.close(linger=0)
                self._socket = None


BIND_TRIES, BIND_WAIT_S = 20, 0.05


def bind_when_free(socket, endpoint: str) -> None:
    """Bind, waiting a little while the port is still being released (ZMQ closes a socket in
    its I/O thread: a publisher just shut down, by an LLM() that failed, may still hold it)."""
    import zmq

    for attempt in range(BIND_TRIES):
        try:
            return socket.bind(endpoint)
        except zmq.ZMQError as err:
            if err.errno != zmq.EADDRINUSE or attempt == BIND_TRIES - 1:
                raise
            time.sleep(BIND_WAIT_S)


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard, IPv6-any, ipc and inproc endpoints are bound."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
