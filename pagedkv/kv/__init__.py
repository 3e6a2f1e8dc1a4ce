"""pagedkv.kv: the KV data path over a backend's memory. `KvPools` (`pools`: every layer's K
and V pool, strides and the block-region table), K/V token rows encoded into slots and
decoded back (`rows`), their one-launch device path (`device_path`), the multi-layer
prefill write (`prefill`), exact-checksum diagnostics (`diagnostics`) and the accuracy
table of the formats (`quality`). The byte codecs themselves are `pagedkv.codecs`.

Nothing here keeps reference counts: the functions take the pools and the blocks the
caller vouches for. `pagedkv.cache` joins this path to the allocator.

May import: `pagedkv.backends`, `pagedkv.codecs`, `pagedkv.core`, `pagedkv.driver` (the
device path's kernel argument types), `pagedkv.interop`, `pagedkv.errors`.
"""
