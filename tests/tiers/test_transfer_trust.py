"""KvTransfer against peers it should not trust blindly: hostile metadata blobs (a clear
BadPeerMetadata naming the problem, sizes bounded before any JSON work, a truncated blob
never spoiling a later connect), connection reuse and the bound on loaded peers, the
allow-list and shared token, write grants, one agent per name, finite timeouts, an unknown
NIXL backend, and the cache held while its transfer is open. Two agents in this process
(UCX on loopback); the parse tests need no NIXL."""

from __future__ import annotations

import json
import os

import pytest

from pagedkv import HostBackend, KvCacheConfig, KvCacheError, PagedKvCache, PrefixCache
from pagedkv.tiers import transfer_metadata as tm
from pagedkv.tiers.transfer import (
    BadPeerMetadata,
    KvTransfer,
    PeerRefused,
    TransferError,
)
from pagedkv.tiers.transfer_errors import PagedKvError
from pagedkv.tiers.transfer_grants import GrantViolation, notify_prefix
from pagedkv.tiers.transfer_layout import LAYOUT_VERSION, layout_of

from shared_helpers import nixl_reason  # noqa: E402

NIXL_REASON = nixl_reason()
needs_nixl = pytest.mark.skipif(NIXL_REASON is not None, reason=NIXL_REASON or "")

CONFIG = dict(block_size=4, num_kv_heads=1, head_dim=16, num_layers=2, dtype="bf16")
WAIT = 20.0
TOKEN = b"0123456789abcdef-shared"


def make_cache(blocks=8):
    gpu = HostBackend(1 << 22)
    return gpu, PagedKvCache(KvCacheConfig(**CONFIG), blocks, gpu)


def good_info(cache):
    return {"name": "peer", "num_blocks": cache.num_blocks(), "mem_type": "DRAM", "device_id": 0,
            "layout": layout_of(cache), "pools": [[0, "K", 4096, 128], [0, "V", 8192, 128],
                                                  [1, "K", 12288, 128], [1, "V", 16384, 128]],
            "leases": 65536}


def blob_of(info, nixl=b"nixl-part", token=None):
    return tm.encode(info, nixl, token)


def raw_blob(text: bytes, nixl: bytes = b"") -> bytes:
    return tm.METADATA_MAGIC + len(text).to_bytes(8, "little") + text + nixl


# -- the parse, without NIXL ------------------------------------------------------------


def test_a_good_blob_parses_and_round_trips():
    from pagedkv.tiers.transfer import DEFAULT_MAX_PEERS

    assert (tm.MAX_JSON_BYTES, tm.MAX_NIXL_BYTES, tm.MAX_DEPTH, DEFAULT_MAX_PEERS) == (1 << 20, 16 << 20, 8, 16)  # README
    _, cache = make_cache()
    info, nixl = tm.parse(blob_of(good_info(cache)))
    assert nixl == b"nixl-part" and info["nixl_bytes"] == 9 and info["nixl_digest"] == tm.digest(b"nixl-part")
    assert info["layout"] == layout_of(cache) and "token_tag" not in info
    tagged, _ = tm.parse(blob_of(good_info(cache), token=TOKEN))
    assert tm.check_token(tagged, TOKEN) and not tm.check_token(tagged, b"another-token-of-16b")
    assert not tm.check_token(info, TOKEN) and tm.check_token(info, None)
    assert not tm.check_token(dict(tagged, token_tag="\u00e9" * 64), TOKEN)  # refused, not a TypeError


def edit(path, value):
    def apply(info):
        target = info
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return apply


