"""HybridHostTier and parking a hybrid sequence in it: a HostTier per group (host slots for
a state group), swaps of every group in one batched copy, and swap_out / swap_in of a
sequence's blocks, live state slot and checkpoints, byte for byte, on HostBackend."""

from __future__ import annotations

import numpy as np
import pytest
from shared_helpers import HYBRID_STATE, counting_host, hybrid_tier_config

from pagedkv import (HostBackend, HostTier, HybridHostTier, KvCacheConfig, KvCacheError, KvCacheExhausted,
                     PagedKvCache, PrefixCache, SequenceTable)
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.sequences.hybrid_swap import ParkedSequence
from kernel_harness.stub import run_on_stub

STATE = HYBRID_STATE

config = hybrid_tier_config


def world(blocks=(16, 16, None), slots=8, host=(12, 12, 8), prefix=True):
    gpu = counting_host()
    cache = PagedKvCache(config(), list(blocks), gpu, num_state_slots=slots)
    pc = PrefixCache(cache) if prefix else None
    table = SequenceTable(cache, pc, gpu)
    tier = HybridHostTier(cache, [host[0], host[1], None], gpu, num_state_slots=host[2])
    return gpu, cache, pc, table, tier


def scribble(cache, gpu, seq_blocks, seq_slots, seed):
    """Write random bytes into every listed block of every layer and every listed slot."""
    rng = np.random.default_rng(seed)
    for g, blocks in seq_blocks.items():
        group = cache.group(g)
        for layer in range(group.num_layers()):
            stride = group.k_block_stride_bytes_for_layer(layer)
            for b in blocks:
                group.write_block(layer, b, rng.integers(0, 256, stride, np.uint8),
                                  rng.integers(0, 256, stride, np.uint8), gpu)
    for slot in seq_slots:
        for t, (shape, dtype) in enumerate(STATE):
            cache.write_state(2, slot, rng.standard_normal(shape).astype(dtype), gpu, tensor=t)


def snapshot(cache, gpu, seq_blocks, seq_slots):
    out = []
    for g, blocks in sorted(seq_blocks.items()):
        group = cache.group(g)
        for b in blocks:
            out.append([tuple(x.tobytes() for x in group.read_block(layer, b, gpu)) for layer in range(group.num_layers())])
    for slot in seq_slots:
        out.append([cache.read_state(2, slot, gpu, tensor=t).tobytes() for t in range(len(STATE))])
    return out


def holdings(table, seq_id):
    blocks = {g: table.blocks(seq_id, g) for g in (0, 1)}
    live = np.asarray(table.state_slots([seq_id])).tolist()
    ckpt = [s for s in np.asarray(table.checkpoint_slots([seq_id])).tolist() if s != -1]
    return blocks, live + ckpt


def test_a_host_tier_per_group_with_host_slots_for_the_state_group():
    gpu, cache, _, _, tier = world()
    assert [tier.group(g).num_blocks() for g in range(3)] == [12, 12, 8]
    assert tier.group(2).rows() == [
        {"layer": 2, "tensor": 0, "dtype": "float32", "shape": [4], "stride": 16},
        {"layer": 2, "tensor": 1, "dtype": "float16", "shape": [2, 3], "stride": 16},
    ]
    assert tier.group(0).block_bytes() == cache.group(0).config().block_bytes_kv_all_layers()
    with pytest.raises(KvCacheError, match="HostTier does not support a cache with layer_groups: use HybridHostTier"):
        HostTier(cache, 4, gpu)
    with pytest.raises(ValueError, match="no tier format"):
        HostTier(cache.group(2), 4, gpu, format="fp8")
    with pytest.raises(TypeError, match="use HostTier for a one-group cache"):
        HybridHostTier(PagedKvCache(KvCacheConfig(4, 1, 16, 1, "bf16"), 4, gpu), 4, gpu)
    tier.release(gpu)


def test_a_swap_of_every_group_is_one_batched_copy_and_round_trips():
    gpu, cache, _, _, tier = world()
    device = {0: cache.group(0).alloc_blocks(3), 1: cache.group(1).alloc_blocks(2), 2: cache.group(2).alloc_blocks(2)}
    scribble(cache, gpu, {0: device[0], 1: device[1]}, device[2], seed=1)
    before = snapshot(cache, gpu, {0: device[0], 1: device[1]}, device[2])
    host = tier.alloc({g: len(ids) for g, ids in device.items()})
    batches = gpu.batches
    tier.swap_out(device, host, 0).wait()
    assert gpu.batches == batches + 1
    back = {g: cache.group(g).alloc_blocks(len(ids)) for g, ids in device.items()}
    tier.swap_in(host, back, 0).wait()
    assert gpu.batches == batches + 2
    assert snapshot(cache, gpu, {0: back[0], 1: back[1]}, back[2]) == before
    # a refused group refuses the whole swap before anything is enqueued
    with pytest.raises(IndexError, match="host"):
        tier.swap_out({0: device[0], 2: device[2]}, {0: host[0], 2: [0, 99]}, 0)
    assert gpu.batches == batches + 2
    with pytest.raises(KvCacheExhausted):
        tier.alloc({0: 1, 2: 9})
    assert [tier.num_free_blocks(g) for g in range(3)] == [9, 10, 6]  # nothing taken


