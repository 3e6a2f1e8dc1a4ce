"""The device path of `kv_rows.write_tokens` / `read_tokens`: K/V rows, slots and outputs
that live in the backend's memory (`pagedkv.DeviceArray`, any `__dlpack__` producer on the
backend's device, a SequenceTable export).

On a backend with the KV row kernels (CudaBackend: `kv_write_rows`) a call validates shapes
and dtypes on the host and enqueues one kernel launch on `stream`: no synchronisation, no
allocation, no copy. Slot values are not read on the host: a slot outside the cache (-1
included) is skipped by the write and reads as zeros; a slot repeated within one call is
the caller's error (the rows race). NaN/inf inputs are counted in the cache's device
counter instead of refused. On a host-memory backend (HostBackend) the same arguments are
turned into numpy views of that memory and take the host codec path.

On either path a device input that names its owning backend (`DeviceArray.backend`, a
pagedkv DLPack producer's) is refused, ValueError naming both, when that backend is not
the call's `gpu`, before anything is enqueued; one naming none is taken as given.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..core.env import flags
from ..driver.kv_kernels import KvSideArgs
from ..errors import PagedKvError
from ..interop.device_array import DeviceArray, check_backend, from_dlpack


class DuplicateSlotError(PagedKvError, ValueError):
    """Two tokens of one device write named the same slot (on a GPU a torn row: one token's
    codes with the other's scales); found by the device check of debug mode
    (METRALE_KV_TRACE=1) and raised at the next sync point, `take_nonfinite_inputs`."""


_NO_DUPLICATE = (1 << 64) - 1

KDL_CPU = 1

# Prepared launches of repeated calls, per pools object: a call whose layer, DeviceArray
# arguments (address, shape, dtype, row stride), scales, counter and backend equal an earlier
# call's (validated then) is one cuLaunchKernel. Capped: a fresh buffer each step would
# otherwise grow it without bound.
_PREPARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PREPARED_LIMIT = 1024


def _array_key(x: Any):
    if type(x) is DeviceArray:
        return (x.ptr, x.shape, x.dtype, x.row_stride, x.device, id(x.backend))
    return None


def _prepared_key(kind: str, layer, gpu, slots, a, b, *rest):
    keys = (_array_key(slots), _array_key(a), _array_key(b))
    if keys[0] is None or keys[1] is None or (keys[2] is None and b is not None) or type(layer) is not int:
        return None
    return (kind, layer, id(gpu), *keys, *rest)


def launch_prepared(pools, kind: str, layer, slots, a, b, gpu, stream, *rest) -> bool:
    """Enqueue the prepared launch of an earlier identical device call (`kind` "w": write of
    rows a, b; "r": read into outputs a, b; `rest` the scales and flags) and return True, or
    False when there is none (the caller takes the validating path, which prepares one)."""
    entries = _PREPARED.get(pools)
    if entries is None:
        return False
    key = _prepared_key(kind, layer, gpu, slots, a, b, *rest)
    launches = entries.get(key) if key is not None else None
    if launches is None:
        return False
    pools.layer(layer)  # the pools must still be live
    for launch in launches:
        launch.launch(stream)
    return True


def _remember(pools, key, launches) -> None:
    if key is None or not launches:
        return
    entries = _PREPARED.setdefault(pools, {})
    if len(entries) >= _PREPARED_LIMIT:
        entries.clear()
    entries[key] = launches


def slot_check(gpu: Any, slots_ptr: int, num_tokens: int, limit: int, nonfinite: int) -> list:
    """[the prepared debug check of a device write's slots] under METRALE_KV_TRACE=1 on a
    backend with the KV kernels and a counter (`nonfinite`, whose second word takes the
    duplicate), else []."""
    if not (flags().kv_trace and nonfinite and hasattr(gpu, "kv_prepare_check_slots")):
        return []
    launch = gpu.kv_prepare_check_slots(slots_ptr, num_tokens, limit, nonfinite + 8)
    return [launch] if launch is not None else []


def is_device_input(x: Any) -> bool:
    """True for a DeviceArray or a non-numpy DLPack producer (device rows, slots or outputs)."""
    return isinstance(x, DeviceArray) or (x is not None and not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__"))


def has_kv_kernels(gpu: Any) -> bool:
    """True when `gpu` runs the KV row kernels (CudaBackend)."""
    return callable(getattr(gpu, "kv_write_rows", None))


def _dlpack_stream(stream: int) -> int:
    return int(stream) or 1  # DLPack's legacy default stream is 1, never 0


def device_array(x: Any, what: str, gpu: Any, stream: int) -> DeviceArray:
    """`x` as a DeviceArray on `gpu`'s device; TypeError naming `what` otherwise, ValueError
    when it lives on another device or names another owning backend."""
    if isinstance(x, DeviceArray):
        arr = x
    elif is_device_input(x):
        arr = from_dlpack(x, _dlpack_stream(stream))
    else:
        raise TypeError(f"{what} must be a DeviceArray or a DLPack producer on the device, got {type(x).__name__}")
    from ..interop.views import dlpack_device_of

    check_backend(arr, what, gpu)
    want = dlpack_device_of(gpu)
    if arr.device is not None and arr.device != want:
        raise ValueError(f"{what} lives on DLPack device {arr.device}, not on the backend's {want}")
    return arr


def host_view(x: Any, what: str, gpu: Any) -> np.ndarray:
    """On a host-memory backend, `x` (DeviceArray or DLPack producer) as a numpy view;
    ValueError when `x` names an owning backend other than `gpu`."""
    check_backend(x, what, gpu)
    if isinstance(x, DeviceArray):
        raw = gpu.view(x.ptr, x.nbytes_spanned) if x.nbytes_spanned else np.zeros(0, np.uint8)
        rows = x.shape[0]
        inner = x.shape[1:]
        packed = int(np.prod(inner, dtype=np.int64))
        flat = raw.view(x.dtype)
        if rows == 0:
            return np.zeros(x.shape, x.dtype)
        strided = np.lib.stride_tricks.as_strided(
            flat, (rows, packed), (x.row_stride * x.dtype.itemsize, x.dtype.itemsize), writeable=True)
        return strided.reshape(x.shape)
    arr = np.from_dlpack(x)
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{what}: cannot read {type(x).__name__} as host memory")
    return arr


def host_slots(slots: Any, gpu: Any) -> Any:
    """Slots for the host path: a DeviceArray (in a host-memory backend) as a numpy view;
    anything else as given (numpy, sequences, SequenceTable exports through `__array__`).
    ValueError when `slots` names an owning backend other than `gpu` (an export of another
    backend's table names slots of another cache)."""
    check_backend(slots, "slots", gpu)
    if isinstance(slots, DeviceArray):
        if not callable(getattr(gpu, "view", None)):
            raise TypeError(f"device slots on {type(gpu).__name__} need device k/v or out_k/out_v (the device path)")
        return host_view(slots, "slots", gpu)
    return slots


def rows_array(x: Any, what: str, gpu: Any, heads: int, head_dim: int, tokens: int | None) -> DeviceArray:
    """`x` (a device input) as a DeviceArray of `[tokens, heads, head_dim]` float32 or BF16
    rows on `gpu`'s device (any token count when `tokens` is None); TypeError/ValueError
    naming `what` otherwise. A DLPack producer is read on the legacy default stream."""
    return _rows(device_array(x, what, gpu, 0), what, heads, head_dim, tokens)


def _rows(x: DeviceArray, what: str, heads: int, head_dim: int, tokens: int | None) -> DeviceArray:
    if x.dtype.name not in ("float32", "bfloat16"):
        raise TypeError(f"{what} must be float32 or bfloat16, got dtype {x.dtype.name}")
    if len(x.shape) != 3 or x.shape[1:] != (heads, head_dim) or (tokens is not None and x.shape[0] != tokens):
        want = f"[{tokens if tokens is not None else 'num_tokens'}, {heads}, {head_dim}]"
        raise ValueError(f"{what} must be shaped {want} for this layer, got {x.shape}")
    return x


def slot_array(slots: Any, gpu: Any, stream: int) -> DeviceArray:
    """`slots` as a 1-D int64 DeviceArray on `gpu`'s device; TypeError otherwise."""
    arr = device_array(slots, "slots", gpu, stream)
    if arr.dtype.name != "int64" or len(arr.shape) != 1:
        raise TypeError(f"device slots must be a 1-D int64 array, got {arr.dtype.name} of shape {arr.shape}")
    return arr


def write_tokens(pools, layer: int, geometry, slots, k, v, gpu, stream: int, k_scale: float, v_scale: float,
                 nonfinite: int = 0) -> None:
    """Enqueue the device write of `k`/`v` rows into `layer`'s `slots` (see the module
    docstring); `geometry` is (heads, head_dim, K format, V format) of the layer, `nonfinite`
    the device address of the uint64 NaN/inf counter (0: none)."""
    heads, head_dim, k_fmt, v_fmt = geometry
    config = pools.config()
    aliased = config.v_aliases_k
    slot_arr = slot_array(slots, gpu, stream)
    k_arr = _rows(device_array(k, "k", gpu, stream), "k", heads, head_dim, slot_arr.shape[0])
    k_side = KvSideArgs(k_fmt, int(pools.k_pool(layer)), pools.k_stride(layer), k_arr.ptr, k_arr.row_stride,
                        k_arr.dtype.name == "bfloat16", k_scale,
                        layout=config.layout)
    if aliased and v is None:
        v_side, v_arr = KvSideArgs(None, 0, 0, 0, 0), None
    else:
        v_arr = _rows(device_array(v, "v", gpu, stream), "v", heads, head_dim, slot_arr.shape[0])
        v_side = KvSideArgs(None if aliased else v_fmt, int(pools.v_pool(layer)), pools.v_stride(layer),
                            v_arr.ptr, v_arr.row_stride, v_arr.dtype.name == "bfloat16", v_scale,
                            layout=config.layout)
    limit = pools.num_blocks() * config.block_size
    if not hasattr(gpu, "kv_prepare_write"):
        gpu.kv_write_rows(slot_arr.ptr, slot_arr.shape[0], heads, head_dim, config.block_size, limit,
                          k_side, v_side, stream, nonfinite)
        return
    gpu._stream(stream)  # an unknown stream is refused before anything is prepared
    launch = gpu.kv_prepare_write(slot_arr.ptr, slot_arr.shape[0], heads, head_dim, config.block_size, limit,
                                  k_side, v_side, nonfinite)
    launches = slot_check(gpu, slot_arr.ptr, slot_arr.shape[0], limit, nonfinite) + ([launch] if launch else [])
    _remember(pools, _prepared_key("w", layer, gpu, slots, k, v, k_scale, v_scale, nonfinite), launches)
    for one in launches:
        one.launch(stream)


def read_tokens(pools, layer: int, geometry, slots, gpu, stream: int, unrotate: bool, k_scale: float,
                v_scale: float, out_k, out_v) -> tuple[Any, Any]:
    """Enqueue the device decode of `layer`'s `slots` into `out_k`/`out_v` ([num_slots, heads,
    head_dim] float32 or BF16 device arrays); returns (out_k, out_v). `geometry` as for
    `write_tokens`."""
    heads, head_dim, k_fmt, v_fmt = geometry
    config = pools.config()
    slot_arr = slot_array(slots, gpu, stream)
    tokens = slot_arr.shape[0]
    k_arr = _rows(device_array(out_k, "out_k", gpu, stream), "out_k", heads, head_dim, tokens)
    v_arr = _rows(device_array(out_v, "out_v", gpu, stream), "out_v", heads, head_dim, tokens)
    v_pool, v_stride = (pools.k_pool(layer), pools.k_stride(layer)) if config.v_aliases_k else (
        pools.v_pool(layer), pools.v_stride(layer))
    k_side = KvSideArgs(k_fmt, int(pools.k_pool(layer)), pools.k_stride(layer), k_arr.ptr, k_arr.row_stride,
                        k_arr.dtype.name == "bfloat16", k_scale, unrotate,
                        layout=config.layout)
    v_side = KvSideArgs(k_fmt if config.v_aliases_k else v_fmt, int(v_pool), v_stride, v_arr.ptr, v_arr.row_stride,
                        v_arr.dtype.name == "bfloat16", k_scale if config.v_aliases_k else v_scale, unrotate,
                        layout=config.layout)
    limit = pools.num_blocks() * config.block_size
    if not hasattr(gpu, "kv_prepare_read"):
        gpu.kv_read_rows(slot_arr.ptr, tokens, heads, head_dim, config.block_size, limit, k_side, v_side, stream)
        return out_k, out_v
    gpu._stream(stream)
    launch = gpu.kv_prepare_read(slot_arr.ptr, tokens, heads, head_dim, config.block_size, limit, k_side, v_side)
    _remember(pools, _prepared_key("r", layer, gpu, slots, out_k, out_v, unrotate, k_scale, v_scale),
              [launch] if launch else [])
    if launch is not None:
        launch.launch(stream)
    return out_k, out_v


class NonfiniteCounter:
    """Two device words a cache's device writes report into (on a backend with the KV row
    kernels; HostBackend refuses such inputs instead): the NaN/inf input count, and the
    smallest duplicate slot the debug check found (all ones: none). Read and reset on the
    caller's stream through pinned memory: no synchronous copy on the legacy default
    stream, which would serialise every blocking stream and invalidate another thread's
    global-mode graph capture."""

    def __init__(self, gpu: Any):
        """Allocate the words on `gpu` and their pinned read-back, reset on a private
        stream (everything freed again if that fails)."""
        self.ptr = gpu.alloc(16)
        self._host = None
        try:
            self._host = gpu.alloc_pinned(16)
            stream = gpu.create_stream()
            try:
                self._reset(gpu, stream)
                gpu.synchronize(stream)
            finally:
                gpu.destroy_stream(stream)
        except BaseException:
            if self._host is not None:
                self._host.free()
            gpu.free(self.ptr)
            raise

    def _reset(self, gpu: Any, stream: int) -> None:
        gpu.memset_async(self.ptr, 0, 8, stream)
        gpu.memset_async(self.ptr.offset(8), 0xFF, 8, stream)

    def take(self, gpu: Any, stream: int) -> int:
        """The count after the work enqueued on `stream` so far, and reset: the read-back and
        the reset are enqueued on `stream`, then `stream` is waited for. DuplicateSlotError
        (after the reset) when the debug check saw a slot named twice."""
        gpu.copy_d2h_async(self.ptr, self._host, stream)
        self._reset(gpu, stream)
        gpu.synchronize(stream)
        count, duplicate = (int(x) for x in self._host.array.view(np.uint64)[:2])
        if duplicate != _NO_DUPLICATE:
            raise DuplicateSlotError(
                f"slot {duplicate} was named by two tokens of one device write (a torn row on a GPU); "
                "found by the debug check of METRALE_KV_TRACE=1")
        return count

    def free(self, gpu: Any) -> None:
        """Free the words and their pinned read-back (both attempted, the first error
        raised); what was freed is forgotten, so a second call retries only what failed."""
        first: BaseException | None = None
        if self.ptr is not None:
            try:
                gpu.free(self.ptr)
                self.ptr = None
            except Exception as err:  # noqa: BLE001 - the read-back must still be attempted
                first = err
        if self._host is not None:
            try:
                self._host.free()
                self._host = None
            except Exception as err:  # noqa: BLE001
                first = first or err
        if first is not None:
            raise first
