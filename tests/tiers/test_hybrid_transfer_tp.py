"""HybridKvTransfer between TP sizes and block layouts (TP 1 NHD -> 2 HND, 4 NHD -> 2 HND:
two senders into one receiving rank),
the grouping in the handshake, pull mode under a lease per group, grants per group. Every
cache is a HostBackend hybrid (full, sliding of another block size, state) with its agents
over UCX loopback in this process, made once for the module. Byte-exact: every receiving
rank ends with exactly its heads of the sender's K/V in the attention groups and the whole
state slot (replicated, sent by one rank)."""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.errors import RefCountError
from pagedkv.tiers.hybrid_transfer import HybridKvTransfer
from pagedkv.tiers.transfer import LayoutMismatch, LeaseExpired
from pagedkv.tiers.transfer_grants import GrantViolation

from shared_helpers import nixl_reason  # noqa: E402

NIXL_REASON = nixl_reason()

# one worker runs the whole module: its module-scoped fixture is built once (pyproject: --dist loadgroup)
pytestmark = [pytest.mark.skipif(NIXL_REASON is not None, reason=NIXL_REASON or ""),
              pytest.mark.xdist_group("hybrid_transfer_tp")]

WAIT = 20.0
HEADS = 4  # global KV heads
STATE = (((4,), "float32"), ((2, 3), "float16"))


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def config(rank, size, layout, window=8, state=STATE):
    return KvCacheConfig(4, HEADS // size, 16, 3, "bf16", layout=layout, tp_rank=rank, tp_size=size, layer_groups=(
        LayerGroup("full", (0,)),
        LayerGroup("sliding", (1,), window=window, block_size=2),
        LayerGroup("state", (2,), state=state),
    ))


class Rank:
    """One engine rank: a hybrid HostBackend cache and its HybridKvTransfer."""

    def __init__(self, name, rank, size, layout, clock, require_grants=False, **extra):
        self.gpu = HostBackend(1 << 24)
        self.cache = PagedKvCache(config(rank, size, layout, **extra), [8, 8, None], self.gpu, num_state_slots=6)
        self.transfer = HybridKvTransfer(self.cache, self.gpu, name, clock=clock, require_grants=require_grants)
        self.name = name

    def heads(self) -> slice:
        start, stop, _ = self.cache.group(0).config().head_range(0)
        return slice(start, stop)

    def held(self, counts=(3, 2, 1)):
        return {g: self.cache.group(g).alloc_blocks(n) for g, n in enumerate(counts)}

    def free(self, ids):
        for g, blocks in ids.items():
            self.cache.group(g).free_blocks(blocks)

    def close(self):
        self.transfer.close()
        self.cache.release(self.gpu)


@pytest.fixture(scope="module")
def world():
    send_clock, recv_clock = Clock(), Clock()
    specs = {"p1": (0, 1, "NHD", send_clock), "d2a": (0, 2, "HND", recv_clock), "d2b": (1, 2, "HND", recv_clock),
             "q4a": (0, 4, "NHD", send_clock), "q4b": (1, 4, "NHD", send_clock)}
    made = {}
    try:
        for name, spec in specs.items():
            made[name] = Rank(name, *spec)
        for sender, receivers in (("p1", ("d2a", "d2b")), ("q4a", ("d2a",)), ("q4b", ("d2a",))):
            for receiver in receivers:
                made[sender].transfer.connect(made[receiver].transfer.metadata())
                made[receiver].transfer.connect(made[sender].transfer.metadata())
        yield made, send_clock, recv_clock
    finally:
        for rank in made.values():
            rank.close()


def global_rows(seed, n):
    """Global K and V of layers 0 and 1 for `n` tokens each, and a state."""
    rng = np.random.default_rng(seed)
    kv = [rng.standard_normal((n, HEADS, 16)).astype(ml_dtypes.bfloat16).astype(np.float32) for _ in range(4)]
    return kv, (rng.standard_normal(4).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float16))


def token_slots(blocks, block_size):
    return np.concatenate([np.arange(b * block_size, (b + 1) * block_size) for b in blocks])


def fill(rank, ids, rows):
    """Write the rank's heads of `rows` into its blocks `ids[0]` (layer 0), `ids[1]` (layer
    1) and the state into slot `ids[2][0]`."""
    kv, state = rows
    for g, layer, size in ((0, 0, 4), (1, 1, 2)):
        slots = token_slots(ids[g], size)
        k, v = kv[2 * layer][: slots.size], kv[2 * layer + 1][: slots.size]
        rank.cache.write_tokens(layer, slots, k[:, rank.heads()], v[:, rank.heads()], rank.gpu, 0)
    for t, value in enumerate(state):
        rank.cache.write_state(2, ids[2][0], value, rank.gpu, tensor=t)


