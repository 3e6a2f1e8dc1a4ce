"""Capability discovery: what a backend offers beyond the required GpuBackend protocol.

A backend may define `supports(name) -> bool`. A backend without it offers only the
required protocol (`GpuBackend`): `backend_supports` answers False for every name, and a
pagedkv feature that needs more refuses it with `BackendFeatureMissing`, naming the
feature and the backend, before anything is touched.

Names (`CAPABILITIES` maps each to what it promises):

- "pinned": `alloc_pinned(nbytes)` returns page-locked host memory (an object with `.array`,
  a writable uint8 numpy view, and `free()`), and `copy_h2d_async(src, dst, stream)` /
  `copy_d2h_async(src, dst, stream)` copy from/to it in stream order.
- "batched_copy": `fill_blocks` and `copy_blocks` do every (region, block) of a call in
  one launch. Every backend has the two methods (they are required); a backend that builds
  them from per-range memsets and copies (`pagedkv.backends.per_range`) answers False.
- "stream_wait": `make_stream_wait(waiting, on)` makes another stream wait for the work
  enqueued on one of the backend's streams (DLPack exports to CUDA consumers need it).
- "host_view": `view(ptr, nbytes)` returns the device bytes as a writable numpy array
  (a backend whose addresses are not host addresses, like HostBackend, exports through it).
- "graphs": `capture(stream, mode="global")` is a context manager that captures the
  stream-ordered work enqueued on `stream` inside it into a graph with `launch(stream)`
  (replay) and `close()`; a call that cannot be captured raises `GraphCaptureError`.
- "vmm": virtual memory for elastic pools: `vmm_granularity()`, `reserve_address(nbytes)`,
  `map_chunk(ptr, nbytes)`, `unmap_chunk(ptr, nbytes)`, `release_address(ptr)`
  (`PagedKvCache(..., elastic=True)` needs it).
- "device:cpu", "device:cuda", "device:rocm": the kind of memory behind the device
  pointers (the DLPack device type of a pool view). At most one is true. A "device:cpu"
  backend's pointers are host addresses, unless it also states "host_view" (HostBackend:
  its addresses are its own, and `view` gives the bytes).
- "host_tier": what a host tier of KV blocks (`pagedkv.host_tier.HostTier`) needs:
  `alloc_swap_memory(nbytes)` (host memory the batched copy reaches: an object with
  `.address`, `.nbytes`, `.array`, `free()` and `freed`), `copy_batch_async(dsts, srcs,
  sizes, stream)` (every listed range copied in ONE backend call on `stream`, each range
  inside one live device allocation or one live swap memory, everything checked before
  anything is enqueued) and events: `record_event(stream)`, `event_done(event)`,
  `wait_event(event)`, `stream_wait_event(stream, event)`, `destroy_event(event)`.
"""

from __future__ import annotations

from typing import Any

from ..errors import PagedKvError

CAPABILITIES: dict[str, str] = {
    "pinned": "alloc_pinned, copy_h2d_async and copy_d2h_async (page-locked host memory)",
    "batched_copy": "fill_blocks and copy_blocks in one launch for every region and block",
    "stream_wait": "make_stream_wait(waiting, on) across streams",
    "host_view": "view(ptr, nbytes): device bytes as a host numpy array",
    "graphs": "capture(stream) -> a context manager yielding a CUDA graph of the block's stream work, with launch(stream) and close()",
    "vmm": "vmm_granularity, reserve_address, map_chunk, unmap_chunk and release_address (elastic pools)",
    "host_tier": "alloc_swap_memory, copy_batch_async and events (a host tier's batched swaps)",
    "device:cpu": "device pointers are host addresses, or reached through view() with host_view (DLPack kDLCPU)",
    "device:cuda": "device pointers are CUDA device memory (DLPack kDLCUDA, device_ordinal)",
    "device:rocm": "device pointers are ROCm device memory (DLPack kDLROCM, device_ordinal)",
}
"""Every capability name a backend may be asked about, and what supporting it promises."""

DEVICE_KINDS = ("cpu", "cuda", "rocm")
"""The device kinds of the "device:<kind>" names."""


class BackendFeatureMissing(PagedKvError, TypeError):
    """A pagedkv feature needs a capability the backend does not state it supports."""


def check_capability_name(name: Any) -> str:
    """`name` if it is a known capability name, else ValueError listing the known ones."""
    if not isinstance(name, str) or name not in CAPABILITIES:
        raise ValueError(f"unknown backend capability {name!r}; known: {', '.join(CAPABILITIES)}")
    return name


def backend_supports(gpu: Any, name: str) -> bool:
    """True when `gpu.supports(name)` says so; False for a backend without `supports`
    (it offers only the required protocol). ValueError for an unknown name; TypeError
    when the backend's `supports` answers something other than a bool."""
    name = check_capability_name(name)
    supports = getattr(gpu, "supports", None)
    if supports is None:
        return False
    answer = supports(name)
    if not isinstance(answer, bool):
        raise TypeError(f"{type(gpu).__name__}.supports({name!r}) returned {answer!r}, not a bool")
    return answer


def device_kind(gpu: Any) -> str | None:
    """"cpu", "cuda" or "rocm" from the backend's "device:<kind>" capability, or None when
    it states none."""
    for kind in DEVICE_KINDS:
        if backend_supports(gpu, f"device:{kind}"):
            return kind
    return None


def require(gpu: Any, name: str, feature: str) -> None:
    """Raise BackendFeatureMissing, naming `feature`, the capability and the backend,
    unless the backend supports `name`."""
    if not backend_supports(gpu, name):
        raise BackendFeatureMissing(
            f"{feature} needs a backend that supports {name!r} ({CAPABILITIES[name]}); "
            f"{type(gpu).__name__} does not"
        )
