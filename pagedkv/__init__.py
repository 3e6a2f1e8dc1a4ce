"""pagedkv: a paged KV cache for framework-free LLM inference engines.

Importing pagedkv touches no GPU and loads no CUDA library; `pagedkv.driver` does that
lazily when its backend is constructed. Every error pagedkv raises on its own account
derives from `PagedKvError`.

The code lives in sub-packages named for the architecture (docs/ARCHITECTURE.md): `core`,
`backends`, `driver`, `codecs`, `interop`, `kv`, `cache`, `tiers`, `sequences`, plus `cli`
and `testing`. The flat module paths of earlier releases (`pagedkv.prefix_cache`,
`pagedkv.sequence_table`, `pagedkv.host_tier`, `pagedkv.transfer`, `pagedkv.views`,
`pagedkv.config`, `pagedkv.log`, ... : every key of `MOVED_MODULES`) still import: each
is the module that now holds the code, the same object, imported on first use.
"""

import importlib
import importlib.abc
import importlib.util
import sys

from .backends.capabilities import BackendFeatureMissing
from .backends.host import HostBackend
from .backends.protocol import NULL, Bf16Stats, BlockRegions, DevicePtr, GpuBackend
from .cache.paged_cache import POISON_BYTE, PagedKvCache
from .core.allocator import BlockAllocator, BlockReclaimer
from .core.config import KvCacheConfig
from .core.dtype import GROUP_SIZE, SIDE_FORMATS, KvCacheDtype, SideFormat, accepted_names, side_bytes
from .core.elastic_allocator import ElasticBlockAllocator
from .core.env import EnvFlags, flags
from .core.guard import ConcurrentUseError
from .core.teardown import ModelResource, Teardown
from .core.validate import MAX_TOKEN_ID, token_ids
from .errors import (
    ChunkNotMapped,
    DeviceMemoryError,
    DeviceOutOfMemory,
    KvCacheError,
    KvCacheExhausted,
    PagedKvError,
    RefCountError,
    TeardownError,
)
from .interop.device_array import DeviceArray
from .kv.pools import ElasticMapping, KvPools
from .kv.rows import SKIP_SLOT
from .sequences.prefix_cache import (
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
from .sequences.sequence_table import Exported, PageTable, SequenceTable
from .tiers.disk_layout import DiskLayoutMismatch
from .tiers.disk_tier import DiskTier, DiskTierStats
from .tiers.host_tier import HostTier, SwapHandle
from .tiers.hybrid_disk_tier import HybridDiskTier
from .tiers.hybrid_host_tier import HybridHostTier

MOVED_MODULES = {
    "allocator": "core.allocator",
    "backend": "backends.protocol",
    "batch_ranges": "backends.batch_ranges",
    "capabilities": "backends.capabilities",
    "config": "core.config",
    "device_array": "interop.device_array",
    "diagnostics": "kv.diagnostics",
    "dlpack": "interop.dlpack",
    "dtype": "core.dtype",
    "elastic_allocator": "core.elastic_allocator",
    "env": "core.env",
    "exact_sum": "core.exact_sum",
    "guard": "core.guard",
    "host_backend": "backends.host",
    "host_tier": "tiers.host_tier",
    "host_vmm": "backends.host_vmm",
    "kv_device": "kv.device_path",
    "kv_prefill": "kv.prefill",
    "kv_rows": "kv.rows",
    "log": "core.log",
    "pools": "kv.pools",
    "prefix_cache": "sequences.prefix_cache",
    "quality": "kv.quality",
    "sequence_table": "sequences.sequence_table",
    "streams": "core.streams",
    "teardown": "core.teardown",
    "trace": "core.trace",
    "transfer": "tiers.transfer",
    "validate": "core.validate",
    "views": "interop.views",
}
"""Old flat module name -> where its code lives now (both relative to `pagedkv`). `pagedkv.cache`
was the module of `PagedKvCache` and is now its package, exporting the same names."""


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `pagedkv.<old name>` as the module of `MOVED_MODULES[old name]`: the same
    module object under both names, so state and monkeypatches are shared."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{MOVED_MODULES[spec.name.rpartition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system overwrites it; exec_module puts it back
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())


def __getattr__(name: str):
    """`pagedkv.<old module name>` without an import statement, as before the move."""
    if name in MOVED_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "ChunkNotMapped",
    "ConcurrentUseError",
    "DeviceArray",
    "DeviceMemoryError",
    "DeviceOutOfMemory",
    "DevicePtr",
    "DiskLayoutMismatch",
    "DiskTier",
    "DiskTierStats",
    "ElasticBlockAllocator",
    "ElasticMapping",
    "EnvFlags",
    "Exported",
    "GROUP_SIZE",
    "GpuBackend",
    "HostBackend",
    "HostTier",
    "HybridDiskTier",
    "HybridHostTier",
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
