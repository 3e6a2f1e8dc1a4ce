"""`pagedkv quality --tier`: the error each tier pairing adds, computed as HostTier(format=...)
moves the bytes (checked against a real swap out and back), with the CLI's table."""

from __future__ import annotations

import numpy as np

from pagedkv import HostBackend, KvCacheConfig, KvCacheDtype, PagedKvCache
from pagedkv.cli import main
from pagedkv.codecs import decode
from pagedkv.kv.quality import _rel_mse, format_tier_table, synthetic_kv, tier_table
from pagedkv.tiers.host_tier import HostTier


def test_the_table_is_what_a_host_tier_round_trip_does():
    tokens, heads, head_dim = 16, 2, 64
    rows = {(str(r.device), str(r.tier)): r for r in tier_table(tokens, heads, head_dim, 3)}
    k, v, _ = synthetic_kv(tokens, heads, head_dim, 3)
    gpu = HostBackend(capacity_bytes=1 << 26)
    config = KvCacheConfig(block_size=tokens, num_kv_heads=heads, head_dim=head_dim, num_layers=1, dtype="bf16")
    cache = PagedKvCache(config, 2, gpu)
    tier = HostTier(cache, 1, gpu, format="turbo4k_turbo3v")
    try:
        block = cache.alloc_blocks(1)
        cache.write_tokens(0, np.arange(tokens), k, v, gpu, 0)
        held_k, held_v = (decode(x.tobytes(), "bf16", tokens, heads, head_dim) for x in cache.read_block(0, 0, gpu))
        tier.swap_out(block, tier.alloc(1), 0).wait()
        tier.swap_in([0], cache.alloc_blocks(1), 0).wait()
        back_k, back_v = (decode(x.tobytes(), "bf16", tokens, heads, head_dim) for x in cache.read_block(0, 1, gpu))
        row = rows["bf16", "turbo4k_turbo3v"]
        assert row.k_rel_mse == _rel_mse(back_k, held_k) and row.v_rel_mse == _rel_mse(back_v, held_v)
        assert row.ratio == 4.0
    finally:
        tier.release(gpu)
        cache.release(gpu)
    assert rows["bf16", "bf16k_turbo4v"].k_rel_mse == 0.0  # K stays bf16
    assert rows["fp8", "fp8k_turbo2v"].k_rel_mse == 0.0
    assert ("fp8", "bf16") not in rows and ("bf16", "bf16") not in rows  # only smaller formats
    assert rows["bf16", "turbo8"].k_rel_mse < rows["bf16", "turbo4"].k_rel_mse < rows["bf16", "turbo2"].k_rel_mse
    assert {str(r.device) for r in rows.values()} == {"bf16", "fp8"}
    assert len(rows) == 15 + 10


def test_the_cli_prints_the_tier_table(capsys):
    assert main(["quality", "--tier", "--tokens", "16", "--heads", "2", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("the error a tier format adds")
    assert out[2:] == format_tier_table(tier_table(16, 2, 64, 0)).splitlines()
    assert out[4].split()[:3] == ["bf16", "fp8", "2.00x"]
    assert len(out) == 2 + 2 + 25
    assert KvCacheDtype.parse("bf16") is KvCacheDtype.BF16
