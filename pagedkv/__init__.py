"""pagedkv: a paged KV cache for framework-free LLM inference engines.

Importing pagedkv touches no GPU and loads no CUDA library; `pagedkv.driver` does that
lazily when its backend is constructed. Every error pagedkv raises on its own account
derives from `PagedKvError`.
"""

from .allocator import BlockAllocator, BlockReclaimer
from .backend import NULL, Bf16Stats, BlockRegions, DevicePtr, GpuBackend
from .cache import POISON_BYTE, PagedKvCache
from .capabilities import BackendFeatureMissing
from .config import KvCacheConfig
from .device_array import DeviceArray
from .dtype import GROUP_SIZE, SIDE_FORMATS, KvCacheDtype, SideFormat, accepted_names, side_bytes
from .elastic_allocator import ElasticBlockAllocator
from .env import EnvFlags, flags
from .errors import (
    DeviceMemoryError,
    DeviceOutOfMemory,
    KvCacheError,
    KvCacheExhausted,
    PagedKvError,
    RefCountError,
    TeardownError,
)
from .guard import ConcurrentUseError
from .host_backend import HostBackend
from .host_tier import HostTier, SwapHandle
from .kv_rows import SKIP_SLOT
from .pools import ElasticMapping, KvPools
from .prefix_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PrefixCache,
    PrefixCacheEvent,
    PrefixCacheStats,
    PrefixMatch,
    TieredMatch,
    chain_hash,
    root_hash,
)
from .sequence_table import Exported, PageTable, SequenceTable
from .teardown import ModelResource, Teardown
from .validate import MAX_TOKEN_ID, token_ids

__version__ = "0.1.0"

__all__ = [
    "AllBlocksCleared",
    "BackendFeatureMissing",
    "Bf16Stats",
    "BlockAllocator",
    "BlockReclaimer",
    "BlockRegions",
    "BlockRemoved",
    "BlockStored",
    "ConcurrentUseError",
    "DeviceArray",
    "DeviceMemoryError",
    "DeviceOutOfMemory",
    "DevicePtr",
    "ElasticBlockAllocator",
    "ElasticMapping",
    "EnvFlags",
    "Exported",
    "GROUP_SIZE",
    "GpuBackend",
    "HostBackend",
    "HostTier",
    "KvCacheConfig",
    "KvCacheDtype",
    "KvCacheError",
    "KvCacheExhausted",
    "KvPools",
    "MAX_TOKEN_ID",
    "ModelResource",
    "NULL",
    "POISON_BYTE",
    "PageTable",
    "PagedKvCache",
    "PagedKvError",
    "PrefixCache",
    "PrefixCacheEvent",
    "PrefixCacheStats",
    "PrefixMatch",
    "RefCountError",
    "SIDE_FORMATS",
    "SKIP_SLOT",
    "SequenceTable",
    "SideFormat",
    "SwapHandle",
    "Teardown",
    "TeardownError",
    "TieredMatch",
    "accepted_names",
    "chain_hash",
    "flags",
    "root_hash",
    "side_bytes",
    "token_ids",
]
