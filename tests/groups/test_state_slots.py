"""State slots on HostBackend: zero, poison and init fills over every layer and tensor, the
table's METRALE_KV_POISON rule for freed and fresh checkpoint slots, and the exact state
checksums (bfloat16 and float32 by value, other dtypes by byte)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from structlog.testing import capture_logs

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.groups.state_checksums import summed_over

BF16 = np.dtype(ml_dtypes.bfloat16)
STATE = (((4, 8), BF16), ((3,), "float32"), ((2,), "float64"))
SLOTS = 6


def make(gpu, slots=SLOTS, every=None):
    config = KvCacheConfig(4, 1, 16, 3, "bf16", layer_groups=(
        LayerGroup("full", (0,)),
        LayerGroup("state", (1, 2), state=STATE, checkpoint_every=every),
    ))
    return PagedKvCache(config, [16, None], gpu, num_state_slots=slots)


def values(seed: int, tensor: int) -> np.ndarray:
    """Non-dyadic random values of state tensor `tensor` (a naive float sum would round)."""
    shape, dtype = STATE[tensor]
    return (np.random.default_rng(seed).standard_normal(shape) * 3).astype(dtype)


def fill_known(cache, gpu, slots):
    """Write distinct values into every listed slot of every layer and tensor; return them."""
    known = {}
    for layer in (1, 2):
        for slot in slots:
            for t in range(len(STATE)):
                known[layer, slot, t] = values(100 * layer + 10 * slot + t, t)
                cache.write_state(layer, slot, known[layer, slot, t], gpu, tensor=t)
    return known


def raw(cache, gpu, layer, slot, t):
    return cache.read_state(layer, slot, gpu, tensor=t).view(np.uint8).reshape(-1)


# -- zero, poison, init -----------------------------------------------------------------


def test_poison_and_zero_fill_only_the_listed_slots_in_every_layer_and_tensor(gpu):
    cache = make(gpu)
    group = cache.group(1)
    held = group.alloc_blocks(SLOTS)
    known = fill_known(cache, gpu, held)
    group.poison_slots([1, 4], gpu, 0)
    group.zero_slots([2], gpu, 0)
    for (layer, slot, t), want in known.items():
        got = raw(cache, gpu, layer, slot, t)
        if slot in (1, 4):
            assert (got == 0xFF).all(), (layer, slot, t)
        elif slot == 2:
            assert (got == 0).all(), (layer, slot, t)
        else:
            assert got.tobytes() == want.tobytes(), (layer, slot, t)
    assert np.isnan(cache.read_state(1, 4, gpu, tensor=0).astype(np.float32)).all()  # 0xFFFF: a bf16 NaN
    with pytest.raises(IndexError, match="state slot 6"):
        group.poison_slots([0, 6], gpu, 0)
    assert raw(cache, gpu, 1, 0, 0).tobytes() == known[1, 0, 0].tobytes()  # nothing was filled


def test_init_slots_zero_unless_kv_poison_is_on(gpu, env_flags):
    cache = make(gpu)
    group = cache.group(1)
    held = group.alloc_blocks(2)
    fill_known(cache, gpu, held)
    group.init_slots([0], gpu, 0)
    assert all((raw(cache, gpu, layer, 0, t) == 0).all() for layer in (1, 2) for t in range(3))
    env_flags(METRALE_KV_POISON="1")
    group.init_slots([1], gpu, 0)
    assert all((raw(cache, gpu, layer, 1, t) == 0xFF).all() for layer in (1, 2) for t in range(3))


def _table(gpu, every=None):
    cache = make(gpu, slots=8, every=every)
    prefix = PrefixCache(cache)
    return cache, prefix, SequenceTable(cache, prefix, gpu)


def test_under_kv_poison_the_table_poisons_freed_live_slots_and_fresh_checkpoints(env_flags):
    env_flags(METRALE_KV_POISON="1")
    gpu = HostBackend()
    cache, prefix, table = _table(gpu)
    table.add("a", list(range(9)))  # a prompt checkpoint at 8
    (live,) = np.asarray(table.state_slots(["a"])).tolist()
    (ckpt,) = np.asarray(table.checkpoint_slots(["a"])).tolist()
    for t in range(3):  # the live slot starts from the zero state; the checkpoint is unwritten: poisoned
        assert (raw(cache, gpu, 1, live, t) == 0).all() and (raw(cache, gpu, 2, ckpt, t) == 0xFF).all()
    written = fill_known(cache, gpu, [live, ckpt])
    table.free("a")  # the checkpoint goes to the prefix cache; the live slot is free
    for layer in (1, 2):
        for t in range(3):
            assert (raw(cache, gpu, layer, live, t) == 0xFF).all()
            assert raw(cache, gpu, layer, ckpt, t).tobytes() == written[layer, ckpt, t].tobytes()
    assert prefix.num_cached(1) == 1
    # a sequence that never caches its checkpoint frees it: poisoned too
    table.add("b", [7, 7, 7, 7, 7])
    (ckpt_b,) = np.asarray(table.checkpoint_slots(["b"])).tolist()
    cache.write_state(1, ckpt_b, values(1, 1), gpu, tensor=1)
    prefix.close()
    table.free("b")
    assert (raw(cache, gpu, 1, ckpt_b, 1) == 0xFF).all()
    table.check_invariants()


def test_without_kv_poison_freed_slots_keep_their_bytes_and_checkpoints_start_at_zero(env_flags):
    env_flags(METRALE_KV_POISON="0")
    gpu = HostBackend()
    cache, prefix, table = _table(gpu)
    table.add("a", list(range(9)))
    (live,) = np.asarray(table.state_slots(["a"])).tolist()
    (ckpt,) = np.asarray(table.checkpoint_slots(["a"])).tolist()
    assert (raw(cache, gpu, 2, ckpt, 0) == 0).all()
    written = fill_known(cache, gpu, [live])
    table.free("a")
    assert raw(cache, gpu, 2, live, 2).tobytes() == written[2, live, 2].tobytes()


# -- checksums --------------------------------------------------------------------------


def _expected(arrays, over):
    if over == "bytes":
        x = np.concatenate([a.view(np.uint8).reshape(-1) for a in arrays]).astype(np.float64)
    else:
        x = np.concatenate([a.astype(np.float64).reshape(-1) for a in arrays])
    return math.fsum(x.tolist()), math.fsum((x * x).tolist()), math.fsum(np.abs(x).tolist())


def test_state_checksums_are_exact_per_layer_and_tensor(gpu):
    cache = make(gpu)
    held = cache.group(1).alloc_blocks(SLOTS)
    known = fill_known(cache, gpu, held)
    slots = [4, 0, 3]
    with capture_logs() as logs:
        cache.debug_state_checksum_per_layer(slots, gpu, 0, "probe")
    events = [e for e in logs if e["event"] == "state_checksum"]
    assert [(e["layer"], e["tensor"], e["over"]) for e in events] == [
        (1, 0, "values"), (1, 1, "values"), (1, 2, "bytes"), (2, 0, "values"), (2, 1, "values"), (2, 2, "bytes")]
    for e in events:
        want = _expected([known[e["layer"], s, e["tensor"]] for s in slots], e["over"])
        assert (e["sum"], e["ssq"], e["sabs"]) == want, e
        assert e["tag"] == "probe" and e["group"] == 1 and e["nslot"] == 3
    # cancellation a float64 accumulation loses: the exact sum keeps the 1
    cache.write_state(1, 4, np.array([2.0**60, 1.0, -(2.0**60)], np.float32), gpu, tensor=1)
    with capture_logs() as logs:
        cache.debug_state_checksum_per_layer([4], gpu, 0, "cancel")
    (event,) = [e for e in logs if e["event"] == "state_checksum" and e["layer"] == 1 and e["tensor"] == 1]
    assert (event["sum"], event["sabs"]) == (1.0, 2.0**61 + 1)


def test_per_slot_checksums_and_a_poisoned_slot_reads_nan(gpu):
    cache = make(gpu)
    group = cache.group(1)
    held = group.alloc_blocks(SLOTS)
    known = fill_known(cache, gpu, held)
    group.poison_slots([5], gpu, 0)
    with capture_logs() as logs:
        cache.debug_state_per_slot(2, [3, 5], gpu, 0, "slots")
    events = [e for e in logs if e["event"] == "state_slot_checksum"]
    assert [(e["logical"], e["slot"], e["layer"]) for e in events] == [(0, 3, 2), (1, 5, 2)]
    assert events[0]["ssq"] == [_expected([known[2, 3, t]], summed_over(STATE[t][1]))[1] for t in range(3)]
    assert math.isnan(events[1]["ssq"][0]) and math.isnan(events[1]["ssq"][1])  # 0xFF bf16 and float32: NaN
    assert events[1]["ssq"][2] == 8 * 2 * 255.0**2  # float64 is summed by byte: 16 bytes of 0xFF


def test_checksum_refusals_name_the_bad_value_and_emit_nothing(gpu):
    cache = make(gpu)
    with capture_logs() as logs:
        with pytest.raises(IndexError, match="state slot 9"):
            cache.debug_state_checksum_per_layer([0, 9], gpu, 0, "x")
        with pytest.raises(ValueError, match="group 0 is a 'full' group"):
            cache.debug_state_per_slot(0, [0], gpu, 0, "x")
        with pytest.raises(TypeError, match="state slots must be a sequence"):
            cache.debug_state_per_slot(1, 3, gpu, 0, "x")
    assert [e for e in logs if e["event"].startswith("state_")] == []


def test_summed_over_follows_the_dtype():
    assert [summed_over(d) for d in (BF16, "float16", "float32", "uint16", "float64", "int32", "bool")] == [
        "values", "values", "values", "values", "bytes", "bytes", "bytes"]
