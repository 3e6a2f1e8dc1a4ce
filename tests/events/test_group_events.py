"""The group index on KV events: a hybrid prefix cache's events carry the group, the event
number and what a router needs, and the wire format writes them as vLLM's BlockStored /
BlockRemoved with `group_idx` and the group's kind, in vLLM's array and map encodings."""

from __future__ import annotations

import pytest

from pagedkv import BlockRemoved, BlockStored, HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.sequences.hashing import chain_hash, root_hash
from pagedkv.sequences.hybrid_prefix import GroupBlockRemoved, GroupBlockStored

msgpack = pytest.importorskip("msgpack", reason="msgpack is not installed (the events extra)")

from pagedkv.events import decode_batch, encode_batch  # noqa: E402

PROMPT = list(range(100, 121))  # 21 tokens: 5 units of 4


def hybrid(events: list, blocks=(32, 32, None)):
    config = KvCacheConfig(4, 1, 16, 3, "bf16", layer_groups=(
        LayerGroup("full", (0,)),
        LayerGroup("sliding", (1,), window=8, block_size=8),
        LayerGroup("state", (2,), state=(((4,), "float32"),), checkpoint_every=8),
    ))
    gpu = HostBackend()
    cache = PagedKvCache(config, list(blocks), gpu)
    prefix = PrefixCache(cache, on_event=events.append)
    return cache, prefix, SequenceTable(cache, prefix, gpu)


def unit_hashes(tokens: list[int], unit: int = 4) -> dict[int, int]:
    """position -> the unit-chain hash of the tokens before it (pagedkv's default scheme)."""
    out, h = {}, root_hash(0)
    for k in range(len(tokens) // unit):
        h = chain_hash(h, tokens[k * unit : (k + 1) * unit])
        out[(k + 1) * unit] = h
    return out


def test_hybrid_events_carry_the_group_the_number_and_a_block_a_router_can_index():
    events: list = []
    _, prefix, table = hybrid(events)
    table.add("a", PROMPT)
    table.free("a")
    hashes = unit_hashes(PROMPT)
    stored = [e for e in events if isinstance(e, GroupBlockStored)]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    by_group = {g: [(e.position, e.block_size) for e in stored if e.group_idx == g] for g in range(3)}
    assert by_group[0] == [(4, 4), (8, 4), (12, 4), (16, 4), (20, 4)]
    assert by_group[1] == [(16, 8)]  # the sliding group keeps the blocks of the last 8 tokens: one full
    # the checkpoints at every multiple of checkpoint_every (8) the prompt reaches; their last unit
    assert by_group[2] == [(8, 4), (16, 4)]
    for e in stored:
        start = e.position - e.block_size
        assert e.token_ids == tuple(PROMPT[start : e.position])
        assert e.block_hash == hashes[e.position]
        assert e.parent_block_hash == (hashes[start] if start else None)
        assert e.medium == "GPU" and e.adapter_id == 0
        kind, window = {0: ("full_attention", None), 1: ("sliding_window", 8), 2: ("mamba", None)}[e.group]
        assert (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == (kind, window)
    before = len(events)
    prefix.clear()
    removed = events[before:]
    assert all(type(e) is GroupBlockRemoved and e.medium == "GPU" for e in removed)
    assert sorted((e.group_idx, e.block_hash) for e in removed) == sorted((e.group, e.block_hash) for e in stored)
    assert [e.seq for e in removed] == list(range(before + 1, len(events) + 1))


STORED = GroupBlockStored(1, 5, 16, 111, 0, token_ids=tuple(range(8)), parent_block_hash=222, block_size=8,
                          kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=8)
FULL = GroupBlockStored(0, 2, 4, 333, 3, token_ids=(1, 2, 3, 4), block_size=4, kv_cache_spec_kind="full_attention")
REMOVED = GroupBlockRemoved(1, 5, 111)


def test_the_array_encoding_writes_vllms_positional_fields_trailing_defaults_left_out():
    plain = BlockStored(block_hashes=(7,), parent_block_hash=None, token_ids=(1, 2), block_ids=(0,), block_size=2,
                        adapter_id=0)
    keyed = BlockStored(block_hashes=(7, 8), parent_block_hash=6, token_ids=(1, 2, 3, 4), block_ids=(0, 1),
                        block_size=2, adapter_id=0, extra_keys=(("img",), None))
    removed = BlockRemoved(block_hashes=(7,), block_ids=(0,), group_idx=2)
    ts, events, rank = decode_batch(encode_batch(1.0, [STORED, FULL, REMOVED, plain, keyed, removed]))
    assert (ts, rank) == (1.0, None)
    assert events == [
        ["BlockStored", [111], 222, list(range(8)), 8, None, "GPU", None, None, 1, "sliding_window", 8],
        ["BlockStored", [333], None, [1, 2, 3, 4], 4, 3, "GPU", None, None, 0, "full_attention"],
        ["BlockRemoved", [111], "GPU", 1],
        ["BlockStored", [7], None, [1, 2], 2, None, "GPU", None],  # lora_name has no default: always there
        ["BlockStored", [7, 8], 6, [1, 2, 3, 4], 2, None, "GPU", None, [["img"], None]],
        ["BlockRemoved", [7], "GPU", 2],
    ]


def test_the_map_encoding_writes_vllms_named_fields_type_first_defaults_left_out():
    payload = encode_batch(2.5, [STORED, REMOVED], data_parallel_rank=0, encoding="map")
    assert payload[:1] == b"\x93" and payload[10:11] == b"\x92"  # [ts, [2 events], rank]
    assert payload[11:17] == b"\x8b\xa4type"  # an 11-entry map, its tag under "type" first
    _, events, rank = decode_batch(payload)
    assert rank == 0
    assert [list(e) for e in events] == [
        ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
         "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"],
        ["type", "block_hashes", "medium", "group_idx"],
    ]
    assert events[0] == {"type": "BlockStored", "block_hashes": [111], "parent_block_hash": 222,
                         "token_ids": list(range(8)), "block_size": 8, "lora_id": None, "medium": "GPU",
                         "lora_name": None, "group_idx": 1, "kv_cache_spec_kind": "sliding_window",
                         "kv_cache_spec_sliding_window": 8}
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [111], "medium": "GPU", "group_idx": 1}
    plain = BlockRemoved(block_hashes=(9,), block_ids=(0,))
    assert decode_batch(encode_batch(0.0, [plain], encoding="map"))[1] == [
        {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}]
    from pagedkv import AllBlocksCleared

    assert decode_batch(encode_batch(0.0, [AllBlocksCleared()], encoding="map"))[1] == [{"type": "AllBlocksCleared"}]
    with pytest.raises(ValueError, match="encoding must be one of .*'array', 'map'.*, got 'json'"):
        encode_batch(0.0, [], encoding="json")


