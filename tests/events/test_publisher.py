"""ZmqPublisher and the wire format: the batch bytes, a subscriber in a second process that
sees 100k events in order with a lost range recovered through replay, and an engine that
never blocks when nothing reads (bounded queue, drops counted and reported)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from structlog.testing import capture_logs

zmq = pytest.importorskip("zmq", reason="pyzmq is not installed (the events extra)")
msgpack = pytest.importorskip("msgpack", reason="msgpack is not installed (the events extra)")

from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, HostBackend, KvCacheConfig, PagedKvCache, PrefixCache  # noqa: E402
from pagedkv.events import ZmqPublisher, decode_batch, encode_batch  # noqa: E402

SUBSCRIBER = Path(__file__).with_name("subscriber.py")


def test_a_batch_is_vllms_array_like_kv_event_batch():
    stored = BlockStored(block_hashes=(7, 2**64 - 1), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_ids=(0, 1),
                         block_size=2, adapter_id=0, medium="GPU")
    removed = BlockRemoved(block_hashes=(b"\x01" * 32,), block_ids=(3,), medium="CPU")
    payload = encode_batch(1.5, [stored, removed, AllBlocksCleared()])
    # [ts, events]: fixarray(2), float64 1.5, fixarray(3) ...; the rank (None) is omitted
    assert payload[:11] == b"\x92\xcb" + struct.pack(">d", 1.5) + b"\x93"
    assert payload[11:24] == b"\x98\xabBlockStored"  # a tagged array of the 7 fields without a default
    assert msgpack.unpackb(payload) == [1.5, [
        ["BlockStored", [7, 2**64 - 1], None, [1, 2, 3, 4], 2, None, "GPU", None],  # ... lora_name None last
        ["BlockRemoved", [b"\x01" * 32], "CPU"],
        ["AllBlocksCleared"],
    ]]
    assert decode_batch(encode_batch(2.0, [], data_parallel_rank=3)) == (2.0, [], 3)
    adapter = BlockStored(block_hashes=(1,), parent_block_hash=5, token_ids=(9, 9), block_ids=(0,), block_size=2,
                          adapter_id=4)
    assert decode_batch(encode_batch(0.0, [adapter]))[1][0][2:6] == [5, [9, 9], 2, 4]


def test_a_subscriber_process_sees_100k_events_in_order_and_recovers_a_lost_range_by_replay():
    n = 100_000
    pub = ZmqPublisher("tcp://127.0.0.1:*", topic="kv", replay_endpoint="tcp://127.0.0.1:*", max_batch=1000)
    proc = subprocess.Popen([sys.executable, str(SUBSCRIBER), pub.endpoint, pub.replay_endpoint, "kv", str(n), "5", "9"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for i in range(n):
            pub(BlockRemoved(block_hashes=(i,), block_ids=(i % 64,)))
        out, _ = proc.communicate(timeout=60)
    finally:
        pub.close()
        if proc.poll() is None:
            proc.kill()
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["events"] == n and seen["in_order"] and seen["seqs_contiguous"]
    assert seen["replayed"] >= 5  # batches 5..9 were lost on the SUB socket and came back by replay
    stats = pub.stats()
    assert stats.published_events == stats.queued_events == n and stats.dropped_events == 0
    assert stats.last_seq == stats.published_batches - 1


def test_with_nothing_reading_the_engine_never_blocks_and_drops_are_counted(monkeypatch):
    import pagedkv.events.zmq_publisher as zp

    stall, stalled = threading.Event(), threading.Event()
    real = zp.encode_batch

    def slow_encode(*args):
        stalled.set()
        stall.wait(10)
        return real(*args)

    monkeypatch.setattr(zp, "encode_batch", slow_encode)
    pub = ZmqPublisher("tcp://127.0.0.1:*", max_queue=100, max_batch=10)
    pub(AllBlocksCleared())
    assert stalled.wait(10)  # the thread is stuck sending its first batch: nothing drains the queue
    with capture_logs() as logs:
        for _ in range(1000):
            pub(AllBlocksCleared())  # returns at once, queue full or not
    stats = pub.stats()
    assert stats.queued_events == 1 + 100 and stats.dropped_events == 900
    assert [e["event"] for e in logs] == ["kv_events_dropped"]  # once per run of drops
    stall.set()
    pub.close()
    assert pub.stats().published_events == 101
    with pytest.raises(RuntimeError, match="closed"):
        pub(AllBlocksCleared())


def test_a_prefix_cache_publishes_through_it():
    gpu = HostBackend(1 << 26)
    cache = PagedKvCache(KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16"), 4, gpu)
    ctx = zmq.Context.instance()
    with ZmqPublisher("inproc://kv-test", topic="t") as pub:
        sub = ctx.socket(zmq.SUB)
        sub.connect("inproc://kv-test")
        sub.setsockopt_string(zmq.SUBSCRIBE, "")
        prefix = PrefixCache(cache, on_event=pub)
        for attempt in range(50):  # until the subscription has reached the publisher
            blocks = cache.alloc_blocks(1)
            prefix.insert(list(range(attempt * 4, attempt * 4 + 4)), blocks)
            cache.free_blocks(blocks)
            if sub.poll(100):
                break
        topic, seq, payload = sub.recv_multipart()
        ts, events, rank = decode_batch(payload)
        assert topic == b"t" and events[0][0] in ("BlockStored", "BlockRemoved") and rank is None
        prefix.close()
        sub.close()
    cache.release(gpu)
