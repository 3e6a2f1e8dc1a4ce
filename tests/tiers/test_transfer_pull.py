"""Pull mode: a sender exports blocks under a lease, a receiver reads them when it is ready;
completion frees the sender's blocks, an expired lease frees them too and a late read fails
cleanly (LeaseExpired), a receiver that dies mid-read leaves nothing held once the lease
expires. In-process agents over UCX loopback, and one receiver in its own process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache
from pagedkv.tiers.leases import LEASE_SLOTS, parse_ticket
from pagedkv.tiers.transfer import KvTransfer, LeaseExpired, TransferError

from shared_helpers import nixl_reason  # noqa: E402

NIXL_REASON = nixl_reason()

# one worker runs the whole module: its module-scoped fixture is built once (pyproject: --dist loadgroup)
pytestmark = [pytest.mark.skipif(NIXL_REASON is not None, reason=NIXL_REASON or ""), pytest.mark.xdist_group("transfer_pull")]

WAIT = 20.0
BASE = dict(block_size=4, head_dim=32, num_layers=2, dtype="turbo4", layout="HND")


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class LiveClock:
    """The real wall clock, plus what the test skips ahead."""

    def __init__(self):
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.time() + self.skipped


def side(name, clock, tp_rank=0, tp_size=1, blocks=8):
    gpu = HostBackend(1 << 24)
    config = KvCacheConfig(**BASE, num_kv_heads=4 // tp_size, tp_rank=tp_rank, tp_size=tp_size)
    cache = PagedKvCache(config, blocks, gpu)
    return gpu, cache, KvTransfer(cache, gpu, name, clock=clock)


@pytest.fixture(scope="module")
def trio():
    sender_clock, receiver_clock = Clock(), Clock()
    made = [side("pull-p", sender_clock), side("pull-d0", receiver_clock, 0, 2), side("pull-d1", receiver_clock, 1, 2)]
    for a in made:
        for b in made:
            if a is not b:
                a[2].connect(b[2].metadata())
    yield made, sender_clock, receiver_clock
    for gpu, cache, transfer in made:
        transfer.close()
        cache.release(gpu)


def filled(gpu, cache, seed):
    blocks = cache.alloc_blocks(3)
    rng = np.random.default_rng(seed)
    for layer in range(2):
        k = rng.standard_normal((12, 4, 32)).astype(np.float32)
        cache.write_tokens(layer, np.arange(blocks[0] * 4, blocks[0] * 4 + 4).tolist() +
                           np.arange(blocks[1] * 4, blocks[1] * 4 + 4).tolist() +
                           np.arange(blocks[2] * 4, blocks[2] * 4 + 4).tolist(), k, k, gpu, 0)
    return blocks


def slots_of(blocks):
    return np.concatenate([np.arange(b * 4, b * 4 + 4) for b in blocks])


def test_a_pull_splits_by_head_and_completion_frees_the_senders_blocks(trio):
    (p, d0, d1), sender_clock, receiver_clock = trio
    blocks = filled(p[0], p[1], 1)
    tickets = [p[2].export(blocks, ttl=30) for _ in range(2)]  # one lease per receiving rank
    p[1].free_blocks(blocks)  # the leases hold the blocks now
    assert [p[1].ref_count(b) for b in blocks] == [2, 2, 2]
    want_k = p[1].read_tokens(0, slots_of(blocks), p[0])[0]
    for (gpu, cache, transfer), ticket, heads in ((d0, tickets[0], slice(0, 2)), (d1, tickets[1], slice(2, 4))):
        dst = cache.alloc_blocks(3)
        handle = transfer.pull("pull-p", ticket, dst[::-1], notify=b"got it")
        assert handle.descriptors == 4 * 3  # 2 layers x 2 sides x 3 blocks: a head range is one run
        handle.wait(WAIT)
        assert np.array_equal(cache.read_tokens(0, slots_of(dst[::-1]), gpu)[0], want_k[:, heads])
        cache.free_blocks(dst)
    got = []
    deadline = time.monotonic() + WAIT
    while (p[2].open_leases() or len(got) < 2) and time.monotonic() < deadline:
        got += p[2].notifications()  # the completions free the blocks; only the user's messages come back
        time.sleep(0.001)
    assert sorted(got) == [("pull-d0", b"got it"), ("pull-d1", b"got it")]
    assert not p[2].open_leases() and [p[1].ref_count(b) for b in blocks] == [0, 0, 0]


def test_an_expired_lease_frees_the_blocks_and_a_pull_after_it_reads_nothing(trio):
    (p, d0, _), sender_clock, receiver_clock = trio
    blocks = filled(p[0], p[1], 2)
    ticket = p[2].export(blocks, ttl=5)
    p[1].free_blocks(blocks)
    assert parse_ticket(ticket)["deadline"] == sender_clock.now + 5
    sender_clock.now += 4.9
    assert p[2].expire_leases() == 0 and p[1].ref_count(blocks[0]) == 1
    sender_clock.now += 0.2
    assert p[2].expire_leases() == 1 and [p[1].ref_count(b) for b in blocks] == [0, 0, 0]
    receiver_clock.now = sender_clock.now
    gpu, cache, transfer = d0
    dst = cache.alloc_blocks(3)
    cache.fill_blocks(dst, 0x5A, gpu, 0)
    with pytest.raises(LeaseExpired, match=r"lease \d+ of peer 'pull-p' expired at 1005.000 \(now 1005.\d+\): "
                                           r"nothing was read"):
        transfer.pull("pull-p", ticket, dst)
    assert all((cache.read_block(0, b, gpu)[0] == 0x5A).all() for b in dst)
    cache.free_blocks(dst)
    sender_clock.now = receiver_clock.now = 1000.0


def test_a_late_read_fails_cleanly_on_the_lease_word(trio):
    # the receiver's clock lags: it starts reading after the sender released the lease
    (p, d0, _), sender_clock, receiver_clock = trio
    blocks = filled(p[0], p[1], 3)
    ticket = p[2].export(blocks, ttl=1)
    p[1].free_blocks(blocks)
    sender_clock.now += 2
    p[2].expire_leases()
    gpu, cache, transfer = d0
    dst = cache.alloc_blocks(3)
    handle = transfer.pull("pull-p", ticket, dst)
    with pytest.raises(LeaseExpired, match=r"lease \d+ of peer 'pull-p' was released before the read of 3 blocks "
                                           r"finished .*: the destination blocks hold undefined bytes"):
        handle.wait(WAIT)
    assert transfer._leases.words[LEASE_SLOTS:].sum() == 0  # the scratch word went back
    cache.free_blocks(dst)
    sender_clock.now = receiver_clock.now = 1000.0


def test_a_pull_with_no_scratch_word_free_posts_no_read(trio, monkeypatch):
    # every lease-check word in use: refused before the read is posted; a refused post gives the word back
    (p, d0, _), _, _ = trio
    gpu, cache, transfer = d0
    blocks = filled(p[0], p[1], 4)
    ticket = p[2].export(blocks, ttl=5)
    p[1].free_blocks(blocks)
    dst = cache.alloc_blocks(3)
    leases, posted = transfer._leases, []
    real_post = transfer._post_read
    monkeypatch.setattr(transfer, "_post_read", lambda *args: posted.append(args) or real_post(*args))
    taken = [leases.take_scratch() for _ in range(len(leases._free_scratch))]
    with pytest.raises(TransferError, match=f"{LEASE_SLOTS} pulls are already in flight"):
        transfer.pull("pull-p", ticket, dst)
    assert posted == []
    for index in taken:
        leases.give_scratch(index)
    free = len(leases._free_scratch)

    def refused(*args):
        raise TransferError("refused by the test")

    monkeypatch.setattr(transfer, "_post_read", refused)
    with pytest.raises(TransferError, match="refused by the test"):
        transfer.pull("pull-p", ticket, dst)
    assert len(leases._free_scratch) == free
    monkeypatch.setattr(transfer, "_post_read", real_post)
    transfer.pull("pull-p", ticket, dst).wait(WAIT)  # the lease still open: the read goes through
    assert len(leases._free_scratch) == free
    deadline = time.monotonic() + WAIT
    while p[2].open_leases() and time.monotonic() < deadline:
        p[2].notifications()  # the completion frees the sender's blocks
    assert not p[2].open_leases() and [p[1].ref_count(b) for b in blocks] == [0, 0, 0]
    cache.free_blocks(dst)


def test_export_and_pull_refusals_change_nothing(trio):
    (p, d0, _), _, _ = trio
    gpu, cache, transfer = d0
    blocks = p[1].alloc_blocks(2)
    with pytest.raises(ValueError, match="ttl must be a number of seconds > 0, got 0"):
        p[2].export(blocks, ttl=0)
    with pytest.raises(ValueError, match="block 7 is free"):
        p[2].export([blocks[0], 7], ttl=1)
    with pytest.raises(ValueError, match="lists a block twice"):
        p[2].export([blocks[0], blocks[0]], ttl=1)
    assert [p[1].ref_count(b) for b in blocks] == [1, 1] and not p[2].open_leases()
    ticket = p[2].export(blocks, ttl=30)
    with pytest.raises(ValueError, match="the ticket is from 'pull-p', not peer 'pull-d1'"):
        transfer.pull("pull-d1", ticket, [0, 1])
    with pytest.raises(ValueError, match="the ticket holds 2 blocks but dst_blocks has 1"):
        transfer.pull("pull-p", ticket, [0])
    with pytest.raises(ValueError, match="destination block 0 is free"):
        transfer.pull("pull-p", ticket, [0, 1])
    with pytest.raises(ValueError, match="ticket is not a KvTransfer export ticket"):
        transfer.pull("pull-p", b"nope", [0, 1])
    lease = next(iter(p[2].open_leases()))
    p[2]._release_lease(lease, "test")
    p[1].free_blocks(blocks)
    assert [p[1].ref_count(b) for b in blocks] == [0, 0]


def puller_main(conn, sender_md: bytes) -> None:
    gpu = HostBackend(1 << 24)
    cache = PagedKvCache(KvCacheConfig(**BIG), 128, gpu)
    transfer = KvTransfer(cache, gpu, "dying-puller")
    transfer.connect(sender_md)
    conn.send(transfer.metadata())
    ticket = conn.recv()
    transfer.pull("big-sender", ticket, cache.alloc_blocks(128))
    conn.send("posted")
    conn.recv()  # killed while waiting here


BIG = dict(block_size=16, num_kv_heads=8, head_dim=128, num_layers=1, dtype="bf16", layout="HND")


def test_a_receiver_that_dies_mid_read_leaves_the_blocks_to_the_lease():
    clock = LiveClock()  # the puller reads the real clock
    gpu = HostBackend(1 << 24)
    cache = PagedKvCache(KvCacheConfig(**BIG), 128, gpu)
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    with KvTransfer(cache, gpu, "big-sender", clock=clock) as transfer:
        proc = ctx.Process(target=puller_main, args=(child, transfer.metadata()), daemon=True)
        proc.start()
        try:
            assert conn.poll(WAIT + 10)
            transfer.connect(conn.recv())
            blocks = cache.alloc_blocks(128)
            conn.send(transfer.export(blocks, ttl=10))
            cache.free_blocks(blocks)
            assert conn.poll(WAIT + 10) and conn.recv() == "posted"
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(WAIT)
            assert transfer.notifications() == [] and cache.num_free_blocks() == 0
            clock.skipped += 10
            assert transfer.notifications() == [] and cache.num_free_blocks() == 128
            assert transfer.open_leases() == {}
        finally:
            if proc.is_alive():
                proc.kill()
    cache.release(gpu)


def test_the_readme_tp_example_runs():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    (example,) = [b for b in re.findall(r"```py\n(.*?)```", readme, flags=re.S) if "tp_size" in b and "HybridKvTransfer" not in b]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["sender"].closed() and all(r.closed() for r in namespace["receivers"])
    assert namespace["gpu_p"].live_allocations() == 0
