"""Duplicate slots in a device write (issue 19): on a GPU two CTAs writing one slot tear the
row, where the harness shows a whole one. Under METRALE_KV_TRACE=1 a device check runs before
each device write (per layer and a plan's one launch) and the next sync point,
`take_nonfinite_inputs`, raises DuplicateSlotError naming the slot; without debug mode nothing
is checked on the device (documented); host slots are always refused before anything is
written. Over the libcuda stub."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache

from kernel_harness.stub import run_on_stub

BODY = '''
import os
from pagedkv import DeviceArray, KvCacheConfig, PagedKvCache
from pagedkv.driver import CudaBackend
from pagedkv.kv.device_path import DuplicateSlotError
DEBUG = os.environ.get("METRALE_KV_TRACE") == "1"
with CudaBackend() as gpu:
    stream = gpu.create_stream()
    config = KvCacheConfig(block_size=16, num_kv_heads=1, head_dim=64, num_layers=2, dtype="turbo4k_turbo3v")
    cache = PagedKvCache(config, 4, gpu)
    cache.alloc_blocks(4)
    rows = gpu.alloc(4 * 4 * 64)
    gpu.memset_async(rows, 0, 4 * 4 * 64, stream)
    slot_buf = gpu.alloc(32)
    k = DeviceArray(rows, (4, 1, 64), "float32")
    slots = DeviceArray(slot_buf, (4,), "int64")
    plan = cache.plan_layer_writes([0, 1], [k, k], [k, k], gpu)
    for values, dup in (([3, 9, -1, 40], None), ([3, 40, 9, 40], 40), ([7, 7, 7, 2], 7)):
        pinned = gpu.alloc_pinned(32)
        pinned.array[:] = np.asarray(values, np.int64).view(np.uint8)
        gpu.copy_h2d_async(pinned, slot_buf, stream)
        for write in (lambda: cache.write_tokens(0, slots, k, k, gpu, stream), lambda: plan.write(slots, stream)):
            for _ in range(2):            # the second call takes the prepared launch
                write()
                try:
                    assert cache.take_nonfinite_inputs(gpu, stream) == 0
                    found = None
                except DuplicateSlotError as err:
                    found = err
                if DEBUG and dup is not None:
                    assert found is not None and f"slot {dup} was named by two tokens" in str(found), found
                else:
                    assert found is None, found
        pinned.free()
    plan.close()
    gpu.free(rows); gpu.free(slot_buf)
    cache.release(gpu)
    gpu.destroy_stream(stream)
print("ok")
'''


@pytest.mark.parametrize("debug", [True, False])
def test_duplicate_device_slots_raise_at_the_next_sync_point_in_debug_mode(stub_env, debug):
    env = dict(stub_env)
    if debug:
        env["METRALE_KV_TRACE"] = "1"
    else:
        env.pop("METRALE_KV_TRACE", None)
    assert "ok" in run_on_stub(env, BODY)


def test_duplicate_host_slots_are_refused_before_anything_is_written():
    gpu = HostBackend(1 << 26)
    cache = PagedKvCache(KvCacheConfig(block_size=16, num_kv_heads=1, head_dim=64, num_layers=1, dtype="nvfp4"), 2, gpu)
    cache.alloc_blocks(2)
    before = cache.read_block(0, 0, gpu)
    rows = np.ones((3, 1, 64), np.float32)
    with pytest.raises(ValueError, match="slot 5 appears more than once"):
        cache.write_tokens(0, [5, 1, 5], rows, rows, gpu, 0)
    after = cache.read_block(0, 0, gpu)
    assert all((a == b).all() for a, b in zip(before, after))
    cache.release(gpu)