EDITS = {
    "name int": (edit(["name"], 5), "field name must be a non-empty str"),
    "name huge": (edit(["name"], "n" * 300), "field name must be a non-empty str of at most 256"),
    "num_blocks str": (edit(["num_blocks"], "8"), "field num_blocks must be an int"),
    "num_blocks bool": (edit(["num_blocks"], True), "field num_blocks must be an int"),
    "num_blocks zero": (edit(["num_blocks"], 0), r"field num_blocks must be an int in \[1, 2\*\*63\)"),
    "num_blocks 2**64": (edit(["num_blocks"], 2**64), r"field num_blocks must be an int in \[1, 2\*\*63\)"),
    "mem_type": (edit(["mem_type"], "GPU"), "field mem_type must be DRAM or VRAM, got 'GPU'"),
    "device_id float": (edit(["device_id"], 0.5), "field device_id must be an int"),
    "leases negative": (edit(["leases"], -1), "field leases must be an int"),
    "layout list": (edit(["layout"], []), "field layout must be an object, got list"),
    "layout version": (edit(["layout", "layout_version"], 1), f"layout version 1 is not {LAYOUT_VERSION}"),
    "block_size str": (edit(["layout", "block_size"], "4"), "field layout.block_size must be an int"),
    "v_aliases_k int": (edit(["layout", "v_aliases_k"], 0), "field layout.v_aliases_k must be a bool"),
    "window str": (edit(["layout", "window"], "x"), "field layout.window must be an int"),
    "block_layout": (edit(["layout", "block_layout"], 7), "field layout.block_layout must be NHD or HND"),
    "layers dict": (edit(["layout", "layers"], {}), r"field layout.layers must be a list of num_layers \(2\)"),
    "layers short": (edit(["layout", "layers"], [{}]), r"field layout.layers must be a list of num_layers \(2\)"),
    "layer not dict": (edit(["layout", "layers", 1], "x"), r"field layout.layers\[1\] must be an object"),
    "layer head_dim str": (edit(["layout", "layers", 0, "head_dim"], "16"),
                           r"field layout.layers\[0\].head_dim must be an int"),
    "layer dtype int": (edit(["layout", "layers", 0, "dtype"], 3), r"field layout.layers\[0\].dtype must be"),
    "layer replicated": (edit(["layout", "layers", 0, "replicated"], None), r"layers\[0\].replicated must be a bool"),
    "pools dict": (edit(["pools"], {}), "field pools must be a list of at most 4 pools"),
    "pools too many": (edit(["pools"], [[0, "K", 1, 1]] * 5), "field pools must be a list of at most 4 pools"),
    "pool short": (edit(["pools", 0], [0, "K"]), r"field pools\[0\] must be \[layer, side, address, stride\]"),
    "pool address str": (edit(["pools", 2, 2], "0x10"), r"field pools\[2\].address must be an int"),
    "token tag int": (edit(["token_tag"], 1), "field token_tag must be a str"),
    "digest not ascii": (edit(["nixl_digest"], "\u00e9" * 32), "does not match its digest"),
}


@pytest.mark.parametrize("case", EDITS)
def test_a_wrong_field_is_a_bad_peer_metadata_naming_it(case):
    _, cache = make_cache()
    change, message = EDITS[case]
    info = good_info(cache)
    nixl = b"nixl-part"
    info.update(nixl_bytes=len(nixl), nixl_digest=tm.digest(nixl))
    change(info)
    with pytest.raises(BadPeerMetadata, match=message) as caught:
        tm.parse(raw_blob(json.dumps(info).encode(), nixl))
    assert isinstance(caught.value, PagedKvError) and isinstance(caught.value, ValueError)


