"""KV-event publisher throughput: ZmqPublisher feeding a subscriber in another process over
TCP loopback, in vLLM's wire format.

The engine thread calls the publisher with 200,000 BlockStored events (one block of 16
token ids each, as a decode step's new blocks are); a subscriber process decodes every batch
and reports when it has the last event. Printed, with floors from the issue: events per
second delivered (first call to the subscriber holding the last event, >= 300k/s) and the
engine thread's time per event (its CPU time over the loop, <= 2 us; the wall time beside
it includes waiting for the publisher thread on the GIL).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from floors import ceiling, floor

N = 200_000

SUBSCRIBER = textwrap.dedent(
    """
    import sys, time, msgpack, zmq
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(sys.argv[1])
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    time.sleep(0.3)
    print("ready", flush=True)
    n, want, last = 0, int(sys.argv[2]), -1
    while n < want:
        topic, seq, payload = sub.recv_multipart()
        seq = int.from_bytes(seq, "big")
        assert seq == last + 1, (seq, last)
        last = seq
        n += len(msgpack.unpackb(payload, use_list=False)[1])
    print(time.time(), n, flush=True)
    """
)


def run(args) -> None:
    try:
        from pagedkv import BlockStored
        from pagedkv.events import ZmqPublisher
    except ImportError as err:  # pragma: no cover
        print(f"  skipped: {err}")
        return
    n = 20_000 if args.quick else N
    pub = ZmqPublisher("tcp://127.0.0.1:*", max_queue=n + 1, max_batch=1024)
    proc = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, pub.endpoint, str(n)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        events = [BlockStored(block_hashes=(i,), parent_block_hash=i - 1, token_ids=tuple(range(i, i + 16)),
                              block_ids=(i % 4096,), block_size=16, adapter_id=0) for i in range(n)]
        cpu0, wall0 = time.thread_time(), time.time()
        for event in events:
            pub(event)
        cpu, wall = time.thread_time() - cpu0, time.time() - wall0
        done, got = proc.stdout.readline().split()
        proc.wait(timeout=30)
    finally:
        pub.close()
        if proc.poll() is None:
            proc.kill()
    delivered = int(got) / (float(done) - wall0)
    stats = pub.stats()
    print(f"  {n} events, {stats.published_batches} batches, {stats.dropped_events} dropped")
    print(f"  engine thread: {1e6 * cpu / n:.2f} us CPU, {1e6 * wall / n:.2f} us wall per event")
    floor("events delivered to a subscriber, k/s", delivered / 1e3, 300.0)
    ceiling("engine-thread CPU us per event", 1e6 * cpu / n, 2.0)
