"""LayerGroup and KvCacheConfig(layer_groups=...) validation, GroupLayout costs, the budget
split, and HybridKvCache's groups (own allocators and pools, state slots, routing)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache
from pagedkv.cache import HybridKvCache, StateGroup
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.groups.layout import GroupLayout, split_budget

BF16 = np.dtype(ml_dtypes.bfloat16)
STATE = (((4, 8), BF16), ((3,), "float32"))


def hybrid_config(**kw) -> KvCacheConfig:
    groups = (
        LayerGroup("full", (0,)),
        LayerGroup("sliding", (1, 2), window=8),
        LayerGroup("state", (3,), state=STATE, checkpoint_every=kw.pop("checkpoint_every", None)),
    )
    return KvCacheConfig(4, 2, 16, 4, "bf16", layer_groups=groups, **kw)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="mamba", layers=(0,)), "kind must be one of"),
        (dict(kind="full", layers=()), "layers is empty"),
        (dict(kind="full", layers=(1, 1)), "layer 1 is listed twice"),
        (dict(kind="full", layers=(-1,)), "not a layer index"),
        (dict(kind="sliding", layers=(0,)), "needs window"),
        (dict(kind="sliding", layers=(0,), window=0), "window"),
        (dict(kind="full", layers=(0,), window=4), "window is only for sliding"),
        (dict(kind="state", layers=(0,)), "at least one"),
        (dict(kind="state", layers=(0,), state=(((0, 2), "f4"),)), "shape entry"),
        (dict(kind="state", layers=(0,), state=(((2,), "nope"),)), "not a numpy dtype"),
        (dict(kind="state", layers=(0,), state=(((2,), "f4"),), block_size=4), "block_size is only"),
        (dict(kind="full", layers=(0,), state=(((2,), "f4"),)), "state is only"),
        (dict(kind="full", layers=(0,), checkpoint_every=4), "checkpoint_every is only"),
    ],
)
def test_a_bad_layer_group_is_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LayerGroup(**kwargs)


def test_state_dtypes_include_bfloat16_and_sizes_add_up():
    group = LayerGroup("state", [3], state=STATE)
    assert group.layers == (3,)
    assert group.state == (((4, 8), BF16), ((3,), np.dtype(np.float32)))
    assert group.state_bytes_per_layer() == 4 * 8 * 2 + 3 * 4


@pytest.mark.parametrize(
    "groups, message",
    [
        ((LayerGroup("full", (0, 1)),), "layer 2 is in no layer group"),
        ((LayerGroup("full", (0, 1, 2)), LayerGroup("sliding", (2,), window=4)), "layer 2 is in layer_groups"),
        ((LayerGroup("full", (0, 1, 2, 3)),), "names layer 3 but num_layers is 3"),
        ((LayerGroup("state", (0, 1, 2), state=STATE),), "at least one attention group"),
        ((LayerGroup("full", (0,), block_size=4), LayerGroup("full", (1, 2), block_size=6)), "does not divide"),
        ((LayerGroup("full", (0, 1)), LayerGroup("state", (2,), state=STATE, checkpoint_every=6)), "match unit 4"),
        (("full",), "must be a LayerGroup"),
    ],
)
def test_a_bad_grouping_is_refused(groups, message):
    with pytest.raises(ValueError, match=message):
        KvCacheConfig(4, 2, 16, 3, "bf16", layer_groups=groups)


def test_groups_and_a_cache_window_do_not_combine():
    with pytest.raises(ValueError, match="cache_blocks_per_seq and layer_groups"):
        KvCacheConfig(4, 2, 16, 1, "bf16", cache_blocks_per_seq=2, layer_groups=(LayerGroup("full", (0,)),))


def test_an_empty_grouping_is_the_config_of_before():
    plain = KvCacheConfig(4, 2, 16, 3, "bf16")
    assert plain.layer_groups == () and plain == KvCacheConfig(4, 2, 16, 3, "bf16", layer_groups=())
    cache = PagedKvCache(plain, 8, HostBackend())
    assert type(cache) is PagedKvCache
    layout = GroupLayout(plain)
    assert layout.num_groups() == 1 and layout.groups[0].layers == (0, 1, 2)
    with pytest.raises(ValueError, match="num_state_slots is 4, but the config has no state group"):
        PagedKvCache(plain, 8, HostBackend(), num_state_slots=4)


def test_layout_configs_keep_each_layers_format_and_dims():
    config = KvCacheConfig(4, 2, 16, 3, "bf16", layer_dtypes=("bf16", "fp8", "bf16"),
                           layer_dims=((2, 16), (4, 32), (1, 16)),
                           layer_groups=(LayerGroup("full", (2, 0)), LayerGroup("sliding", (1,), window=8, block_size=2)))
    layout = GroupLayout(config)
    assert layout.group_of.tolist() == [0, 1, 0] and layout.local_of.tolist() == [1, 0, 0]
    g0, g1 = layout.group_config(0), layout.group_config(1)
    assert (g0.num_layers, g0.dims_for_layer(0), g0.dims_for_layer(1), g0.block_size) == (2, (1, 16), (2, 16), 4)
    assert (str(g1.dtype_for_layer(0)), g1.dims_for_layer(0), g1.block_size) == ("fp8", (4, 32), 2)
    assert layout.unit == 4
    # fp8 bytes: 2 tokens * 4 heads * 32 dims, K and V
    assert layout.bytes_per_block(1) == 2 * (2 * 4 * 32)
    assert layout.bytes_per_block(0) == 2 * (4 * 1 * 16 * 2) + 2 * (4 * 2 * 16 * 2)


def test_bytes_per_sequence_caps_a_sliding_group_at_its_window():
    layout = GroupLayout(hybrid_config())
    per_block = [layout.bytes_per_block(0), layout.bytes_per_block(1)]
    assert per_block == [2 * 4 * 2 * 16 * 2, 2 * 2 * 4 * 2 * 16 * 2]
    # 100 tokens: full 25 blocks, sliding min(25, 8/4 + 1 = 3), state one slot of 76 bytes
    assert [layout.bytes_per_sequence(g, 100) for g in range(3)] == [25 * per_block[0], 3 * per_block[1], 76]
    assert layout.total_bytes_per_sequence(100) == 25 * per_block[0] + 3 * per_block[1] + 76


def test_split_budget_sizes_every_group_for_the_same_sequences():
    config = hybrid_config()
    layout = GroupLayout(config)
    # a live slot and two checkpoints (the prompt end, a branch point: no checkpoint_every)
    per_seq = 25 * layout.bytes_per_block(0) + 3 * layout.bytes_per_block(1) + 3 * 76
    rows = split_budget(config, 4 * per_seq, context=100, concurrency=4)
    assert [(r.kind, r.count) for r in rows] == [("full", 100), ("sliding", 12), ("state", 12)]
    assert sum(r.bytes for r in rows) <= 4 * per_seq
    assert rows[0].bytes_per_sequence == 25 * layout.bytes_per_block(0)
    with pytest.raises(ValueError, match="does not hold one sequence"):
        split_budget(config, per_seq - 1, context=100, concurrency=1)


def test_hybrid_cache_groups_have_their_own_block_ids_and_free_lists():
    gpu = HostBackend()
    cache = PagedKvCache(hybrid_config(), [16, 8, None], gpu, num_state_slots=5)
    assert isinstance(cache, HybridKvCache) and cache.num_groups() == 3
    assert [cache.group_of_layer(layer) for layer in range(4)] == [0, 1, 1, 2]
    assert cache.layer_group_map().tolist() == [0, 1, 1, 2]
    assert [cache.num_blocks(group=g) for g in range(3)] == [16, 8, 5]
    a = cache.group(0).alloc_block()
    b = cache.group(1).alloc_block()
    assert a == b == 0  # the same id, in two groups
    assert (cache.num_free_blocks(group=0), cache.num_free_blocks(group=1)) == (15, 7)
    assert isinstance(cache.group(2), StateGroup) and cache.group(2).alloc_block() == 0
    assert cache.num_free_blocks(group=2) == 4
    with pytest.raises(AttributeError, match=r"cache.group\(g\).alloc_block"):
        cache.alloc_block()
    with pytest.raises(ValueError, match="num_blocks has 2 entries but the config has 3 groups"):
        PagedKvCache(hybrid_config(), [16, 8], gpu)
    with pytest.raises(ValueError, match=r"num_blocks\[2\] is 3, but group 2 is a 'state' group"):
        PagedKvCache(hybrid_config(), [16, 8, 3], gpu)


def test_state_slots_default_to_the_first_attention_groups_block_count():
    cache = PagedKvCache(hybrid_config(), 6, HostBackend())
    assert [cache.num_blocks(group=g) for g in range(3)] == [6, 6, 6]


def test_layer_calls_go_to_the_layers_group_and_state_round_trips():
    gpu = HostBackend()
    cache = PagedKvCache(hybrid_config(), [16, 8, None], gpu, num_state_slots=4)
    g1 = cache.group(1)
    block = g1.alloc_block()
    g1.init_blocks([block], gpu, 0)
    k = np.arange(2 * 16, dtype=np.float32).reshape(1, 2, 16) / 8
    cache.write_tokens(2, [block * 4 + 1], k, -k, gpu, 0)
    got_k, got_v = cache.read_tokens(2, [block * 4 + 1], gpu)
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, -k)
    assert cache.k_cache_ptr(2, block) == g1.k_cache_ptr(1, block)
    again_k, _ = g1.read_tokens(0, [block * 4 + 1], gpu)  # layer 1 is the group's layer 0: never written
    assert not again_k.any()
    with pytest.raises(ValueError, match="layer 3 is in state group 2"):
        cache.write_tokens(3, [0], k, k, gpu, 0)
    slot = cache.group(2).alloc_block()
    conv = (np.arange(32).reshape(4, 8) / 4).astype(BF16)
    cache.write_state(3, slot, conv, gpu, tensor=0)
    cache.write_state(3, slot, np.array([1.5, -2, 3]), gpu, tensor=1)
    other = cache.group(2).alloc_block()
    cache.copy_state([slot], [other], gpu, 0)
    np.testing.assert_array_equal(cache.read_state(3, other, gpu, 0), conv)
    np.testing.assert_array_equal(cache.read_state(3, other, gpu, 1), np.array([1.5, -2, 3], np.float32))
    assert cache.state_ptr(3, other, 1) == cache.state_pools().state_ptr(3, 0, 1).offset(other * 16)
    with pytest.raises(Exception, match="slot 3 is not held"):
        cache.copy_state([slot], [3], gpu, 0)
    with pytest.raises(ValueError, match=r"shape \(4, 8\)"):
        cache.write_state(3, slot, np.zeros((8, 4)), gpu)
    cache.release(gpu)
