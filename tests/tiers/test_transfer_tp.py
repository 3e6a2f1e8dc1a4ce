"""KvTransfer between TP sizes (1->2, 1->4, 4->2, 2->1), NHD and HND, MLA replicated: each
receiving rank ends with exactly its heads' bytes, descriptors merged as the layouts
allow. Every cache is its own NIXL agent over UCX loopback, all in this process (a few
agents made once for the module); the separate-process cases are in test_transfer_pull.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache
from pagedkv.tiers.transfer import METADATA_MAGIC, KvTransfer, LayoutMismatch

from shared_helpers import nixl_reason  # noqa: E402

NIXL_REASON = nixl_reason()

# one worker runs the whole module: its module-scoped fixture is built once (pyproject: --dist loadgroup)
pytestmark = [pytest.mark.skipif(NIXL_REASON is not None, reason=NIXL_REASON or ""), pytest.mark.xdist_group("transfer_tp")]

GLOBAL_HEADS = 8
BASE = dict(block_size=4, head_dim=32, num_layers=2, dtype="turbo4k_turbo8v",
            layer_dtypes=("turbo4k_turbo8v", "bf16"))
WAIT = 20.0
BLOCKS = 8
SLOTS = np.array([4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17, 18, 28, 29, 30], dtype=np.int64)  # blocks 1-4, 7


class Rank:
    """One engine rank: a HostBackend cache of `GLOBAL_HEADS / tp_size` heads and its agent."""

    def __init__(self, name: str, tp_rank: int, tp_size: int, layout: str, **extra):
        self.gpu = HostBackend(1 << 24)
        config = dict(BASE, num_kv_heads=GLOBAL_HEADS // tp_size, tp_rank=tp_rank, tp_size=tp_size,
                      layout=layout, **extra)
        self.cache = PagedKvCache(KvCacheConfig(**config), BLOCKS, self.gpu)
        self.blocks = self.cache.alloc_blocks(BLOCKS)
        self.transfer = KvTransfer(self.cache, self.gpu, name)
        self.name = name

    def heads(self, layer: int = 0) -> slice:
        start, stop, _ = self.cache.config().head_range(layer)
        return slice(start, stop)

    def close(self) -> None:
        self.transfer.close()
        self.cache.release(self.gpu)


@pytest.fixture(scope="module")
def ranks():
    made = {}
    specs = {"p1": (0, 1, "HND"), "d2a": (0, 2, "HND"), "d2b": (1, 2, "HND"),
             "d4a": (0, 4, "HND"), "d4b": (1, 4, "HND"), "d4c": (2, 4, "HND"), "d4d": (3, 4, "HND"),
             "n1": (0, 1, "NHD")}
    try:
        for name, (rank, size, layout) in specs.items():
            made[name] = Rank(name, rank, size, layout)
        for a in made.values():  # everyone knows everyone: each pair connected both ways
            for b in made.values():
                if a is not b:
                    a.transfer.connect(b.transfer.metadata())
        yield made
    finally:
        for rank in made.values():
            rank.close()


def global_rows(seed: int):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((SLOTS.size, GLOBAL_HEADS, 32)) * 2).astype(np.float32) for _ in range(4)]


def fill(rank: Rank, rows) -> None:
    """Write the rank's heads of the global rows (K and V of 2 layers) into its slots."""
    rank.cache.init_blocks(rank.blocks, rank.gpu, 0)
    for layer in range(2):
        k, v = rows[2 * layer], rows[2 * layer + 1]
        rank.cache.write_tokens(layer, SLOTS, k[:, rank.heads(layer)], v[:, rank.heads(layer)], rank.gpu, 0)


def decoded(rank: Rank, slots) -> list[np.ndarray]:
    out = []
    for layer in range(2):
        out += list(rank.cache.read_tokens(layer, slots, rank.gpu))
    return out


def move(src: Rank, dst: Rank, src_blocks, dst_blocks):
    handle = src.transfer.send(dst.name, src_blocks, dst_blocks, notify=b"n")
    handle.wait(WAIT)
    assert dst.transfer.wait_notifications(WAIT) == [(src.name, b"n")]
    return handle


