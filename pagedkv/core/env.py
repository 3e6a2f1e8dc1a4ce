"""Environment flags, read once per process in this one module."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

_TRUE = ("1", "true")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


@dataclass(frozen=True)
class EnvFlags:
    """The debugging flags: `METRALE_KV_POISON` (fresh blocks filled with 0xFF),
    `METRALE_KV_TRACE` (per-block refcount history), `METRALE_SSM_SAVE_DUMP` (the engine's
    cue to run the checksum probe). Each is on when set to `1` or `true`."""

    kv_poison: bool
    kv_trace: bool
    ssm_save_dump: bool


@functools.lru_cache(maxsize=1)
def flags() -> EnvFlags:
    """The flags as read the first time this is called; `reload_flags()` reads them again."""
    return EnvFlags(
        kv_poison=_flag("METRALE_KV_POISON"),
        kv_trace=_flag("METRALE_KV_TRACE"),
        ssm_save_dump=_flag("METRALE_SSM_SAVE_DUMP"),
    )


def reload_flags() -> EnvFlags:
    """Forget the cached flags and read the environment again (for tests and tools)."""
    flags.cache_clear()
    return flags()
