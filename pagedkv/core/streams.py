"""Stream arguments: an int handle, or any object speaking the `__cuda_stream__` protocol.

Engines hold their streams as objects (cuda.core `Stream`, CuPy streams, recent torch
streams). The protocol (cuda.core's): `obj.__cuda_stream__()` returns `(version, handle)`
with version 0 and `handle` the `CUstream` as an int. Every pagedkv `stream` parameter
accepts either form; `stream_handle` is the one place that turns it into an int.
"""

from __future__ import annotations

import numpy as np

STREAM_PROTOCOL_VERSION = 0
"""The `__cuda_stream__` version understood here."""


def is_stream_object(stream: object) -> bool:
    """True when `stream` is not an int but carries `__cuda_stream__` (a foreign stream)."""
    return not isinstance(stream, (int, np.integer)) and hasattr(stream, "__cuda_stream__")


def stream_handle(stream: object) -> int:
    """The int handle of `stream`: an int (numpy integers included) as is, or the handle
    an object's `__cuda_stream__` reports (a method returning `(0, handle)`, or that tuple
    as an attribute). TypeError names a bool, a float or an object without the protocol;
    ValueError a negative handle or an unknown protocol version."""
    if isinstance(stream, bool):
        raise TypeError(f"a stream must be an int handle or have __cuda_stream__, got {stream!r}")
    if isinstance(stream, (int, np.integer)):
        handle = int(stream)
        if handle < 0:
            raise ValueError(f"a stream handle cannot be negative, got {handle}")
        return handle
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is None:
        raise TypeError(
            f"a stream must be an int handle or have __cuda_stream__, got {type(stream).__name__} {stream!r}"
        )
    reported = protocol() if callable(protocol) else protocol
    try:
        version, handle = reported
    except (TypeError, ValueError):
        raise TypeError(
            f"{type(stream).__name__}.__cuda_stream__ must give (version, handle), got {reported!r}"
        ) from None
    if version != STREAM_PROTOCOL_VERSION:
        raise ValueError(
            f"{type(stream).__name__}.__cuda_stream__ reports protocol version {version!r}; "
            f"pagedkv understands version {STREAM_PROTOCOL_VERSION}"
        )
    if isinstance(handle, bool) or not isinstance(handle, (int, np.integer)):
        raise TypeError(f"{type(stream).__name__}.__cuda_stream__ handle must be an int, got {handle!r}")
    if handle < 0:
        raise ValueError(f"{type(stream).__name__}.__cuda_stream__ handle cannot be negative, got {int(handle)}")
    return int(handle)