def poison(rank, ids):
    for g in (0, 1):
        rank.cache.group(g).poison_blocks(ids[g], rank.gpu, 0)
    rank.cache.group(2).poison_slots(ids[2], rank.gpu, 0)


def check(rank, ids, rows):
    """The rank's blocks hold exactly its heads of `rows`, its slot the whole state."""
    kv, state = rows
    for g, layer, size in ((0, 0, 4), (1, 1, 2)):
        slots = token_slots(ids[g], size)
        k, v = rank.cache.read_tokens(layer, slots, rank.gpu)
        assert np.array_equal(k, kv[2 * layer][: slots.size][:, rank.heads()]), (rank.name, layer)
        assert np.array_equal(v, kv[2 * layer + 1][: slots.size][:, rank.heads()]), (rank.name, layer)
    for t, value in enumerate(state):
        assert rank.cache.read_state(2, ids[2][0], rank.gpu, tensor=t).tobytes() == value.tobytes(), rank.name


def test_one_nhd_rank_splits_every_group_to_two_hnd_ranks(world):
    ranks, _, _ = world
    p1 = ranks["p1"]
    rows = global_rows(1, 12)
    src = p1.held()
    fill(p1, src, rows)
    for name in ("d2a", "d2b"):
        d = ranks[name]
        d.cache.group(0).alloc_blocks(1)  # other destination ids
        dst = d.held()
        poison(d, dst)
        assert p1.transfer.groups_to(name) == [0, 1, 2]  # rank 0 of 1 sends the state to both
        handle = p1.transfer.send(name, src, dst, b"req")
        handle.wait(WAIT)
        # HND receivers: one run per block pair and pool (2 sides), whatever the NHD source
        assert handle.handles[2].descriptors == 2  # the slot, whole, per state tensor
        assert d.transfer.wait_notifications(WAIT) == [("p1", b"req")]
        check(d, dst, rows)
        d.free(dst)
        d.cache.group(0).free_blocks([0])
    p1.free(src)


def test_two_of_four_nhd_ranks_gather_into_one_of_two_and_one_rank_sends_the_state(world):
    ranks, _, _ = world
    rows = global_rows(2, 12)
    d = ranks["d2a"]  # heads [0, 2): from q4a (head 0) and q4b (head 1); rank 1 of 2 mirrors it
    first, second = ranks["q4a"], ranks["q4b"]
    srcs = [first.held(), second.held()]
    fill(first, srcs[0], rows)
    fill(second, srcs[1], rows)
    dst = d.held()
    poison(d, dst)
    assert first.transfer.groups_to("d2a") == [0, 1, 2] and second.transfer.groups_to("d2a") == [0, 1]
    assert d.transfer.groups_from("q4a") == [0, 1, 2] and d.transfer.groups_from("q4b") == [0, 1]
    before = d.cache.read_state(2, dst[2][0], d.gpu).tobytes()
    with pytest.raises(ValueError, match=r"^group 2: state slots are replicated across TP ranks and TP rank 0 of 2 "
                                         r"takes them from TP rank 0 of 4, not rank 1 \(this cache\): nothing to "
                                         r"move$"):
        second.transfer.send("d2a", srcs[1], dst)
    assert d.transfer.notifications() == []  # no group posted
    assert d.cache.read_state(2, dst[2][0], d.gpu).tobytes() == before
    first.transfer.send("d2a", srcs[0], dst, b"a").wait(WAIT)
    second.transfer.send("d2a", {0: srcs[1][0], 1: srcs[1][1]}, {0: dst[0], 1: dst[1]}, b"b").wait(WAIT)
    got = []
    while len(got) < 2:
        got += d.transfer.wait_notifications(WAIT)
    assert sorted(got) == [("q4a", b"a"), ("q4b", b"b")]
    check(d, dst, rows)  # the receiving rank's two heads, from two senders, and the state from one
    d.free(dst)
    first.free(srcs[0])
    second.free(srcs[1])


def test_the_handshake_refuses_another_grouping_naming_the_field(world):
    ranks, send_clock, _ = world
    d2a = ranks["d2a"]
    other = Rank("odd", 0, 1, "NHD", send_clock, window=16, state=(((5,), "float32"), ((2, 3), "float16")))
    try:
        with pytest.raises(LayoutMismatch, match=r"^peer 'odd' groups its layers otherwise: group 1 window: "
                                                 r"here 8, peer 16; group 2 state\[0\] shape: here \[4\], peer \[5\] "
                                                 r"\(TP size here 2, peer 1: pagedkv does not split a state tensor by "
                                                 r"head, so every rank must hold the whole state\)$"):
            d2a.transfer.connect(other.transfer.metadata())
        assert d2a.transfer.peers() == ["p1", "q4a", "q4b"]
        assert all(d2a.transfer.group(g).peers() == ["p1#g%d" % g, "q4a#g%d" % g, "q4b#g%d" % g] for g in range(3))
    finally:
        other.close()