def test_a_parked_sequence_comes_back_byte_for_byte_in_fresh_blocks_and_slots(env_flags):
    env_flags(METRALE_KV_POISON="1")
    gpu, cache, prefix, table, tier = world()
    table.add("a", list(range(100, 113)))  # 13 tokens: a checkpoint at 12
    table.append("a", token_ids=[1, 2, 3])  # 16: a checkpoint at 16, step's own
    blocks, slots = holdings(table, "a")
    scribble(cache, gpu, blocks, slots, seed=2)
    (ckpt,) = np.asarray(table.checkpoint_slots(["a"])).tolist()
    pending = [s for _, s in table._seqs["a"].checkpoints[2]]
    kept = snapshot(cache, gpu, blocks, slots + [s for s in pending if s not in slots])
    free_before = [cache.num_free_blocks(g) for g in range(3)]
    batches = gpu.batches
    parked = table.swap_out("a", tier)
    assert gpu.batches == batches + 1 and isinstance(parked, ParkedSequence) and parked.num_tokens() == 16
    assert "a" not in table
    # every block and slot the sequence held is free again; its live slot was poisoned
    assert [cache.num_free_blocks(g) for g in range(3)] == [
        free_before[0] + len(blocks[0]), free_before[1] + len(blocks[1]), free_before[2] + 1 + len(pending)]
    assert (cache.read_state(2, slots[0], gpu).view(np.uint8) == 0xFF).all()
    table.check_invariants()
    # another sequence takes the freed blocks and writes over them
    table.add("b", list(range(500, 516)))
    scribble(cache, gpu, dict(zip((0, 1), holdings(table, "b")[0].values())), holdings(table, "b")[1], seed=3)
    table.swap_in(parked)
    assert gpu.batches == batches + 2 and not parked.is_parked()
    new_blocks, new_slots = holdings(table, "a")
    new_pending = [s for _, s in table._seqs["a"].checkpoints[2]]
    assert snapshot(cache, gpu, new_blocks, new_slots + [s for s in new_pending if s not in new_slots]) == kept
    assert table.num_tokens("a") == 16 and table.checkpoint_position("a") == 16
    assert [len(new_blocks[g]) for g in (0, 1)] == [len(blocks[g]) for g in (0, 1)]
    assert np.asarray(table.checkpoint_slots(["a"])).tolist()[0] in new_pending and ckpt in pending
    assert [tier.num_free_blocks(g) for g in range(3)] == [12, 12, 8]  # the host blocks went back
    table.check_invariants()
    # it carries on: a step, then its checkpoints reach the prefix cache and a new prompt hits
    table.append("a", token_ids=[4])
    table.free("a")
    assert table.add("c", list(range(100, 113)) + [1, 2, 3, 9]) == 16
    table.check_invariants()


def test_a_failed_swap_in_or_out_changes_nothing():
    gpu, cache, prefix, table, tier = world(blocks=(8, 8, None), host=(2, 12, 8), prefix=False)
    table.add("a", list(range(20)))  # 5 full blocks: more than the host tier's 2
    with pytest.raises(KvCacheExhausted):
        table.swap_out("a", tier)
    assert "a" in table and [tier.num_free_blocks(g) for g in range(3)] == [2, 12, 8]
    table.free("a")
    table.add("a", list(range(6)))
    parked = table.swap_out("a", tier)
    table.add("big", list(range(29)))  # 8 full blocks: none left for "a"
    free = [cache.num_free_blocks(g) for g in range(3)]
    with pytest.raises(KvCacheExhausted):
        table.swap_in(parked)
    assert parked.is_parked() and "a" not in table and [cache.num_free_blocks(g) for g in range(3)] == free
    table.free("big")
    table.swap_in(parked)
    with pytest.raises(KvCacheError, match="already swapped back in"):
        table.swap_in(parked)
    table.check_invariants()


def test_swaps_need_the_caches_own_tier_and_a_table_with_a_backend():
    gpu, cache, prefix, table, tier = world()
    table.add("a", list(range(6)))
    other = HybridHostTier(PagedKvCache(config(), [4, 4, None], gpu), 2, gpu)
    with pytest.raises(KvCacheError, match="another cache"):
        table.swap_out("a", other)
    with pytest.raises(TypeError, match="HybridHostTier"):
        table.swap_out("a", HostTier(cache.group(0), 2, gpu))
    bare = SequenceTable(cache, None, None)
    with pytest.raises(KvCacheError, match="need a table with a backend"):
        bare.swap_out("a", tier)
    with pytest.raises(KeyError, match="unknown sequence 'zz'"):
        table.swap_out("zz", tier)
    with pytest.raises(TypeError, match="must be a HybridDiskTier, got object"):
        PrefixCache(cache, host_tier=tier, disk_tier=object())


