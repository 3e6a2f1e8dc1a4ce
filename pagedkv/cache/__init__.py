"""pagedkv.cache: `PagedKvCache`, where the bookkeeping meets the memory. It composes a
`BlockAllocator` (or `ElasticBlockAllocator`) from `pagedkv.core` with the `KvPools` of
`pagedkv.kv`, keeps the seed API's method names, and checks that only blocks the caller
holds are written.

May import: `pagedkv.kv`, `pagedkv.interop`, `pagedkv.backends`, `pagedkv.codecs`,
`pagedkv.core`, `pagedkv.errors`.
"""

from .paged_cache import POISON_BYTE, PagedKvCache

__all__ = ["POISON_BYTE", "PagedKvCache"]
