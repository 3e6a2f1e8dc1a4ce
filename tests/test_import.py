"""Importing pagedkv needs no GPU, loads no CUDA library (nor ml_dtypes, until bf16/fp8 arrays are
used), and exposes every public name."""

import inspect
import json
import os
import subprocess
import sys

import pytest

import pagedkv

ISSUE_NAMES = [
    "PagedKvCache",
    "KvCacheConfig",
    "KvCacheDtype",
    "HostBackend",
    "DevicePtr",
    "Teardown",
    "ModelResource",
    "GpuBackend",
    "BlockRegions",
    "Bf16Stats",
    "KvCacheError",
    "KvCacheExhausted",
    "RefCountError",
    "DeviceMemoryError",
    "DeviceOutOfMemory",
    "TeardownError",
    "POISON_BYTE",
]

PROBE = """
import json, sys
import pytest

import pagedkv
ml_dtypes_at_import = "ml_dtypes" in sys.modules  # (0.5 s to import: loaded on first use of bf16/fp8 arrays)
from pagedkv import HostBackend, KvCacheConfig, PagedKvCache
gpu = HostBackend(1 << 20)
cache = PagedKvCache(KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16"), 2, gpu)
cache.release(gpu)
maps = open("/proc/self/maps").read()
print("RESULT " + json.dumps({
    "libcuda": "libcuda" in maps,
    "libnvrtc": "libnvrtc" in maps,
    "modules": sorted(m for m in sys.modules if m.startswith(("cuda", "torch", "cupy"))),
    "ml_dtypes_at_import": ml_dtypes_at_import,
}))
"""


def test_import_loads_no_cuda_library():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    assert json.loads(line[len("RESULT "):]) == {"libcuda": False, "libnvrtc": False, "modules": [],
                                                 "ml_dtypes_at_import": False}


def test_issue_names_are_exported():
    for name in ISSUE_NAMES:
        assert name in pagedkv.__all__, name
        assert getattr(pagedkv, name) is not None


def test_all_names_resolve_and_are_documented():
    for name in pagedkv.__all__:
        obj = getattr(pagedkv, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__doc__ and obj.__doc__.strip(), f"{name} has no docstring"


def test_public_methods_have_docstrings():
    for cls in (pagedkv.PagedKvCache, pagedkv.KvCacheConfig, pagedkv.KvCacheDtype, pagedkv.HostBackend,
                pagedkv.DevicePtr, pagedkv.Teardown, pagedkv.BlockRegions, pagedkv.BlockAllocator,
                pagedkv.KvPools, pagedkv.SideFormat):
        for attr, value in vars(cls).items():
            if attr.startswith("_") or not callable(getattr(value, "__func__", value)):
                continue
            assert (getattr(value, "__func__", value).__doc__ or "").strip(), f"{cls.__name__}.{attr} has no docstring"


def test_public_api_is_sorted_and_complete():
    assert pagedkv.__all__ == sorted(pagedkv.__all__)
    assert len(set(pagedkv.__all__)) == len(pagedkv.__all__)
    for name in ("PagedKvError", "PrefixCacheEvent", "SKIP_SLOT", "BlockAllocator", "BlockReclaimer", "KvPools",
                 "SIDE_FORMATS", "SideFormat", "token_ids", "chain_hash", "root_hash", "Exported", "PageTable"):
        assert name in pagedkv.__all__, name
    assert pagedkv.SKIP_SLOT == -1
    # every public class, function and constant of the core modules is exported
    from pagedkv import cache, errors
    from pagedkv.core import allocator
    from pagedkv.kv import pools
    from pagedkv.sequences import prefix_cache
    from pagedkv.sequences import sequence_table

    for module in (allocator, cache, errors, pools, prefix_cache, sequence_table):
        for name, obj in vars(module).items():
            if not name.startswith("_") and inspect.isclass(obj) and obj.__module__ == module.__name__:
                assert name in pagedkv.__all__, f"{module.__name__}.{name}"


def test_test_hooks_are_not_public():
    assert "reload_flags" not in pagedkv.__all__ and not hasattr(pagedkv, "reload_flags")


def test_old_flat_module_paths_are_the_moved_modules():
    import importlib

    for name in ("prefix_cache", "sequence_table", "host_tier", "transfer", "views", "config", "log", "backend"):
        assert name in pagedkv.MOVED_MODULES, name
    for old, new in pagedkv.MOVED_MODULES.items():
        module = importlib.import_module(f"pagedkv.{new}")
        assert importlib.import_module(f"pagedkv.{old}") is module, old
        assert getattr(pagedkv, old) is module and module.__spec__.name == f"pagedkv.{new}", old
    from pagedkv.prefix_cache import PrefixCache, chain_hash
    from pagedkv.sequence_table import Exported, SequenceTable

    assert (PrefixCache, SequenceTable, Exported, chain_hash) == (
        pagedkv.PrefixCache, pagedkv.SequenceTable, pagedkv.Exported, pagedkv.chain_hash)
    assert pagedkv.cache.PagedKvCache is pagedkv.PagedKvCache and pagedkv.cache.POISON_BYTE == 0xFF
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        pagedkv.no_such_module  # noqa: B018
    # a fresh interpreter: an old path imported first, before anything else of pagedkv
    code = "import pagedkv.host_tier as t, pagedkv.tiers.host_tier as n; print(t is n, t.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "True pagedkv.tiers.host_tier\n"
