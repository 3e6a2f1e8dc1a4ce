"""Every exception class pagedkv defines derives from PagedKvError."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pagedkv
from pagedkv import PagedKvError


OPTIONAL_DEPENDENCIES = {"torch"}
"""Packages of the optional extras: a module needing one is skipped where it is absent."""


def library_exceptions() -> dict[str, type]:
    found = {}
    for info in pkgutil.walk_packages(pagedkv.__path__, "pagedkv."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as err:
            if err.name in OPTIONAL_DEPENDENCIES:  # e.g. pagedkv.backends.torch_arena without torch
                continue
            raise
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                found[f"{info.name}.{name}"] = obj
    return found


def test_the_walk_finds_the_known_errors():
    found = library_exceptions()
    for name in ("pagedkv.errors.KvCacheError", "pagedkv.errors.DeviceOutOfMemory", "pagedkv.errors.TeardownError",
                 "pagedkv.driver.errors.CudaError", "pagedkv.driver.errors.CudaUnavailable"):
        assert name in found, name


def test_every_library_error_derives_from_pagedkv_error():
    outside = sorted(name for name, cls in library_exceptions().items() if not issubclass(cls, PagedKvError))
    assert outside == []


def test_the_builtin_families_are_kept():
    from pagedkv import DeviceOutOfMemory, KvCacheExhausted, TeardownError
    from pagedkv.driver.errors import CudaOutOfMemory

    assert issubclass(DeviceOutOfMemory, MemoryError) and issubclass(DeviceOutOfMemory, RuntimeError)
    assert issubclass(CudaOutOfMemory, DeviceOutOfMemory) and issubclass(KvCacheExhausted, PagedKvError)
    assert issubclass(TeardownError, RuntimeError)