PARK_ON_STUB = '''
from pagedkv import HostBackend, HybridHostTier, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.driver import CudaBackend

CONFIG = KvCacheConfig(4, 1, 16, 4, "bf16", layer_groups=(
    LayerGroup("full", (0, 3)), LayerGroup("sliding", (1,), window=8),
    LayerGroup("state", (2,), state=(((4,), "float32"), ((2, 3), "float16")), checkpoint_every=8)))

def batches():
    names = [launch(i)[0].name for i in range(STUB.stub_launch_count())]
    return calls("cuMemcpyBatchAsync") + names.count(b"pagedkv_copy_batch")

def run(gpu, cuda):
    cache = PagedKvCache(CONFIG, [12, 12, None], gpu, num_state_slots=8)
    table = SequenceTable(cache, PrefixCache(cache), gpu)
    tier = HybridHostTier(cache, 8, gpu)
    table.add("a", list(range(100, 113)))
    table.append("a", token_ids=[1, 2, 3])
    rng = np.random.default_rng(4)
    rows = rng.standard_normal((16, 1, 16)).astype(np.float32)
    for layer in (0, 1, 3):
        g = cache.group_of_layer(layer)
        held, first = table.blocks("a", g), table.first_block_position("a", g) // 4
        slots = [held[p // 4 - first] * 4 + p % 4 if p // 4 >= first else -1 for p in range(16)]
        cache.write_tokens(layer, slots, rows * (layer + 1), rows - layer, gpu, gpu.default_stream())
    live, = np.asarray(table.state_slots(["a"])).tolist()
    cache.write_state(2, live, [1.5, -2, 3, 4], gpu)
    cache.write_state(2, live, np.full((2, 3), 0.25), gpu, tensor=1)
    gpu.synchronize(gpu.default_stream())
    before = batches() if cuda else 0
    parked = table.swap_out("a", tier)
    table.add("b", list(range(500, 516)))  # takes the freed blocks
    table.swap_in(parked)
    gpu.synchronize(gpu.default_stream())
    if cuda:
        assert batches() == before + 2, (before, batches())
    out = []
    for layer in (0, 1, 3):
        g = cache.group_of_layer(layer)
        for b in table.blocks("a", g):
            out.append(b"".join(x.tobytes() for x in cache.group(g).read_block(cache.local_layer(layer), b, gpu)))
    live, = np.asarray(table.state_slots(["a"])).tolist()
    out += [cache.read_state(2, live, gpu, tensor=t).tobytes() for t in (0, 1)]
    table.check_invariants()
    tier.release(gpu)
    cache.release(gpu)
    return out

host = run(HostBackend(), False)
assert len(host) == 4 + 2 + 4 + 2 and all(part.strip(b"\\0") for part in host)  # every block and slot written
with CudaBackend() as gpu:
    assert run(gpu, True) == host
print("CHECK park on stub ok")
'''


def test_parking_a_sequence_on_the_device_matches_host_backend(stub_env):
    assert "CHECK park on stub ok" in run_on_stub(stub_env, PARK_ON_STUB)


def test_the_readme_hybrid_state_example_runs():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Hybrid caches: state slots"):readme.index("## Transfer between engines")]
    examples = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    assert len(examples) == 3  # the host tier under the prefix cache, the disk tier below it, parking a sequence
    for example in examples:
        namespace: dict = {}
        exec(compile(example, "README.md", "exec"), namespace)
        gpu = namespace["gpu"]
        assert gpu.live_allocations() == 0 and gpu.live_swap_memory() == 0


def test_a_checkpoint_already_cached_is_not_parked_and_the_step_has_none_after():
    gpu, cache, prefix, table, tier = world()
    table.add("a", [1, 2, 3, 4, 5])  # the add step's checkpoint at 4
    (ckpt,) = np.asarray(table.checkpoint_slots(["a"])).tolist()
    cache.write_state(2, ckpt, [4, 3, 2, 1], gpu)
    table.cache_prefix("a")  # the checkpoint now belongs to the prefix cache
    parked = table.swap_out("a", tier)
    assert len(parked.host[2]) == 1  # the live slot only
    table.swap_in(parked)
    assert np.asarray(table.checkpoint_slots(["a"])).tolist() == [-1] and table.checkpoint_position("a") == -1
    table.check_invariants()
    table.add("b", [1, 2, 3, 4, 9])
    (live,) = np.asarray(table.state_slots(["b"])).tolist()
    assert cache.read_state(2, live, gpu).tolist() == [4, 3, 2, 1]  # the cached checkpoint, not the parked copy


class DropsTheLastRange(HostBackend):
    """A batched copy that forgets its last range (the state group's, in a hybrid swap)."""

    def copy_batch_async(self, dsts, srcs, sizes, stream):
        super().copy_batch_async(dsts[:-1], srcs[:-1], sizes[:-1], stream)


def test_the_park_conformance_rule_fails_on_a_planted_defect():
    from pagedkv.testing import backend_conformance

    report = backend_conformance(lambda: DropsTheLastRange(capacity_bytes=1 << 26), only=["hybrid_park"])
    assert report["hybrid_park"].status == "failed" and "differs from HostBackend after swap_in" in (
        report["hybrid_park"].reason), report["hybrid_park"].reason