def test_a_pull_reads_every_group_and_completion_frees_the_senders_blocks_and_slots(world):
    ranks, _, _ = world
    p1 = ranks["p1"]
    rows = global_rows(3, 12)
    src = p1.held()
    fill(p1, src, rows)
    tickets = {name: p1.transfer.export(src, ttl=30) for name in ("d2a", "d2b")}
    p1.free(src)  # the leases hold them now
    assert [p1.cache.group(g).ref_count(src[g][0]) for g in range(3)] == [2, 2, 2]
    for name, ticket in tickets.items():
        d = ranks[name]
        dst = d.held()
        poison(d, dst)
        d.transfer.pull("p1", ticket, dst, b"pulled").wait(WAIT)
        check(d, dst, rows)
        d.free(dst)
    got = []
    deadline = time.monotonic() + WAIT
    while (len(got) < 2 or any(p1.transfer.open_leases().values())) and time.monotonic() < deadline:
        got += p1.transfer.notifications()
        time.sleep(0.001)
    assert sorted(got) == [("d2a", b"pulled"), ("d2b", b"pulled")]  # once per pull, every group read
    assert all(p1.cache.group(g).ref_count(b) == 0 for g in range(3) for b in src[g])


def test_an_expired_lease_frees_every_group_and_a_late_read_fails_cleanly(world):
    ranks, send_clock, recv_clock = world
    p1, d2a = ranks["p1"], ranks["d2a"]
    src = p1.held()
    fill(p1, src, global_rows(4, 12))
    ticket = p1.transfer.export(src, ttl=5)
    p1.free(src)
    free_before = [p1.cache.num_free_blocks(g) for g in range(3)]
    send_clock.now += 6
    assert p1.transfer.expire_leases() == 3
    assert [p1.cache.num_free_blocks(g) for g in range(3)] == [n + len(src[g]) for g, n in enumerate(free_before)]
    dst = d2a.held()
    poison(d2a, dst)
    recv_clock.now = send_clock.now
    with pytest.raises(LeaseExpired, match=r"^group 0: lease \d+ of peer 'p1#g0' expired at 1005.000"):
        d2a.transfer.pull("p1", ticket, dst)
    assert d2a.cache.read_state(2, dst[2][0], d2a.gpu).view(np.uint8).tolist() == [0xFF] * 16  # nothing read
    # the receiver's clock lags: its read starts after the sender released the leases
    src = p1.held()
    ticket = p1.transfer.export(src, ttl=1)
    p1.free(src)
    send_clock.now += 2
    p1.transfer.expire_leases()
    recv_clock.now = send_clock.now - 2
    handle = d2a.transfer.pull("p1", ticket, dst)
    with pytest.raises(LeaseExpired, match="was released before the read of"):
        handle.wait(WAIT)
    d2a.free(dst)
    send_clock.now = recv_clock.now = 1000.0


def test_export_and_pull_refusals_hold_nothing(world):
    ranks, _, _ = world
    p1, d2a, q4b = ranks["p1"], ranks["d2a"], ranks["q4b"]
    src = p1.held()
    with pytest.raises(TypeError, match=r"blocks must be a mapping \{group: \[block or slot ids\]\}, got list"):
        p1.transfer.export(src[0], ttl=10)
    with pytest.raises(IndexError, match="group"):
        p1.transfer.export({7: src[0]}, ttl=10)
    with pytest.raises(ValueError, match=r"^group 0: ttl must be a number of seconds > 0"):
        p1.transfer.export(src, ttl=0)
    with pytest.raises(ValueError, match=r"^group 2: block 5 is free"):
        p1.transfer.export({0: src[0], 2: [5]}, ttl=10)
    assert p1.transfer.open_leases() == {0: {}, 1: {}, 2: {}}  # group 0's lease was undone
    assert p1.cache.group(0).ref_count(src[0][0]) == 1
    ticket = p1.transfer.export({0: src[0], 2: src[2]}, ttl=10)
    dst = d2a.held()
    with pytest.raises(ValueError, match=r"the ticket holds groups \[0, 2\] but dst names \[0\]"):
        d2a.transfer.pull("p1", ticket, {0: dst[0]})
    with pytest.raises(ValueError, match="the ticket is from 'p1', not peer 'q4b'"):
        d2a.transfer.pull("q4b", ticket, {0: dst[0], 2: dst[2]})
    with pytest.raises(ValueError, match=r"^group 2: the ticket holds 1 blocks but dst_blocks has 2"):
        d2a.transfer.pull("p1", ticket, {0: dst[0], 2: dst[2] * 2})
    with pytest.raises(ValueError, match="is not a HybridKvTransfer.export"):
        d2a.transfer.pull("p1", b"nope", {0: dst[0]})
    q_ticket = q4b.transfer.export({2: q4b.held((0, 0, 1))[2]}, ttl=10)
    with pytest.raises(ValueError, match=r"^group 2: state slots are replicated .* not rank 1 \(peer 'q4b#g2'\)"):
        d2a.transfer.pull("q4b", q_ticket, {2: dst[2]})
    for rank in (p1, q4b):
        for g, part in enumerate(rank.transfer._parts):
            for lease in list(part.open_leases()):
                part._release_lease(lease, "test")
    p1.free(src)
    d2a.free(dst)
    q4b.cache.group(2).free_blocks(list(range(q4b.cache.num_blocks(2) - q4b.cache.num_free_blocks(2))))


