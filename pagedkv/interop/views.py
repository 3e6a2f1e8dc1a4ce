"""Tensor views of pagedkv memory: a layer's K or V pool, and device-side table exports.

A `PoolView` describes one pool as a tensor, zero copy, for DLPack consumers (and
`__cuda_array_interface__` v3 where its typestr can express the dtype):

- bf16 side: `(num_blocks, block_size, num_kv_heads, head_dim)` bfloat16 (NHD blocks);
- fp8 side: the same shape in float8_e4m3fn (the per-tensor scale is the config's
  `k_scale` / `v_scale`, not in the blocks);
- `bits_view()`: the bf16 / fp8 tensor as uint16 / uint8 (numpy's `from_dlpack` has
  neither dtype);
- packed side (nvfp4, turbo*): uint8 `(num_blocks, side_block_bytes)`, with `data_view()`
  `(num_blocks, block_size, row_data_bytes)` and `scale_view()` `(num_blocks, block_size,
  groups_per_row * scale_bytes)` as strided views of the same memory (docs/FORMATS.md).

A cache with `layout="HND"` (and more than one head) has heads outermost within a block:
bf16 and fp8 sides are `(num_blocks, num_kv_heads, block_size, head_dim)`, and the packed
parts `(num_blocks, num_kv_heads, block_size, head_bytes)` (docs/LAYOUTS.md).

The device comes from the backend's "device:<kind>" capability (pagedkv.capabilities): on
HostBackend it is kDLCPU and the tensor is the backend's own host memory; on CudaBackend
it is kDLCUDA with the device ordinal. A view is valid while the cache is:
exporting after `cache.release` raises, and a consumer's tensor must not outlive the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends.capabilities import BackendFeatureMissing, backend_supports, device_kind, require
from ..backends.protocol import DevicePtr
from ..core.dtype import KvCacheDtype, side_bytes, side_data_bytes, side_scale_bytes
from ..core.streams import stream_handle
from ..core.lazy_dtypes import DtypeTable
from .dlpack import (KDL_CPU, KDL_CUDA, STREAM_LEGACY, _VERSIONS, CapsuleTemplate, DlpackProducer, TensorSpec,
                     prepared_export)

NUMPY_DTYPES = DtypeTable(
    {name: np.dtype(name) for name in ("int8", "int16", "uint8", "uint16", "uint32", "uint64", "int32", "int64",
                                       "float16", "float32", "float64")},
    {"bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn"},
)
"""The numpy (ml_dtypes) dtype of each DLPack dtype name a view can carry."""

CAI_TYPESTRS = {"int8": "|i1", "int16": "<i2", "uint8": "|u1", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8",
                "int32": "<i4", "int64": "<i8", "float16": "<f2", "float32": "<f4", "float64": "<f8"}
"""`__cuda_array_interface__` typestrs; bfloat16 and float8_e4m3fn have none."""

_TABLE_DTYPES = ("uint8", "int32", "int64")

_ELEMENT_DTYPES = {KvCacheDtype.BF16: "bfloat16", KvCacheDtype.FP8: "float8_e4m3fn"}
_BITS_DTYPES = {"bfloat16": "uint16", "float8_e4m3fn": "uint8"}  # what consumers without those dtypes take


def dlpack_device_of(gpu: Any) -> tuple[int, int]:
    """The DLPack device of the backend's memory, from its "device:<kind>" capability:
    `(kDLCPU, 0)` or `(kDLCUDA, gpu.device_ordinal)`; BackendFeatureMissing (a TypeError)
    for a backend that states no device kind (or one views cannot export)."""
    kind = device_kind(gpu)
    if kind is None:
        raise BackendFeatureMissing(
            f"a pool view needs a backend that states its device kind (supports('device:cpu'), "
            f"'device:cuda' or 'device:rocm'); {type(gpu).__name__} states none"
        )
    if kind == "cpu":
        return (KDL_CPU, 0)
    if kind != "cuda":
        raise BackendFeatureMissing(f"pool views export cpu or cuda memory, not the {kind} memory of {type(gpu).__name__}")
    ordinal = getattr(gpu, "device_ordinal", None)
    if isinstance(ordinal, bool) or not isinstance(ordinal, int):
        raise TypeError(f"backend {type(gpu).__name__} supports 'device:{kind}' but has no int device_ordinal")
    return (KDL_CUDA, ordinal)


@dataclass(frozen=True)
class _Layout:
    """Where a view's elements are: byte offset in the pool, dtype, shape, strides in bytes."""

    offset: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]


