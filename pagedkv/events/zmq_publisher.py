"""`ZmqPublisher`: a prefix cache's events published over ZeroMQ in vLLM's KV-event wire
format, off the engine's thread, with a replay buffer for subscribers that saw a gap.

The engine's side (`publisher(event)`, what `PrefixCache(on_event=publisher)` calls) only
appends to a bounded queue: when the queue is full the event is dropped and counted (the
engine never blocks on a slow or absent subscriber); the count is in `stats()` and a
`kv_events_dropped` warning is logged once per run of drops. The publisher's thread takes
what is queued (up to `max_batch` events), encodes one `KVEventBatch` and sends it as
three frames on a PUB socket: the topic, the batch's sequence number (8 bytes, big-endian,
from 0) and the msgpack payload, and keeps the last `buffer_steps` batches.

Replay (with `replay_endpoint`): a ROUTER socket; a subscriber (a DEALER or REQ socket)
sends `[b"", start_seq]` (8 bytes, big-endian) and receives `[b"", seq, payload]` for every
buffered batch from `start_seq` on, then `[b"", END_SEQ, b""]`, as vLLM's publisher does.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from ..core.log import get_logger
from .wire import ENCODINGS, encode_batch

_log = get_logger("events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number that ends a replay."""


def _zmq():
    try:
        import zmq
    except ImportError as err:  # pragma: no cover - the events extra installs it
        raise ImportError("ZmqPublisher needs pyzmq: pip install 'pagedkv[events]'") from err
    return zmq


@dataclass(frozen=True)
class PublisherStats:
    """Events taken from the engine, events and batches sent, events dropped because the
    queue was full, and the sequence number of the last batch sent (-1 before any)."""

    queued_events: int
    published_events: int
    published_batches: int
    dropped_events: int
    last_seq: int


class ZmqPublisher:
    """Publishes the events it is called with to `endpoint` (a PUB socket: bound when the
    address has a `*`, `::`, or is ipc:// / inproc://, else connected, as vLLM does) under
    `topic`. `max_queue` bounds the events waiting for the thread; `buffer_steps` the
    batches kept for replay. `encoding` is how events are written: "array" (tagged arrays,
    vLLM up to 0.25) or "map" (named fields, vLLM from 0.26); see `pagedkv.events.wire`.
    `close()` sends what is queued, then closes the sockets."""

    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str | None = None, *,
                 max_queue: int = 100_000, max_batch: int = 1024, buffer_steps: int = 10_000, hwm: int = 100_000,
                 data_parallel_rank: int | None = None, linger_ms: int = 1000, encoding: str = "array"):
        zmq = _zmq()
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
        self._encoding = encoding
        for name, value in (("max_queue", max_queue), ("max_batch", max_batch), ("buffer_steps", buffer_steps),
                            ("hwm", hwm)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._max_queue, self._max_batch, self._linger = max_queue, max_batch, linger_ms
        self._queue: collections.deque = collections.deque()
        self._buffer: collections.deque = collections.deque(maxlen=buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(hwm)
            self._open(self._pub, endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except BaseException:
            self._close_sockets(0)
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._queued = self._published = self._batches = self._dropped = 0
        self._seq = -1
        self._dropping = False
        self._sleeping = False
        self._wake = threading.Event()
        self._running = True
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(sock, endpoint: str) -> None:
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)

    # -- the engine's side ----------------------------------------------------------------

    def __call__(self, event: object) -> None:
        """Queue `event` for publishing; never blocks. Dropped (and counted) when the
        queue holds `max_queue` events; RuntimeError after `close()`."""
        if self._closed:
            raise RuntimeError("ZmqPublisher is closed")
        queue = self._queue
        if len(queue) >= self._max_queue:
            self._dropped += 1
            if not self._dropping:
                self._dropping = True
                _log.warning("kv_events_dropped", queued=len(queue), max_queue=self._max_queue)
            return
        queue.append(event)
        self._queued += 1
        if self._sleeping:
            self._wake.set()

    def stats(self) -> PublisherStats:
        """The counters so far."""
        return PublisherStats(self._queued, self._published, self._batches, self._dropped, self._seq)

    # -- the publisher's thread -----------------------------------------------------------

    def _run(self) -> None:
        zmq = _zmq()
        queue, wake = self._queue, self._wake
        poller = None
        if self._replay is not None:
            poller = zmq.Poller()
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if poller is not None and poller.poll(0):
                self._serve_replay()
            if queue:
                self._send(queue)
                continue
            if not self._running:
                break
            self._sleeping = True
            if not queue:
                wake.wait(0.01 if poller is not None else 0.1)
            self._sleeping = False
            wake.clear()

    def _send(self, queue: collections.deque) -> None:
        n = min(len(queue), self._max_batch)
        events = [queue.popleft() for _ in range(n)]
        self._dropping = False
        try:
            payload = encode_batch(time.time(), events, self._rank, self._encoding)
            seq = self._seq + 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except Exception as err:  # noqa: BLE001 - the thread must go on; the batch is lost and counted
            self._dropped += n
            _log.error("kv_events_publish_failed", events=n, error=str(err))
            return
        self._seq = seq
        self._buffer.append((seq, payload))
        self._published += n
        self._batches += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            _log.warning("kv_events_bad_replay_request", frames=len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    # -- closing --------------------------------------------------------------------------

    def close(self) -> None:
        """Send what is queued, stop the thread and close the sockets (each waits up to
        `linger_ms` for its peers). A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._running = False
        self._wake.set()
        self._thread.join()
        self._close_sockets(self._linger)
        if self._dropped:
            _log.warning("kv_events_dropped_total", dropped=self._dropped, published=self._published)

    def _close_sockets(self, linger: int) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=linger)

    def __enter__(self) -> "ZmqPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
