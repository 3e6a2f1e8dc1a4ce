"""pagedkv.cache: `PagedKvCache`, where the bookkeeping meets the memory. It composes a
`BlockAllocator` (or `ElasticBlockAllocator`) from `pagedkv.core` with the `KvPools` of
`pagedkv.kv`, keeps the seed API's method names, and checks that only blocks the caller
holds are written. `HybridKvCache` (`hybrid_cache`) is the cache of a config with layer
groups: a PagedKvCache per attention group and the state groups' slot pools (`pagedkv.groups`).

May import: `pagedkv.groups`, `pagedkv.kv`, `pagedkv.interop`, `pagedkv.backends`, `pagedkv.codecs`,
`pagedkv.core`, `pagedkv.errors`.
"""

from .hybrid_cache import HybridKvCache, StateGroup
from .paged_cache import POISON_BYTE, PagedKvCache

__all__ = ["POISON_BYTE", "HybridKvCache", "PagedKvCache", "StateGroup"]
