"""pagedkv.tiers: KV beyond one cache's device pools. `HostTier` (`host_tier`): host blocks
in the device pools' layout, filled and read back by batched swaps; `KvTransfer`
(`transfer`): blocks written into another engine's cache over NIXL (optional dependency,
imported lazily).

May import: `pagedkv.cache`, `pagedkv.kv`, `pagedkv.interop`, `pagedkv.backends`, `pagedkv.core`,
`pagedkv.errors`.
"""