def test_grants_per_group_refused_outside_and_checked_on_arrival(world):
    ranks, _, _ = world
    p1, d2a = ranks["p1"], ranks["d2a"]
    rows = global_rows(5, 12)
    src = p1.held()
    fill(p1, src, rows)
    dst = d2a.held()
    with pytest.raises(ValueError, match=r"without '#'\), got 'p1#g0'"):
        d2a.transfer.grant("p1#g0", dst)
    with pytest.raises(TypeError, match="blocks must be a mapping"):
        d2a.transfer.grant("p1", dst[0])
    ticket = d2a.transfer.grant("p1", dst)
    assert [d2a.cache.group(g).ref_count(dst[g][0]) for g in range(3)] == [2, 2, 2]
    outside = {**dst, 2: [5]}
    with pytest.raises(ValueError, match=r"^group 2: destination block 5 is not in peer 'd2a#g2''s grant"):
        p1.transfer.send("d2a", src, outside, grant=ticket)
    with pytest.raises(ValueError, match=r"the grant covers groups \[0, 1, 2\] but the send names groups \[0\]"):
        p1.transfer.send("d2a", {0: src[0]}, {0: dst[0]}, grant=ticket)
    with pytest.raises(ValueError, match="the grant is 'd2a''s for 'p1', not peer 'd2b''s for 'p1'"):
        p1.transfer.send("d2b", src, dst, grant=ticket)
    assert d2a.transfer.notifications() == []
    p1.transfer.send("d2a", src, dst, b"granted", grant=ticket).wait(WAIT)
    assert d2a.transfer.wait_notifications(WAIT) == [("p1", b"granted")]
    assert d2a.transfer.open_grants() == {0: {}, 1: {}, 2: {}}  # every group's part closed on arrival
    assert [d2a.cache.group(g).ref_count(dst[g][0]) for g in range(3)] == [1, 1, 1]
    check(d2a, dst, rows)
    # a grant revoked before its send's notifications are read: each group's arrival is a violation
    ticket = d2a.transfer.grant("p1", {0: dst[0]})
    with pytest.raises(RefCountError, match=r"^group 1: write into free block 7 \(count 0\)"):
        d2a.transfer.grant("p1", {0: dst[0], 1: [7]})
    assert len(d2a.transfer.open_grants()[0]) == 1  # the refused grant undid its group 0 part
    p1.transfer.send("d2a", {0: src[0]}, {0: dst[0]}, b"late", grant=ticket).wait(WAIT)
    assert d2a.transfer.revoke(ticket) and not d2a.transfer.revoke(ticket)
    with pytest.raises(GrantViolation, match=r"group 0: peer 'p1#g0' notified a transfer under grant \d+, which is "
                                             r"no open grant"):
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            d2a.transfer.notifications()
            time.sleep(0.001)
    assert d2a.transfer.notifications() == []
    p1.free(src)
    d2a.free(dst)


def test_a_receiver_requiring_grants_is_refused_a_send_without_one(world):
    ranks, send_clock, _ = world
    p1 = ranks["p1"]
    strict = Rank("strict", 0, 1, "HND", send_clock, require_grants=True)
    try:
        p1.transfer.connect(strict.transfer.metadata())
        strict.transfer.connect(p1.transfer.metadata())
        src, dst = p1.held((1, 0, 1)), strict.held((1, 0, 1))
        src, dst = {0: src[0], 2: src[2]}, {0: dst[0], 2: dst[2]}
        with pytest.raises(ValueError, match=r"^group 0: peer 'strict#g0' requires a grant for every send"):
            p1.transfer.send("strict", src, dst)
        p1.transfer.send("strict", src, dst, b"ok", grant=strict.transfer.grant("p1", dst)).wait(WAIT)
        assert strict.transfer.wait_notifications(WAIT) == [("p1", b"ok")]
        p1.free(src)
        strict.free(dst)
        p1.transfer.disconnect("strict")
    finally:
        strict.close()


def test_the_readme_hybrid_tp_example_runs():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Hybrid caches between engines"):readme.index("## Storage formats and codecs")]
    (example,) = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["sender"].group(0).closed() and namespace["gpu_p"].live_allocations() == 0