def remap(slots, src_blocks, dst_blocks):
    table = dict(zip(src_blocks, dst_blocks))
    return np.array([table[s // 4] * 4 + s % 4 for s in slots.tolist()], dtype=np.int64)


SRC_BLOCKS = [1, 2, 3, 4, 7]
DST_BLOCKS = [5, 6, 0, 1, 2]  # 1->5, 2->6 consecutive; 3,4 -> 0,1


@pytest.mark.parametrize("source, receivers", [("p1", ("d2a", "d2b")), ("p1", ("d4a", "d4b", "d4c", "d4d")),
                                               ("n1", ("d2a", "d2b"))])
def test_one_rank_splits_by_head_to_every_receiver(ranks, source, receivers):
    rows = global_rows(len(receivers))
    src = ranks[source]
    fill(src, rows)
    expected = decoded(src, SLOTS)
    for name in receivers:
        dst = ranks[name]
        dst.cache.poison_blocks(dst.blocks, dst.gpu, 0)
        handle = move(src, dst, SRC_BLOCKS, DST_BLOCKS)
        got = decoded(dst, remap(SLOTS, SRC_BLOCKS, DST_BLOCKS))
        for want, have in zip(expected, got):
            assert np.array_equal(want[:, dst.heads()], have), name
        # byte-exact: each receiving block is the source's head chunk (HND source) / pieces
        geometry = dst.cache.config().side_layout(0, "K")
        for s, d in zip(SRC_BLOCKS, DST_BLOCKS):
            mine = src.cache.config().side_layout(0, "K").to_nhd(src.cache.read_block(0, s, src.gpu)[0])
            theirs = geometry.to_nhd(dst.cache.read_block(0, d, dst.gpu)[0])
            heads, per = dst.heads(), geometry.head_data_bytes
            rows_here = mine[: geometry.block_size * GLOBAL_HEADS * per].reshape(4, GLOBAL_HEADS, per)[:, heads]
            assert np.array_equal(rows_here.reshape(-1), theirs[: rows_here.size])
        # descriptors: 2 layers x 2 sides x 5 pairs for an HND source (one run per block
        # pair: a head range is contiguous); an NHD source into HND moves one run per
        # (token, head) piece: 4 tokens x H heads, data and scales for layer 0's turbo sides
        heads = dst.heads().stop - dst.heads().start
        per_pair = 4 if source == "p1" else 2 * (4 * heads * 2) + 2 * (4 * heads)
        assert handle.descriptors == 5 * per_pair, (name, handle.descriptors)


def test_four_ranks_gather_into_two(ranks):
    rows = global_rows(7)
    senders = [ranks[n] for n in ("d4a", "d4b", "d4c", "d4d")]
    for s in senders:
        fill(s, rows)
    for d, pair in ((ranks["d2a"], senders[:2]), (ranks["d2b"], senders[2:])):
        d.cache.poison_blocks(d.blocks, d.gpu, 0)
        for s in pair:
            handle = move(s, d, SRC_BLOCKS, DST_BLOCKS)
            assert handle.descriptors == 4 * 5
        got = decoded(d, remap(SLOTS, SRC_BLOCKS, DST_BLOCKS))
        want = [np.concatenate([a, b], axis=1) for a, b in zip(decoded(pair[0], SLOTS), decoded(pair[1], SLOTS))]
        assert all(np.array_equal(w, g) for w, g in zip(want, got))
    with pytest.raises(ValueError, match=r"peer 'd2b' \(TP rank 1 of 2, layer 0 heads \[4, 8\)\) shares no head "
                                         r"with this cache \(TP rank 0 of 4, layer 0 heads \[0, 2\)\)"):
        senders[0].transfer.send("d2b", [1], [1])


def test_two_ranks_gather_into_one_and_same_placement_merges_whole_blocks(ranks):
    rows = global_rows(9)
    a, b, one = ranks["d2a"], ranks["d2b"], ranks["p1"]
    fill(a, rows), fill(b, rows)
    one.cache.poison_blocks(one.blocks, one.gpu, 0)
    for s in (a, b):
        assert move(s, one, SRC_BLOCKS, DST_BLOCKS).descriptors == 4 * 5
    got = decoded(one, remap(SLOTS, SRC_BLOCKS, DST_BLOCKS))
    want = [np.concatenate([x, y], axis=1) for x, y in zip(decoded(a, SLOTS), decoded(b, SLOTS))]
    assert all(np.array_equal(w, g) for w, g in zip(want, got))
    # same TP placement across layouts: one run per (token, head) piece, as above
    pieces = 5 * (2 * (4 * GLOBAL_HEADS * 2) + 2 * (4 * GLOBAL_HEADS))
    assert move(one, ranks["n1"], SRC_BLOCKS, DST_BLOCKS).descriptors == pieces
    fill(ranks["n1"], rows)
    assert move(ranks["n1"], one, SRC_BLOCKS, DST_BLOCKS).descriptors == pieces
    assert all(np.array_equal(x, y) for x, y in zip(decoded(one, remap(SLOTS, SRC_BLOCKS, DST_BLOCKS)),
                                                    decoded(ranks["n1"], SLOTS)))


def test_same_placement_and_layout_merges_consecutive_whole_blocks(ranks):
    # HND into HND of the same heads: whole blocks, the consecutive pairs (1, 2 -> 5, 6) and
    # (3, 4 -> 0, 1) merged: 3 runs a pool, 4 pools
    a = ranks["d2a"]
    other = Rank("d2a-twin", 0, 2, "HND")
    try:
        other.transfer.connect(a.transfer.metadata())
        a.transfer.connect(other.transfer.metadata())
        fill(a, global_rows(11))
        assert move(a, other, SRC_BLOCKS, DST_BLOCKS).descriptors == 4 * 3
        assert all(np.array_equal(a.cache.read_block(layer, s, a.gpu)[side], other.cache.read_block(layer, d, other.gpu)[side])
                   for layer in range(2) for side in range(2) for s, d in zip(SRC_BLOCKS, DST_BLOCKS))
    finally:
        a.transfer.disconnect("d2a-twin")
        other.close()


def test_mla_is_replicated_and_sent_by_one_rank():
    mla = dict(block_size=4, num_kv_heads=1, head_dim=32, num_layers=1, dtype="bf16", v_aliases_k=True)
    made = []
    try:
        for name, rank, size in (("m1", 0, 1), ("m2a", 0, 2), ("m2b", 1, 2), ("m4a", 0, 4), ("m4c", 2, 4)):
            gpu = HostBackend(1 << 22)
            cache = PagedKvCache(KvCacheConfig(**mla, tp_rank=rank, tp_size=size, layout="HND"), 4, gpu)
            cache.alloc_blocks(4)
            made.append((name, gpu, cache, KvTransfer(cache, gpu, name)))
        byname = {m[0]: m for m in made}
        for a in made:
            for b in made:
                if a is not b:
                    a[3].connect(b[3].metadata())
        rng = np.random.default_rng(0)
        k = rng.standard_normal((16, 1, 32)).astype(np.float32)
        byname["m1"][2].write_tokens(0, np.arange(16), k, None, byname["m1"][1], 0)
        for name in ("m2a", "m2b"):  # 1 -> 2: rank 0 of 1 sends to both
            byname["m1"][3].send(name, [0, 1, 2, 3], [0, 1, 2, 3]).wait(WAIT)
            got = byname[name][2].read_tokens(0, np.arange(16), byname[name][1])[0]
            assert np.array_equal(got, byname["m1"][2].read_tokens(0, np.arange(16), byname["m1"][1])[0])
        # 2 -> 4: receiver 2 takes the latent from rank 1 only; rank 0 has nothing for it
        with pytest.raises(ValueError, match="shares no head"):
            byname["m2a"][3].send("m4c", [0], [0])
        assert byname["m2b"][3].send("m4c", [0, 1], [2, 3]).descriptors == 1
        with pytest.raises(ValueError, match="shares no head"):
            byname["m2b"][3].send("m4a", [0], [0])
    finally:
        for _, gpu, cache, transfer in made:
            transfer.close()
            cache.release(gpu)


def edited(metadata: bytes, edit) -> bytes:
    head = len(METADATA_MAGIC)
    size = int.from_bytes(metadata[head : head + 8], "little")
    info = json.loads(metadata[head + 8 : head + 8 + size])
    edit(info)
    text = json.dumps(info).encode()
    return METADATA_MAGIC + len(text).to_bytes(8, "little") + text + metadata[head + 8 + size :]


def test_handshake_refuses_what_cannot_be_mapped_and_a_peer_that_lies(ranks):
    p1, d2a = ranks["p1"], ranks["d2a"]
    md = d2a.transfer.metadata()
    p1.transfer.disconnect("d2a")
    try:
        def lie_format(info):  # claims turbo3 V pools but registers (and describes) turbo8's strides
            info["layout"]["layers"][0]["dtype"] = "turbo4k_turbo3v"

        with pytest.raises(LayoutMismatch, match=r"peer 'd2a' describes a layout that contradicts itself: layer 0 "
                                                 r"v_stride is 576 but turbo4k_turbo3v x 4 heads x 32 in blocks of 4 "
                                                 r"takes 224$"):
            p1.transfer.connect(edited(md, lie_format))

        def lie_heads(info):
            info["layout"]["layers"][1]["head_start"] = 6

        with pytest.raises(LayoutMismatch, match=r"layer 1 holds heads \[6, 10\) of 8"):
            p1.transfer.connect(edited(md, lie_heads))

        def other_window_and_heads(info):
            info["layout"]["window"] = 4
            info["layout"]["layers"][1]["global_heads"] = 16
            info["layout"]["layers"][1]["num_kv_heads"] = 8
            info["layout"]["layers"][1]["k_stride"] = info["layout"]["layers"][1]["v_stride"] = 2048
            for pool in info["pools"]:
                if pool[0] == 1:
                    pool[3] = 2048

        with pytest.raises(LayoutMismatch) as caught:
            p1.transfer.connect(edited(md, other_window_and_heads))
        assert str(caught.value).endswith("): window: here None, peer 4; layer 1 global_heads: here 8, peer 16")
        assert "d2a" not in p1.transfer.peers()
    finally:
        p1.transfer.connect(md)
