"""pagedkv.tiers: KV beyond one cache's device pools. `HostTier` (`host_tier`): host blocks
in the device pools' layout (or a smaller format, `tier_codec`), filled and read back by
batched swaps, and `HybridHostTier` (`hybrid_host_tier`) a HostTier per group of a hybrid
cache; `DiskTier` (`disk_tier`, with `disk_layout`, `disk_index`, `disk_io`): slots
in a directory below a host tier, kept across restarts, and `HybridDiskTier`
(`hybrid_disk_tier`) a DiskTier per group of a hybrid cache; `KvTransfer`
(`transfer`, composed of `transfer_peers`, `transfer_send`, `transfer_notify`, `pull_mode`
and `transfer_grants`): blocks written into another engine's cache over NIXL (optional
dependency, imported lazily), `HybridKvTransfer` (`hybrid_transfer`, with `hybrid_grouping`,
`hybrid_wire`, `hybrid_pull`, `hybrid_grants`) one per group of a hybrid cache, across TP
sizes, pushed or pulled, under grants.

May import: `pagedkv.cache`, `pagedkv.groups`, `pagedkv.kv`, `pagedkv.interop`, `pagedkv.backends`, `pagedkv.core`,
`pagedkv.errors`.
"""