def hostile_blobs():
    _, cache = make_cache()
    good = blob_of(good_info(cache))
    head = len(tm.METADATA_MAGIC)
    size = int.from_bytes(good[head:head + 8], "little")
    return {
        "not bytes": (lambda: tm.parse("text"), TypeError, "peer_metadata must be bytes"),
        "no magic": (lambda: tm.parse(b"hello"), BadPeerMetadata, "not KvTransfer metadata"),
        "deep nesting": (lambda: tm.parse(raw_blob(b"[" * 100_000 + b"]" * 100_000)), BadPeerMetadata,
                         "nests 100000 levels deep, over the bound of 8"),
        "deep nesting in an object": (lambda: tm.parse(raw_blob(b'{"a":' * 50 + b"1" + b"}" * 50)), BadPeerMetadata,
                                      "nests 50 levels deep"),
        "brackets in strings do not count": (lambda: tm.parse(raw_blob(json.dumps({"s": "[[[[[[[[[[\\\"[[[["}).encode())),
                                             BadPeerMetadata, "lacks one of name"),
        "64 MiB of padding": (lambda: tm.parse(good + b" " * (64 << 20)), BadPeerMetadata,
                              r"is 671\d+ bytes, over the bound of 1782\d+"),
        "padding inside the NIXL part": (lambda: tm.parse(good + b"\x00" * 100), BadPeerMetadata,
                                         "NIXL part is 109 bytes but 9 were written \\(padded\\)"),
        "declared JSON size huge": (lambda: tm.parse(tm.METADATA_MAGIC + (1 << 40).to_bytes(8, "little") + b"{}"),
                                    BadPeerMetadata, "declares a 1099511627776-byte layout description"),
        "truncated JSON": (lambda: tm.parse(good[:head + 8 + size // 2]), BadPeerMetadata,
                           f"is truncated: its layout description needs {size} bytes"),
        "truncated NIXL part": (lambda: tm.parse(good[:-3]), BadPeerMetadata,
                                "NIXL part is 6 bytes but 9 were written \\(truncated\\)"),
        "altered NIXL part": (lambda: tm.parse(good[:-1] + b"X"), BadPeerMetadata, "does not match its digest"),
        "broken JSON": (lambda: tm.parse(raw_blob(b'{"name": ')), BadPeerMetadata, "broken layout description"),
        "JSON list": (lambda: tm.parse(raw_blob(b"[1, 2]")), BadPeerMetadata, "lacks one of name, num_blocks"),
        "huge int": (lambda: tm.parse(raw_blob(b"9" * 5000)), BadPeerMetadata, "broken layout description|lacks one"),
    }


@pytest.mark.parametrize("case", list(hostile_blobs()))
def test_a_hostile_blob_is_refused_with_a_clear_error(case):
    call, kind, message = hostile_blobs()[case]
    with pytest.raises(kind, match=message):
        call()


# -- connect, with NIXL ----------------------------------------------------------------


@pytest.fixture
def pair():
    (ga, a), (gb, b) = make_cache(), make_cache()
    made = []

    def build(name, cache_gpu, **kw):
        gpu, cache = cache_gpu
        transfer = KvTransfer(cache, gpu, name, **kw)
        made.append(transfer)
        return transfer

    yield (ga, a), (gb, b), build
    for transfer in made:
        transfer.close()
    a.release(ga)
    b.release(gb)


@needs_nixl
def test_a_truncated_blob_does_not_spoil_the_next_connect(pair):
    left, right, build = pair
    ta, tb = build("a", left), build("b", right)
    md = tb.metadata()
    with pytest.raises(BadPeerMetadata, match="truncated"):
        ta.connect(md[:-100])
    with pytest.raises(BadPeerMetadata, match=r"field layout.layers\[0\].k_stride must be an int"):
        info, nixl = tm.parse(md)
        info["layout"]["layers"][0]["k_stride"] = "128"
        ta.connect(raw_blob(json.dumps(info).encode(), nixl))
    assert ta.peers() == [] and ta.loaded_peers() == []
    assert ta.connect(md) == "b"


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@needs_nixl
def test_reconnects_reuse_the_connection_and_loaded_peers_are_bounded(pair):
    left, right, build = pair
    ta, tb = build("a", left, max_peers=1), build("b", right)
    md = tb.metadata()
    ta.connect(md)
    ta.disconnect("b")
    before = fds()
    for _ in range(20):
        assert ta.connect(md) == "b"
        ta.disconnect("b")
    # one connection, reused: NIXL leaks a descriptor per load and remove (20 or more here
    # without the reuse); 2 of slack for UCX's own descriptors of agents closed before
    assert fds() - before <= 2
    assert ta.peers() == [] and ta.loaded_peers() == ["b"]
    gc, c = make_cache()
    tc = KvTransfer(c, gc, "c")
    try:
        ta.connect(md)
        with pytest.raises(TransferError, match=r"connect of peer 'c': 1 peers are connected, the bound max_peers=1"):
            ta.connect(tc.metadata())
        assert ta.peers() == ["b"] and ta.loaded_peers() == ["b"]
        ta.disconnect("b")
        assert ta.connect(tc.metadata()) == "c"  # the idle connection to b made room
        assert ta.loaded_peers() == ["c"]
        blocks = c.alloc_blocks(1)
        ta.send("c", left[1].alloc_blocks(1), blocks, b"hi").wait(WAIT)
        assert tc.wait_notifications(WAIT) == [("a", b"hi")]
    finally:
        tc.close()
        c.release(gc)
    with pytest.raises(ValueError, match="max_peers must be a positive int, got 0"):
        KvTransfer(left[1], left[0], "z", max_peers=0)


@needs_nixl
def test_the_allow_list_and_the_token_refuse_other_peers_before_loading(pair):
    left, right, build = pair
    tb = build("b", right, token=TOKEN)
    named = build("a", left, allow={"someone-else"})
    with pytest.raises(PeerRefused, match="peer 'b' is not named in allow: refused before anything was loaded"):
        named.connect(tb.metadata())
    assert named.loaded_peers() == []
    named.close()
    gx, x = make_cache()
    try:
        with KvTransfer(x, gx, "a", token=b"another-secret-16b") as wrong:
            with pytest.raises(PeerRefused, match="not tagged with the shared token"):
                wrong.connect(tb.metadata())
            assert wrong.loaded_peers() == []
        with KvTransfer(x, gx, "a", token=TOKEN, allow={"nobody"}) as right_token:
            assert right_token.connect(tb.metadata()) == "b"  # tagged: the token suffices
        with KvTransfer(x, gx, "a", allow=["b"]) as by_name:
            assert by_name.connect(tb.metadata()) == "b"
    finally:
        x.release(gx)
    with pytest.raises(ValueError, match="token must be bytes of at least 16"):
        KvTransfer(left[1], left[0], "t", token=b"short")
    with pytest.raises(TypeError, match="allow must be a collection of agent names"):
        KvTransfer(left[1], left[0], "t", allow="b")


@needs_nixl
def test_one_name_per_process_finite_timeouts_and_an_unknown_backend(pair):
    left, right, build = pair
    ta = build("a", left)
    with pytest.raises(ValueError, match="a KvTransfer named 'a' is already open in this process"):
        KvTransfer(right[1], right[0], "a")
    for bad in (float("nan"), float("inf"), -1, True, "1"):
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds >= 0"):
            ta.wait_notifications(bad)
    with pytest.raises(TransferError, match=r"unknown NIXL backend 'NOPE' \(this NIXL has: .*UCX"):
        KvTransfer(right[1], right[0], "b", backends=["UCX", "NOPE"])
    tb = build("b", right)  # the refused construction left the name free
    assert not tb.closed()
    with pytest.raises(ValueError, match="backends must be a non-empty list"):
        KvTransfer(right[1], right[0], "c", backends=[])


@needs_nixl
def test_the_cache_is_held_while_its_transfer_is_open(pair):
    left, right, build = pair
    ta = build("a", left)
    with pytest.raises(KvCacheError, match=r"while KvTransfer 'a' still uses its pools: close it first"):
        left[1].release(left[0])
    assert left[1].num_blocks() == 8
    ta.close()
    assert ta.closed()


@needs_nixl
def test_grants_let_a_sender_write_only_the_granted_blocks(pair):
    (ga, a), (gb, b), build = pair
    prefix = PrefixCache(b)
    ta, tb = build("a", (ga, a)), build("b", (gb, b), require_grants=True)
    peer = ta.connect(tb.metadata())
    src = a.alloc_blocks(2)
    a.fill_blocks(src, 0x5A, ga, 0)
    dst = b.alloc_blocks(3)
    cached = b.alloc_blocks(1)
    prefix.insert([1, 2, 3, 4], cached)
    with pytest.raises(Exception, match="free") as free_err:
        tb.grant("a", [7])
    assert isinstance(free_err.value, PagedKvError)
    with pytest.raises(Exception, match=f"block {cached[0]}"):
        tb.grant("a", cached)  # the prefix cache holds it: shared KV must not be overwritten
    assert tb.open_grants() == {}
    ticket = tb.grant("a", dst[:2])
    assert [b.ref_count(x) for x in dst] == [2, 2, 1]
    with pytest.raises(ValueError, match="requires a grant for every send"):
        ta.send(peer, src, dst[:2])
    with pytest.raises(ValueError, match=f"destination block {dst[2]} is not in peer 'b''s grant 1"):
        ta.send(peer, src, [dst[0], dst[2]], grant=ticket)
    ta.send(peer, src, dst[:2], notify=b"req-1", grant=ticket).wait(WAIT)
    assert tb.wait_notifications(WAIT) == [("a", b"req-1")]
    assert [b.ref_count(x) for x in dst] == [1, 1, 1] and tb.open_grants() == {}
    assert (b.read_block(0, dst[1], gb)[0] == 0x5A).all()
    # a notification under a grant that is closed (or never was) is a violation
    with pytest.raises(ValueError, match="requires a grant"):
        ta.send(peer, src[:1], dst[2:], notify=notify_prefix(1) + b"forged")
    second = tb.grant("a", dst[2:])
    assert tb.revoke(second) and not tb.revoke(second)
    ta.send(peer, src[:1], dst[2:], notify=b"late", grant=second).wait(WAIT)
    with pytest.raises(GrantViolation, match="peer 'a' notified a transfer under grant 2, which is no open grant"):
        tb.wait_notifications(WAIT)
    assert [b.ref_count(x) for x in dst] == [1, 1, 1]


@needs_nixl
def test_the_receiver_checks_each_notification_against_its_grants(pair):
    (ga, a), (gb, b), build = pair
    ta = build("a", (ga, a))
    strict = build("b", (gb, b), require_grants=True)
    src = a.alloc_blocks(1)
    dst = b.alloc_blocks(2)
    info, nixl = tm.parse(strict.metadata())
    del info["grants"]  # a sender that does not see the requirement (an old or edited blob)
    peer = ta.connect(raw_blob(json.dumps(info).encode(), nixl))
    ta.send(peer, src, dst[:1], notify=b"plain").wait(WAIT)
    with pytest.raises(GrantViolation, match="peer 'a' sent a notification without a grant; this receiver requires"):
        strict.wait_notifications(WAIT)
    ta.disconnect(peer)
    strict.close()
    gc, c = make_cache()
    try:
        with KvTransfer(c, gc, "c") as lax:
            held = c.alloc_blocks(2)
            lax.grant("someone-else", held)  # grant 1, for another sender
            name = ta.connect(lax.metadata())
            with pytest.raises(ValueError, match="the grant is 'c''s for 'someone-else', not peer 'c''s for 'a'"):
                ta.send(name, src, held[:1], grant=lax.grant("someone-else", held[1:]))
            ta.send(name, src, held[:1], notify=notify_prefix(1) + b"forged").wait(WAIT)
            with pytest.raises(GrantViolation, match="under grant 1, which is a grant made for 'someone-else'"):
                lax.wait_notifications(WAIT)
            ta.send(name, src, held[:1], notify=b"ok").wait(WAIT)  # a plain send: this receiver allows it
            assert lax.wait_notifications(WAIT) == [("a", b"ok")]
            assert sorted(lax.open_grants()) == [1, 2] and [c.ref_count(x) for x in held] == [2, 3]  # one per grant
        assert [c.ref_count(x) for x in held] == [1, 1]  # close dropped the grants' references
    finally:
        c.release(gc)


# -- a hybrid cache's state group: its own layout, checked as strictly --------------------


def state_info():
    from pagedkv.core.layer_groups import LayerGroup
    from pagedkv.tiers.transfer_layout import state_layout_of

    config = KvCacheConfig(4, 1, 16, 2, "bf16", layer_groups=(
        LayerGroup("full", (0,)), LayerGroup("state", (1,), state=(((4, 2), "float32"), ((3,), "bfloat16")))))
    gpu = HostBackend(1 << 22)
    cache = PagedKvCache(config, 8, gpu)
    layout = state_layout_of(cache.group(1))
    return {"name": "peer#g1", "num_blocks": 8, "mem_type": "DRAM", "device_id": 0, "layout": layout,
            "pools": [[1, "S0", 4096, 32], [1, "S1", 8192, 16]], "leases": 0}


STATE_EDITS = {
    "rows missing": (edit(["layout", "rows"], None), "field layout.rows must be a list of 1 to 16384 state rows"),
    "row not object": (edit(["layout", "rows", 0], [1]), r"field layout.rows\[0\] must be an object"),
    "shape str": (edit(["layout", "rows", 0, "shape"], "4x2"), r"field layout.rows\[0\].shape must be a list"),
    "shape zero": (edit(["layout", "rows", 1, "shape"], [0]), r"field layout.rows\[1\].shape must be an int in \[1"),
    "stride zero": (edit(["layout", "rows", 1, "stride"], 0), r"field layout.rows\[1\].stride must be an int in \[1"),
    "dtype int": (edit(["layout", "rows", 0, "dtype"], 4), r"field layout.rows\[0\].dtype must be a non-empty str"),
    "too many pools": (edit(["pools"], [[1, "S0", 4096, 32]] * 3), "field pools must be a list of at most 2 pools"),
}


def test_a_state_group_layout_parses():
    info, _ = tm.parse(blob_of(state_info()))
    assert [(r["layer"], r["tensor"], r["dtype"], r["shape"]) for r in info["layout"]["rows"]] == [
        (1, 0, "float32", [4, 2]), (1, 1, "bfloat16", [3])]


@pytest.mark.parametrize("case", STATE_EDITS)
def test_a_wrong_state_layout_field_is_a_bad_peer_metadata_naming_it(case):
    change, message = STATE_EDITS[case]
    info = state_info()
    nixl = b"nixl-part"
    info.update(nixl_bytes=len(nixl), nixl_digest=tm.digest(nixl))
    change(info)
    with pytest.raises(BadPeerMetadata, match=message):
        tm.parse(raw_blob(json.dumps(info).encode(), nixl))


def test_a_hybrid_cache_whose_group_is_held_refuses_release_and_releases_nothing():
    from pagedkv.core.layer_groups import LayerGroup

    config = KvCacheConfig(4, 1, 16, 2, "bf16", layer_groups=(
        LayerGroup("full", (0,)), LayerGroup("state", (1,), state=(((4,), "float32"),))))
    gpu = HostBackend(1 << 22)
    cache = PagedKvCache(config, 8, gpu)
    holder = object()
    cache.group(1).hold(holder, "KvTransfer 'x#g1'")
    with pytest.raises(KvCacheError, match="while KvTransfer 'x#g1' still uses its pools"):
        cache.release(gpu)
    assert cache.group(0).alloc_blocks(1) == [0] and cache.group(1).alloc_blocks(1) == [0]  # both live
    cache.group(1).let_go(holder)
    cache.group(0).free_blocks([0])
    cache.group(1).free_blocks([0])
    cache.release(gpu)
    assert gpu.live_allocations() == 0
