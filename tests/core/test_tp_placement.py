"""KvCacheConfig(tp_rank=, tp_size=): which global heads a rank holds; MLA replicated."""

from __future__ import annotations

import pytest

from pagedkv import KvCacheConfig

BASE = dict(block_size=4, head_dim=16, num_layers=2, dtype="bf16")


def test_head_ranges_of_every_rank_tile_the_global_heads():
    for tp_size, heads in ((1, 8), (2, 4), (4, 2), (8, 1)):
        ranges = [KvCacheConfig(**BASE, num_kv_heads=heads, tp_rank=r, tp_size=tp_size).head_range(1)
                  for r in range(tp_size)]
        assert ranges == [(r * heads, (r + 1) * heads, 8) for r in range(tp_size)]


def test_per_layer_dims_and_mla_replication():
    config = KvCacheConfig(**BASE, num_kv_heads=2, layer_dims=((4, 16),), tp_rank=3, tp_size=4)
    assert config.head_range(0) == (12, 16, 16) and config.head_range(1) == (6, 8, 8)
    mla = KvCacheConfig(**{**BASE, "num_layers": 1}, num_kv_heads=1, v_aliases_k=True, tp_rank=2, tp_size=4)
    assert mla.head_range(0) == (0, 1, 1)


@pytest.mark.parametrize("kw, message", [
    ({"tp_size": 0}, "tp_size must be a positive int"),
    ({"tp_size": 2**10 + 1}, "tp_size is 1025, past the bound of 1024"),
    ({"tp_rank": 2, "tp_size": 2}, r"tp_rank must be an int in \[0, 2\) for tp_size 2, got 2"),
    ({"tp_rank": -1}, r"tp_rank must be an int in \[0, 1\) for tp_size 1, got -1"),
    ({"tp_rank": True, "tp_size": 2}, "got True"),
])
def test_bad_placement_is_refused_naming_it(kw, message):
    with pytest.raises(ValueError, match=message):
        KvCacheConfig(**BASE, num_kv_heads=2, **kw)