def test_a_hybrid_prefix_cache_publishes_its_group_events_through_zmq():
    zmq = pytest.importorskip("zmq", reason="pyzmq is not installed (the events extra)")
    from pagedkv.events import ZmqPublisher

    with pytest.raises(ValueError, match="encoding must be one of"):
        ZmqPublisher("inproc://kv-groups-bad", encoding="xml")
    ctx = zmq.Context.instance()
    got: list = []
    with ZmqPublisher("inproc://kv-groups", topic="g", encoding="map") as pub:
        sub = ctx.socket(zmq.SUB)
        sub.connect("inproc://kv-groups")
        sub.setsockopt_string(zmq.SUBSCRIBE, "")
        cache, prefix, table = hybrid([])
        prefix._events.consumer = pub  # (the world's list replaced by the publisher)
        for attempt in range(50):  # until the subscription has reached the publisher
            table.add(attempt, [attempt] * 8)
            table.free(attempt)
            if sub.poll(100):
                break
        while sub.poll(200):
            got.extend(decode_batch(sub.recv_multipart()[2])[1])
        prefix.close()
        sub.close()
    stored = [e for e in got if e["type"] == "BlockStored"]
    assert stored and {e["group_idx"] for e in stored} == {0, 1, 2}
    assert {e["group_idx"]: e["kv_cache_spec_kind"] for e in stored} == {0: "full_attention", 1: "sliding_window",
                                                                        2: "mamba"}
