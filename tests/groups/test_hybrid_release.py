"""A hybrid cache's release checks every group before it changes anything: a live DLPack
export of any group's pool or state view (or another backend, or a holder) refuses the
release with every group still live; a state view's repr never raises."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, KvCacheError, PagedKvCache, PrefixCache
from pagedkv.core.layer_groups import LayerGroup

CONFIG = KvCacheConfig(4, 1, 16, 3, "bf16", layer_groups=(
    LayerGroup("full", (0,)), LayerGroup("sliding", (1,), window=8), LayerGroup("state", (2,), state=(((4,), "float32"),))))


def world():
    gpu = HostBackend(1 << 24)
    cache = PagedKvCache(CONFIG, [8, 8, None], gpu, num_state_slots=4)
    return gpu, cache, PrefixCache(cache)


def all_live(cache):
    got = [cache.group(g).alloc_blocks(1) for g in range(3)]
    for g in range(3):
        cache.group(g).free_blocks(got[g])
    return got == [[0], [0], [0]]


def test_a_live_export_of_an_attention_pool_refuses_the_release_and_leaves_every_group_live():
    gpu, cache, prefix = world()
    consumer = np.from_dlpack(cache.group(0).k_view(0, gpu).bits_view())
    with pytest.raises(KvCacheError, match="1 DLPack export"):
        cache.release(gpu)
    assert all_live(cache) and not prefix.closed()
    del consumer
    cache.release(gpu)
    assert gpu.live_allocations() == 0


def test_a_live_export_of_a_state_view_refuses_the_release():
    gpu, cache, prefix = world()
    view = cache.state_view(2, gpu)
    consumer = np.from_dlpack(view)
    with pytest.raises(KvCacheError, match="release of state group 2 while 1 DLPack export"):
        cache.release(gpu)
    assert all_live(cache) and not prefix.closed()
    del consumer
    cache.release(gpu)
    assert gpu.live_allocations() == 0
    assert repr(view) == "StateView(layer=2, tensor=0, of a released cache)"


def test_another_backend_refuses_the_release_before_anything_changes():
    gpu, cache, prefix = world()
    with pytest.raises(KvCacheError, match="allocated on"):
        cache.release(HostBackend(1 << 20))
    assert all_live(cache) and not prefix.closed()
    cache.release(gpu)


def test_copy_state_refuses_a_checkpoint_only_the_prefix_cache_holds_and_another_backend():
    from pagedkv import SequenceTable

    gpu = HostBackend(1 << 24)
    config = KvCacheConfig(4, 1, 16, 2, "bf16", layer_groups=(
        LayerGroup("full", (0,)), LayerGroup("state", (1,), state=(((4,), "float32"),))))
    cache = PagedKvCache(config, [8, None], gpu, num_state_slots=6)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", list(range(9)))  # a checkpoint at 8, the prompt's last whole block
    (ckpt,) = np.asarray(table.checkpoint_slots(["a"])).tolist()
    (live,) = np.asarray(table.state_slots(["a"])).tolist()
    cache.copy_state([live], [ckpt], gpu, 0)  # the writer still holds it: allowed
    table.cache_prefix("a")  # the checkpoint is the prefix cache's now
    assert cache.group(1).ref_count(ckpt) == 1
    before = cache.read_state(1, ckpt, gpu).tobytes()
    with pytest.raises(KvCacheError, match=f"destination slot {ckpt} is a cached checkpoint only the prefix cache"):
        cache.copy_state([live], [ckpt], gpu, 0)
    with pytest.raises(KvCacheError, match="allocated on|live on"):
        cache.copy_state([live], [live], HostBackend(1 << 20), 0)
    with pytest.raises(KvCacheError, match="allocated on|live on"):
        cache.write_state(1, live, [0.0] * 4, HostBackend(1 << 20))
    assert cache.read_state(1, ckpt, gpu).tobytes() == before
    table.free("a")
    cache.release(gpu)
