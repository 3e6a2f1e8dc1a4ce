"""HybridKvTransfer over NIXL (UCX on loopback, two HostBackend caches in this process): every
group's blocks and state slots arrive byte for byte under other ids, one notification per
send once all its groups landed; a peer of another layout and a refused group send nothing.
Skipped, with the reason, without NIXL."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, KvCacheError, PagedKvCache
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.tiers.hybrid_transfer import HybridKvTransfer
from pagedkv.tiers.transfer import KvTransfer, LayoutMismatch, UnknownPeer

from shared_helpers import nixl_reason  # noqa: E402

NIXL_REASON = nixl_reason()

pytestmark = pytest.mark.skipif(NIXL_REASON is not None, reason=NIXL_REASON or "")
WAIT = 20.0


def config(state_shape=(4,)):
    return KvCacheConfig(4, 1, 16, 3, "bf16", layer_groups=(
        LayerGroup("full", (0,)),
        LayerGroup("sliding", (1,), window=8, block_size=2),
        LayerGroup("state", (2,), state=((state_shape, "float32"), ((2, 3), "float16"))),
    ))


def make(state_shape=(4,)):
    gpu = HostBackend(1 << 26)
    return gpu, PagedKvCache(config(state_shape), [8, 8, None], gpu, num_state_slots=6)


def contents(cache, gpu, ids):
    """Bytes of the listed blocks of groups 0 and 1 and slots of group 2, in order."""
    out = []
    for g in (0, 1):
        out += [b"".join(x.tobytes() for x in cache.group(g).read_block(0, b, gpu)) for b in ids[g]]
    out += [cache.read_state(2, s, gpu, tensor=t).tobytes() for s in ids[2] for t in (0, 1)]
    return out


def fill(cache, gpu, ids, seed):
    rng = np.random.default_rng(seed)
    for g in (0, 1):
        group = cache.group(g)
        for b in ids[g]:
            n = group.k_block_stride_bytes_for_layer(0)
            group.write_block(0, b, rng.integers(0, 256, n, np.uint8), rng.integers(0, 256, n, np.uint8), gpu)
    for s in ids[2]:
        cache.write_state(2, s, rng.standard_normal(4), gpu)
        cache.write_state(2, s, rng.standard_normal((2, 3)), gpu, tensor=1)


def held(cache, counts):
    return {g: cache.group(g).alloc_blocks(n) for g, n in counts.items()}


def test_every_group_and_the_state_slots_arrive_under_other_ids():
    gpu_a, a = make()
    gpu_b, b = make()
    src = held(a, {0: 3, 1: 2, 2: 2})
    fill(a, gpu_a, src, 1)
    b.group(0).alloc_blocks(2)  # the receiver's own blocks: the destinations are other ids
    dst = held(b, {0: 3, 1: 2, 2: 2})
    for g in (0, 1):
        b.group(g).fill_blocks(dst[g], 0xA5, gpu_b, 0)
    with HybridKvTransfer(a, gpu_a, "prefill") as ta, HybridKvTransfer(b, gpu_b, "decode") as tb:
        assert ta.connect(tb.metadata()) == "decode" and tb.connect(ta.metadata()) == "prefill"
        assert [ta.group(g).name for g in range(3)] == ["prefill#g0", "prefill#g1", "prefill#g2"]
        handle = ta.send("decode", src, dst, b"req-7")
        handle.wait(WAIT)
        assert sorted(handle.handles) == [0, 1, 2]
        assert tb.wait_notifications(WAIT) == [("prefill", b"req-7")]  # one, once every group landed
        assert contents(b, gpu_b, dst) == contents(a, gpu_a, src)
        # sends of some groups: each message once, when all of its groups landed
        ta.send("decode", {2: src[2][:1]}, {2: dst[2][1:]}, b"one").wait(WAIT)
        ta.send("decode", {0: src[0][2:], 2: src[2]}, {0: dst[0][2:], 2: dst[2]}, b"two").wait(WAIT)
        got = []
        while len(got) < 2:
            got += tb.wait_notifications(WAIT)
        assert got == [("prefill", b"one"), ("prefill", b"two")]
        ta.send("decode", {1: src[1]}, {1: dst[1]}, b"three").wait(WAIT)
        assert tb.wait_notifications(WAIT) == [("prefill", b"three")]
        assert contents(b, gpu_b, dst) == contents(a, gpu_a, src)
    a.release(gpu_a)
    b.release(gpu_b)


def test_a_refused_group_sends_nothing_and_another_layout_is_refused_naming_the_group():
    gpu_a, a = make()
    gpu_b, b = make()
    gpu_c, c = make(state_shape=(5,))
    src = held(a, {0: 2, 2: 1})
    dst = held(b, {0: 2, 2: 1})
    b.group(0).fill_blocks(dst[0], 0xA5, gpu_b, 0)
    before = contents(b, gpu_b, {0: dst[0], 1: [], 2: []})
    with HybridKvTransfer(a, gpu_a, "p") as ta, HybridKvTransfer(b, gpu_b, "d") as tb, \
            HybridKvTransfer(c, gpu_c, "other") as tc:
        with pytest.raises(LayoutMismatch, match=r"^peer 'other' groups its layers otherwise: group 2 state\[0\] shape: "
                                                 r"here \[4\], peer \[5\]$"):
            ta.connect(tc.metadata())
        assert ta.peers() == [] and ta.group(0).peers() == []  # the groups that had connected were undone
        ta.connect(tb.metadata())
        with pytest.raises(IndexError, match="group 2: .*9"):
            ta.send("d", src, {0: dst[0], 2: [9]})
        with pytest.raises(ValueError, match="src names groups"):
            ta.send("d", {0: src[0]}, {2: dst[2]})
        with pytest.raises(UnknownPeer, match="unknown peer .nobody."):
            ta.send("nobody", src, dst)
        with pytest.raises(TypeError, match="use KvTransfer for a one-group cache"):
            HybridKvTransfer(PagedKvCache(KvCacheConfig(4, 1, 16, 1, "bf16"), 2, gpu_a), gpu_a, "x")
        assert tb.notifications() == []
        assert contents(b, gpu_b, {0: dst[0], 1: [], 2: []}) == before
    with pytest.raises(KvCacheError, match="use HybridKvTransfer"):
        KvTransfer(a, gpu_a, "flat")
    for cache, gpu in ((a, gpu_a), (b, gpu_b), (c, gpu_c)):
        cache.release(gpu)


def test_a_state_layout_that_contradicts_itself_is_named():
    from pagedkv.tiers.transfer_layout import layout_differences, layout_lies, state_layout_of

    gpu, cache = make()
    layout = state_layout_of(cache.group(2))
    assert [(r["layer"], r["tensor"], r["dtype"], r["shape"], r["nbytes"], r["stride"]) for r in layout["rows"]] == [
        (2, 0, "float32", [4], 16, 16), (2, 1, "float16", [2, 3], 12, 16)]
    assert layout_lies(layout) == []
    lying = dict(layout, rows=[dict(layout["rows"][0], nbytes=8)] + layout["rows"][1:])
    assert layout_lies(lying) == ["state row 0 of float32[4] says 8 bytes in slots of 16, but takes 16 "
                                  "(16-byte aligned slots)"]
    assert layout_differences(layout, lying) == ["state row 0 nbytes: here 16, peer 8"]
    cache.release(gpu)


def test_a_hostile_hybrid_header_is_a_bad_peer_metadata_naming_it():
    import json

    from pagedkv.tiers.hybrid_transfer import METADATA_MAGIC
    from pagedkv.tiers.transfer_metadata import BadPeerMetadata

    def blob(head, rest=b""):
        text = head if isinstance(head, bytes) else json.dumps(head).encode()
        return METADATA_MAGIC + len(text).to_bytes(8, "little") + text + rest

    gpu, cache = make()
    with HybridKvTransfer(cache, gpu, "me") as t:
        cases = [
            (blob(b"[" * (2 << 20)), "header, over the bound"),
            (blob(b"[" * 2000 + b"]" * 2000), "nests deeper"),
            (blob({"name": {"a": 1}, "sizes": [0, 0, 0]}), "field name must be a non-empty str"),
            (blob({"name": "x", "sizes": [5, -5]}), "field sizes must be a list of 1 to 64 ints >= 0"),
            (blob({"name": "x", "sizes": "3"}), "field sizes must be a list"),
            (blob({"name": "x", "sizes": [4]}, b"ab"), "truncated: its groups need 4 bytes, 2 follow"),
            (METADATA_MAGIC + (1 << 40).to_bytes(8, "little"), "header, over the bound"),
            (b"something else", "is not HybridKvTransfer metadata"),
        ]
        for bad, message in cases:
            with pytest.raises(BadPeerMetadata, match=message):
                t.connect(bad)
        assert t.peers() == [] and all(t.group(g).peers() == [] for g in range(3))
        for bad in (float("nan"), float("inf"), -1, True):  # NaN waited forever before
            with pytest.raises(ValueError, match="timeout must be a finite number of seconds"):
                t.wait_notifications(bad)
    cache.release(gpu)


def test_a_group_blob_of_another_agent_is_undone_by_its_own_name():
    (gpu_a, a), (gpu_b, b), (gpu_c, c) = make(), make(), make()
    with HybridKvTransfer(a, gpu_a, "a") as ta, HybridKvTransfer(b, gpu_b, "b") as tb, \
            HybridKvTransfer(c, gpu_c, "c") as tc:
        parts_b, parts_c = ta._parse(tb.metadata())[1], ta._parse(tc.metadata())[1]
        mixed = [parts_b[0], parts_c[1], parts_b[2]]  # group 1 names agent c#g1
        import json

        from pagedkv.tiers.hybrid_transfer import METADATA_MAGIC

        head = json.dumps({"name": "b", "sizes": [len(p) for p in mixed], "groups": ta._grouping}).encode()
        with pytest.raises(ValueError, match="peer 'b' group 1 metadata names agent 'c#g1'"):
            ta.connect(METADATA_MAGIC + len(head).to_bytes(8, "little") + head + b"".join(mixed))
        assert [ta.group(g).peers() for g in range(3)] == [[], [], []]  # every part undone, c#g1 included
        assert ta.connect(tb.metadata()) == "b"
    for cache, gpu in ((a, gpu_a), (b, gpu_b), (c, gpu_c)):
        cache.release(gpu)


def test_frames_count_groups_once_and_an_earlier_instance_never_completes_a_send():
    gpu_a, a = make()
    gpu_b, b = make()
    src, dst = held(a, {0: 1, 2: 1}), held(b, {0: 1, 2: 1})
    with HybridKvTransfer(b, gpu_b, "d") as tb:
        with HybridKvTransfer(a, gpu_a, "p") as old:
            old.connect(tb.metadata())
            tb.connect(old.metadata())
            old.group(0).send("d#g0", src[0], dst[0], _frame(old, 0, 2, b"old")).wait(WAIT)  # 1 of 2 groups
            old.group(0).send("d#g0", src[0], dst[0], _frame(old, 0, 2, b"old")).wait(WAIT)  # the same again
            with pytest.raises(Exception, match="no complete notification"):
                tb.wait_notifications(0.2)  # a repeated group is not a second group
        tb.disconnect("p")
        assert tb._arrived == {}  # the partial send went with the peer
        with HybridKvTransfer(a, gpu_a, "p") as new:  # a restarted sender: numbers start at 0 again
            new.connect(tb.metadata())
            tb.connect(new.metadata())
            new.send("d", {2: src[2]}, {2: dst[2]}, b"new").wait(WAIT)
            assert tb.wait_notifications(WAIT) == [("p", b"new")]
    a.release(gpu_a)
    b.release(gpu_b)


def _frame(t, number, count, notify):
    from pagedkv.tiers.hybrid_transfer import FRAME_MAGIC

    return FRAME_MAGIC + t._nonce + number.to_bytes(8, "little") + count.to_bytes(4, "little") + notify


def test_allow_and_token_apply_to_every_group():
    from pagedkv.tiers.transfer import PeerRefused

    gpu_a, a = make()
    gpu_b, b = make()
    secret = b"0123456789abcdef-shared"
    with HybridKvTransfer(a, gpu_a, "p", allow=["d"], token=secret) as ta, \
            HybridKvTransfer(b, gpu_b, "d", token=secret) as tb, HybridKvTransfer(b, gpu_b, "x") as tx:
        with pytest.raises(PeerRefused):
            ta.connect(tx.metadata())  # not allowed (and no token)
        assert ta.connect(tb.metadata()) == "d"
        assert [ta.group(g).peers() for g in range(3)] == [["d#g0"], ["d#g1"], ["d#g2"]]
    a.release(gpu_a)
    b.release(gpu_b)
