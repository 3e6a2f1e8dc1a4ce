"""pagedkv: a paged KV cache for framework-free LLM inference engines.

Importing pagedkv touches no GPU and loads no CUDA library; `pagedkv.driver` does that
lazily when its backend is constructed.
"""

from .backend import NULL, Bf16Stats, BlockRegions, DevicePtr, GpuBackend
from .cache import POISON_BYTE, PagedKvCache
from .config import KvCacheConfig
from .dtype import GROUP_SIZE, KvCacheDtype, accepted_names, side_bytes
from .env import EnvFlags, flags, reload_flags
from .errors import (
    DeviceMemoryError,
    DeviceOutOfMemory,
    KvCacheError,
    KvCacheExhausted,
    RefCountError,
    TeardownError,
)
from .host_backend import HostBackend
from .teardown import ModelResource, Teardown
from .guard import ConcurrentUseError
from .prefix_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PrefixCache,
    PrefixCacheStats,
    PrefixMatch,
)
from .sequence_table import Exported, PageTable, SequenceTable

__version__ = "0.1.0"

__all__ = [
    "ConcurrentUseError",
    "NULL",
    "POISON_BYTE",
    "GROUP_SIZE",
    "Bf16Stats",
    "BlockRegions",
    "DeviceMemoryError",
    "DeviceOutOfMemory",
    "DevicePtr",
    "EnvFlags",
    "GpuBackend",
    "HostBackend",
    "KvCacheConfig",
    "KvCacheDtype",
    "KvCacheError",
    "KvCacheExhausted",
    "ModelResource",
    "PagedKvCache",
    "RefCountError",
    "Teardown",
    "TeardownError",
    "accepted_names",
    "flags",
    "reload_flags",
    "side_bytes",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Exported",
    "PageTable",
    "PrefixCache",
    "PrefixCacheStats",
    "PrefixMatch",
    "SequenceTable",
]
