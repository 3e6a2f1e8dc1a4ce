"""pagedkv.sequences: sequences and prefix reuse over one `PagedKvCache`.

`PrefixCache` (`prefix_cache`) is a facade over four parts, each replaceable on its own:
the radix tree of whole blocks and its walk (`tree`), chained hashes (`hashing`) and events
(`events`), the eviction policy (`eviction`: LRU today, one object a retention policy can
replace), and the host-tier demotion and promotion (`tiering`; the disk tier's in
`disk_tiering`); the class itself is composed of mixins (`prefix_insert`, `prefix_eviction`,
`prefix_tiers`, `prefix_queries`), as `HybridPrefixCache` (`hybrid_prefix`) is of `hybrid_match`,
`hybrid_store`, `hybrid_eviction`, `hybrid_events` and `hybrid_queries`. `SequenceTable`
(`sequence_table`) keeps per-sequence block tables; its kernel exports live in `exports`,
its batched decode append (`append_decode`) in `decode_step`, and its side of the reserve/confirm protocol with the prefix cache in `reuse`.
`HybridSequenceTable` (`hybrid_table`) is composed of `hybrid_alloc`, `hybrid_add`, `hybrid_append`,
`hybrid_decode_step`, `hybrid_offers` and `hybrid_table_queries` (its records in `hybrid_records`).

May import: `pagedkv.tiers`, `pagedkv.cache`, `pagedkv.groups`, `pagedkv.kv`, `pagedkv.interop`,
`pagedkv.backends`, `pagedkv.core`, `pagedkv.errors`.
"""