def _strided(memory: np.ndarray, layout: _Layout, writeable: bool) -> np.ndarray:
    """`layout` over the uint8 array `memory` (no copy)."""
    dtype = NUMPY_DTYPES[layout.dtype]
    typed = memory[layout.offset:]
    typed = typed[: typed.size - typed.size % dtype.itemsize].view(dtype)
    return np.lib.stride_tricks.as_strided(typed, shape=layout.shape, strides=layout.strides, writeable=writeable)


def live_exports_from(target: Any) -> int:
    """How many DLPack exports of views of `target` are alive in consumers: views whose
    `exported_from(target)` is true (a PoolView's cache, a StateView's state pools). An
    export's owner is the view, or `(host memory, view)` on a "host_view" backend."""
    from .dlpack import live_exports_of

    def of_target(owner: object) -> bool:
        view = owner[1] if type(owner) is tuple and len(owner) == 2 else owner
        test = getattr(view, "exported_from", None)
        return test is not None and test(target)

    return live_exports_of(of_target)


class _MemoryExport(DlpackProducer):
    """What pool views and device table exports share: memory at `_address()` of `_extent()`
    bytes on `gpu`, produced on `stream`, laid out by `_layout()`."""

    _gpu: Any
    _stream: Any
    _readonly: bool = False

    @property
    def pagedkv_backend(self) -> Any:
        """The backend whose memory this is (what `DeviceArray.backend` of it becomes)."""
        return self._gpu

    def _address(self) -> DevicePtr:  # pragma: no cover - subclasses define it
        raise NotImplementedError

    def _extent(self) -> int:  # pragma: no cover
        raise NotImplementedError

    def _layout(self) -> _Layout:  # pragma: no cover
        raise NotImplementedError

    def _device(self) -> tuple[int, int]:
        return dlpack_device_of(self._gpu)

    def _tensor_spec(self) -> TensorSpec:
        layout, base = self._layout(), self._address()
        itemsize = NUMPY_DTYPES[layout.dtype].itemsize
        strides = tuple(s // itemsize for s in layout.strides)
        if backend_supports(self._gpu, "host_view"):
            memory = self._gpu.view(base, self._extent())  # raises once the memory is freed
            return TensorSpec(
                memory.__array_interface__["data"][0], layout.offset, (KDL_CPU, 0),
                layout.shape, strides, layout.dtype, self._readonly, owner=(memory, self),
            )
        return TensorSpec(int(base), layout.offset, self._device(), layout.shape, strides, layout.dtype,
                          self._readonly, owner=self)

    def _host_copy(self) -> tuple[np.ndarray, str]:
        layout, base = self._layout(), self._address()
        raw = np.empty(self._extent(), dtype=np.uint8)
        self._gpu.synchronize(self._stream)  # the copy must see the producing stream's work
        self._gpu.copy_d2h(base, raw)
        return np.array(_strided(raw, layout, writeable=False)), layout.dtype

    def _consumer_waits(self, handle: int) -> None:
        require(self._gpu, "stream_wait", "a DLPack export to a consumer's stream")
        self._gpu.make_stream_wait(handle, self._stream)

    def host_array(self) -> np.ndarray:
        """On a backend with "host_view" (HostBackend), the view as a numpy array over the
        backend's memory (zero copy; bfloat16 / float8_e4m3fn from ml_dtypes);
        BackendFeatureMissing (a TypeError) elsewhere: use DLPack (e.g. torch.from_dlpack)."""
        require(self._gpu, "host_view", "host_array() (use DLPack, e.g. torch.from_dlpack, elsewhere)")
        layout = self._layout()
        return _strided(self._gpu.view(self._address(), self._extent()), layout, writeable=not self._readonly)

    def _what(self) -> str:
        """`dtype[shape]` for a repr, or "of a released cache" once the memory is gone (a
        repr never raises)."""
        try:
            return f"{self.dtype}{list(self.shape)}"
        except Exception:  # noqa: BLE001 - the cache may be released
            return "of a released cache"

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        return self._layout().shape

    @property
    def dtype(self) -> str:
        """The tensor's DLPack dtype name (a key of `NUMPY_DTYPES`): bfloat16, float8_e4m3fn,
        uint8, uint16, int32 or int64 for pools and tables; a state view's own dtype."""
        return self._layout().dtype

    @property
    def strides(self) -> tuple[int, ...]:
        """The tensor's strides, in elements."""
        layout = self._layout()
        return tuple(s // NUMPY_DTYPES[layout.dtype].itemsize for s in layout.strides)

    @property
    def __cuda_array_interface__(self) -> dict:
        """CUDA Array Interface v3 of a CUDA view whose dtype has a typestr (ints, uints,
        float16/32/64). bfloat16 and float8_e4m3fn have no CAI typestr, and host views are not
        CUDA memory: both raise AttributeError (use DLPack). `stream` is the producing
        stream the consumer must order after (1 for pagedkv's default stream 0)."""
        if self._device()[0] != KDL_CUDA:
            raise AttributeError("__cuda_array_interface__ exists only on CUDA views; this one is host memory")
        layout = self._layout()
        typestr = CAI_TYPESTRS.get(layout.dtype)
        if typestr is None:
            raise AttributeError(f"{layout.dtype} has no __cuda_array_interface__ typestr: use __dlpack__")
        handle = stream_handle(self._stream)
        return {
            "shape": layout.shape,
            "typestr": typestr,
            "data": (int(self._address()) + layout.offset, self._readonly),
            "strides": layout.strides,
            "version": 3,
            "stream": STREAM_LEGACY if handle == 0 else handle,
        }


class PoolView(_MemoryExport):
    """One layer's K or V pool as a tensor (see the module docstring for shapes). Made by
    `PagedKvCache.k_view` / `v_view`; `part` is "pool", "data", "scale" or "bits"."""

    def __init__(self, cache, layer: int, side: str, gpu: Any, stream: Any = 0,
                 readonly: bool = False, part: str = "pool"):
        if side not in ("K", "V"):
            raise ValueError(f"side must be 'K' or 'V', got {side!r}")
        if part not in ("pool", "data", "scale", "bits"):
            raise ValueError(f"part must be 'pool', 'data', 'scale' or 'bits', got {part!r}")
        if not isinstance(readonly, bool):
            raise ValueError(f"readonly must be a bool, got {readonly!r}")
        stream_handle(stream)  # validates; the object itself is kept for the backend
        check = getattr(gpu, "check_stream", None)
        if check is not None:  # a backend that knows its streams: an unknown one refused when asked
            check(stream)
        self._dl_device = dlpack_device_of(gpu)  # fixed: the backend's device kind does not change
        self._templates: dict[tuple[bool, int], CapsuleTemplate] = {}
        config = cache.config()
        self._layer_index = config._check_layer(layer)
        if side == "V" and config.v_aliases_k:
            side = "K"
        self._cache, self._side, self._gpu, self._stream = cache, side, gpu, stream
        self._readonly, self._part = readonly, part
        self._geometry: _Layout | None = None  # fixed for the cache's life
        k_fmt, v_fmt = config.dtype_for_layer(self._layer_index).kv_pair()
        self._fmt = k_fmt if side == "K" else v_fmt
        if part == "scale" and side_scale_bytes(self._fmt, 16) == 0:
            raise ValueError(f"layer {layer} {side} side is {self._fmt}: it has no scale section")

    @property
    def layer(self) -> int:
        """The layer this view shows."""
        return self._layer_index

    @property
    def side(self) -> str:
        """"K" or "V" ("K" for the V view of a cache whose V aliases K)."""
        return self._side

    @property
    def format(self) -> KvCacheDtype:
        """The side format stored in this pool."""
        return self._fmt

    def data_view(self) -> "PoolView":
        """The data sections, uint8 `(num_blocks, block_size, row_data_bytes)`, same memory."""
        return PoolView(self._cache, self._layer_index, self._side, self._gpu, self._stream, self._readonly, "data")

    def bits_view(self) -> "PoolView":
        """The same tensor (shape, strides, memory) with the element bits as unsigned ints:
        uint16 for a bfloat16 pool, uint8 for float8_e4m3fn, the pool itself for packed
        formats. For consumers without those dtypes: numpy's `from_dlpack` refuses bfloat16
        and float8 ("Unsupported dtype"); `np.from_dlpack(view.bits_view()).view(ml_dtypes.bfloat16)`
        is the zero-copy array."""
        return PoolView(self._cache, self._layer_index, self._side, self._gpu, self._stream, self._readonly, "bits")

    def scale_view(self) -> "PoolView":
        """The scale sections, uint8 `(num_blocks, block_size, groups_per_row * scale_bytes)`,
        same memory; ValueError for bf16 and fp8, which have none."""
        return PoolView(self._cache, self._layer_index, self._side, self._gpu, self._stream, self._readonly, "scale")

    def _address(self) -> DevicePtr:
        layer = self._layer_index
        return self._cache.k_pool_ptr(layer) if self._side == "K" else self._cache.v_pool_ptr(layer)

    def _device(self) -> tuple[int, int]:
        return self._dl_device

    def _template(self, versioned: bool, minor: int) -> CapsuleTemplate:
        """The prepared export, kept per capsule kind for the pool's life: a whole
        (non-elastic) pool never moves, so only its release is checked (a released cache
        raises in `_address`, before any kept export is used). An elastic cache's is made
        afresh each time: its mapping (checked by the backend's view of the whole extent)
        may change between exports."""
        cache = self._cache
        kept = self._templates.get((versioned, minor))
        if kept is not None and cache.pools_live():
            return kept
        self._address()  # raises once the cache is released
        template = prepared_export(self._tensor_spec(), versioned, minor)
        if not cache.is_elastic():
            self._templates[(versioned, minor)] = template
        return template

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """See `DlpackProducer.__dlpack__`; a host view's usual zero-copy request (no stream,
        device or copy asked for) takes its kept export without the general checks."""
        if stream is None and dl_device is None and copy is None and self._dl_device[0] != KDL_CUDA:
            kept = self._templates.get(_VERSIONS.get(max_version) if type(max_version) is tuple or max_version is None
                                       else None)
            if kept is not None and self._cache.pools_live():
                return kept.make()
        return DlpackProducer.__dlpack__(self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def _stride(self) -> int:
        layer = self._layer_index
        if self._side == "K":
            return self._cache.k_block_stride_bytes_for_layer(layer)
        return self._cache.v_block_stride_bytes_for_layer(layer)

    def _extent(self) -> int:
        return self._cache.num_blocks() * self._stride()

    def _layout(self) -> _Layout:
        self._address()  # raises KvCacheError once the cache is released
        if self._geometry is None:
            self._geometry = self._compute_layout()
        return self._geometry

    def _compute_layout(self) -> _Layout:
        config = self._cache.config()
        heads, head_dim = config.dims_for_layer(self._layer_index)
        blocks, block_size, stride = self._cache.num_blocks(), config.block_size, self._stride()
        n, fmt = heads * head_dim, self._fmt
        if config.layout == "HND" and heads > 1:
            return self._hnd_layout(blocks, block_size, heads, head_dim, stride)
        if self._part == "data":
            row = side_data_bytes(fmt, n)
            return _Layout(0, "uint8", (blocks, block_size, row), (stride, row, 1))
        if self._part == "scale":
            row = side_scale_bytes(fmt, n)
            return _Layout(side_data_bytes(fmt, block_size * n), "uint8", (blocks, block_size, row), (stride, row, 1))
        element = _ELEMENT_DTYPES.get(fmt)
        if element is None:
            return _Layout(0, "uint8", (blocks, side_bytes(fmt, block_size * n)), (stride, 1))
        size = NUMPY_DTYPES[element].itemsize
        if self._part == "bits":
            element = _BITS_DTYPES[element]
        return _Layout(0, element, (blocks, block_size, heads, head_dim),
                       (stride, n * size, head_dim * size, size))

    def _hnd_layout(self, blocks: int, block_size: int, heads: int, head_dim: int, stride: int) -> _Layout:
        """The HND shapes: `(blocks, heads, block_size, head_dim)` elements, and the packed
        parts `(blocks, heads, block_size, head bytes)` (pagedkv.core.layout)."""
        fmt = self._fmt
        data, scale = side_data_bytes(fmt, head_dim), side_scale_bytes(fmt, head_dim)
        chunk = block_size * (data + scale)
        if self._part == "data":
            return _Layout(0, "uint8", (blocks, heads, block_size, data), (stride, chunk, data, 1))
        if self._part == "scale":
            return _Layout(block_size * data, "uint8", (blocks, heads, block_size, scale), (stride, chunk, scale, 1))
        element = _ELEMENT_DTYPES.get(fmt)
        if element is None:
            return _Layout(0, "uint8", (blocks, side_bytes(fmt, block_size * heads * head_dim)), (stride, 1))
        size = NUMPY_DTYPES[element].itemsize
        return _Layout(0, element, (blocks, heads, block_size, head_dim),
                       (stride, block_size * head_dim * size, head_dim * size, size))

    def __repr__(self) -> str:
        return f"PoolView(layer={self._layer_index}, side={self._side}, part={self._part}, {self._what()})"

    def exported_from(self, cache: Any) -> bool:
        """True when this view is of `cache`'s pools."""
        return self._cache is cache


class DeviceArrayPtr(DevicePtr, _MemoryExport):
    """A DevicePtr to a table export in a backend buffer that also knows the array's dtype
    and shape, so it is a DLPack producer (and a CAI v3 one on CUDA). It stays valid until
    the table's next export of the same kind, which may move the buffer."""

    def __new__(cls, address: int, host: np.ndarray, gpu: Any, stream: Any = 0) -> "DeviceArrayPtr":
        self = super().__new__(cls, address)
        name = host.dtype.name
        if name not in _TABLE_DTYPES:
            raise TypeError(f"a table export must be int32, int64 or uint8, got {name}")
        dlpack_device_of(gpu)
        self._shape, self._dtype_name, self._gpu, self._stream = tuple(host.shape), name, gpu, stream
        return self

    def __init__(self, *args, **kwargs):
        pass

    def _address(self) -> DevicePtr:
        return DevicePtr(int(self))

    def _extent(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64)) * NUMPY_DTYPES[self._dtype_name].itemsize

    def _layout(self) -> _Layout:
        size = NUMPY_DTYPES[self._dtype_name].itemsize
        strides = tuple(int(s) for s in np.cumprod((1,) + self._shape[:0:-1])[::-1] * size) if self._shape else ()
        return _Layout(0, self._dtype_name, self._shape, strides)


def export_dlpack(export, **kwargs):
    """`Exported.__dlpack__`: the device array when the table has a backend, else the host
    array; a page table (three arrays) raises TypeError pointing at its fields."""
    return _export_source(export).__dlpack__(**kwargs)


def export_dlpack_device(export) -> tuple[int, int]:
    """`Exported.__dlpack_device__`: the device of what `export_dlpack` exports."""
    return _export_source(export).__dlpack_device__()


def _export_source(export):
    source = export.host if export.device is None else export.device
    if isinstance(source, tuple):
        where = "host" if export.device is None else "device"
        raise TypeError(
            f"a page table export is three tensors: take export.{where}.indptr, .indices and .last_page_len"
        )
    return source
