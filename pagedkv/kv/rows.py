"""KV rows in and out of the pools: encode token rows of K and V into their slots and decode them back.

A slot is `block * block_size + offset`; -1 skips a token. Each side is encoded in its own
side format (turbo sides rotated, see `pagedkv.codecs`), and only the touched data rows and
their scale rows are copied, one copy per run of consecutive slots in a block (per head in
the HND layout; two for the grouped formats: data, then scales). The work is done on the host and moved with the
backend's synchronous `copy_h2d` / `copy_d2h` for host arrays; device arrays (and the
`out_k`/`out_v` read form) go to `pagedkv.kv_device`, one kernel launch on CudaBackend.

Values written must be finite: no format stores NaN or inf meaningfully (E4M3 has no inf and
one NaN in a group would poison its scale), so a NaN or inf in a row that would be written is
refused and nothing is written; rows whose slot is -1 are not inspected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..backends.protocol import DevicePtr, GpuBackend
from ..codecs import check_side_geometry, decode, encode
from ..codecs.side import as_float32_values, check_scale, require_finite
from ..core.dtype import KvCacheDtype, side_data_bytes, side_scale_bytes
from ..core.layout import SideLayout
from ..core.log import get_logger
from . import device_path as kv_device
from .pools import KvPools

SKIP_SLOT = -1
"""The slot value of a token that is neither written nor read."""

_log = get_logger("kv_rows")


@dataclass(frozen=True)
class _Side:
    """Where one side of a layer keeps a token: its format and byte geometry per block."""

    fmt: KvCacheDtype
    row_bytes: int
    scale_row_bytes: int
    data_section: int
    geometry: SideLayout

    @classmethod
    def of(cls, fmt: KvCacheDtype, block_size: int, heads: int, head_dim: int, layout: str = "NHD") -> "_Side":
        check_side_geometry(fmt, heads, head_dim)
        n = heads * head_dim
        return cls(fmt, side_data_bytes(fmt, n), side_scale_bytes(fmt, n), side_data_bytes(fmt, block_size * n),
                   SideLayout(fmt, block_size, heads, head_dim, layout))

    def data_offset(self, offset: int) -> int:
        """Byte offset, within an NHD block, of token `offset`'s data row."""
        return offset * self.row_bytes

    def scale_offset(self, offset: int) -> int:
        """Byte offset, within an NHD block, of token `offset`'s scale row (after the data section)."""
        return self.data_section + offset * self.scale_row_bytes

    def pieces(self, offset: int) -> list[tuple[slice, int, slice, int]]:
        """Where the rows of a run starting at token `offset` go in a block: per contiguous
        piece (data columns, data byte offset, scale columns, scale byte offset). NHD has
        one piece (whole rows); HND one per head (a head's tokens are contiguous)."""
        if self.geometry.layout == "NHD":
            return [(slice(None), self.data_offset(offset), slice(None), self.scale_offset(offset))]
        g = self.geometry
        db, sb = g.head_data_bytes, g.head_scale_bytes
        return [(slice(h * db, (h + 1) * db), g.data_offset(offset, h), slice(h * sb, (h + 1) * sb),
                 g.scale_offset(offset, h)) for h in range(g.heads)]


@dataclass(frozen=True)
class _Runs:
    """Valid tokens sorted by slot and cut into runs of consecutive offsets within a block."""

    order: np.ndarray  # token indices (into the caller's arrays) in slot order
    blocks: np.ndarray  # per run
    offsets: np.ndarray  # per run: first offset
    starts: np.ndarray  # per run: first position in `order`
    stops: np.ndarray


def layer_geometry(pools: KvPools, layer: int) -> tuple[int, int, KvCacheDtype, KvCacheDtype]:
    """(num_kv_heads, head_dim, K side format, V side format) of `layer` (validated)."""
    pools.layer(layer)  # validates the layer and that the pools are live
    config = pools.config()
    heads, head_dim = config.dims_for_layer(layer)
    k_fmt, v_fmt = config.dtype_for_layer(layer).kv_pair()
    return heads, head_dim, k_fmt, v_fmt


def _slots(pools: KvPools, slots, num_tokens: int | None, repeats: bool = False) -> np.ndarray:
    """`slots` as a checked int64 array: integers, 1-D, in the cache or -1, `num_tokens` long
    when given, and (unless `repeats`: reads may name a slot twice) each slot at most once."""
    if slots is None or isinstance(slots, (str, bytes)):
        raise TypeError(f"slots must be a 1-D sequence of int slots, got {type(slots).__name__} {slots!r:.60}")
    arr = np.asarray(slots)
    if arr.dtype == np.bool_ or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"slots must be integers (int64), got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"slots must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise IndexError(f"slot {int(arr.max())} outside the cache (beyond int64)")
    arr = arr.astype(np.int64)
    if num_tokens is not None and arr.size != num_tokens:
        raise ValueError(f"{arr.size} slots for {num_tokens} tokens")
    block_size = pools.config().block_size
    limit = pools.num_blocks() * block_size
    bad = (arr < SKIP_SLOT) | (arr >= limit)
    if bad.any():
        value = int(arr[np.argmax(bad)])
        raise IndexError(
            f"slot {value} outside the cache: slots run 0..{limit - 1} "
            f"({pools.num_blocks()} blocks x {block_size} tokens), -1 skips a token"
        )
    if repeats:
        return arr
    valid = arr[arr != SKIP_SLOT]
    unique, counts = np.unique(valid, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"slot {int(unique[np.argmax(counts > 1)])} appears more than once")
    return arr


def _runs(slots: np.ndarray, block_size: int) -> _Runs:
    order = np.flatnonzero(slots != SKIP_SLOT)
    order = order[np.argsort(slots[order], kind="stable")]
    sorted_slots = slots[order]
    blocks, offsets = np.divmod(sorted_slots, block_size)
    breaks = (np.diff(sorted_slots) != 1) | (np.diff(blocks) != 0)
    starts = np.concatenate([[0], np.flatnonzero(breaks) + 1]).astype(np.int64) if order.size else np.zeros(0, np.int64)
    stops = np.append(starts[1:], order.size).astype(np.int64)
    return _Runs(order, blocks[starts], offsets[starts], starts, stops)


def _values(name: str, values, heads: int, head_dim: int, num_tokens: int | None) -> np.ndarray:
    """`values` as float32 rows of this layer's dims: float32 and BF16 as they are, float64
    rounded to nearest float32 (a finite float64 beyond float32's range is refused by
    `_fits_float32` before anything is written)."""
    if isinstance(values, np.ndarray) and values.dtype == np.float64:
        with np.errstate(over="ignore", invalid="ignore"):
            values = values.astype(np.float32)
    x = as_float32_values(values, name, check_finite=False)
    if x.shape[1:] != (heads, head_dim) or (num_tokens is not None and x.shape[0] != num_tokens):
        raise ValueError(
            f"{name} must be shaped [num_tokens, {heads}, {head_dim}] for this layer, got {x.shape}"
        )
    return x


def _fits_float32(name: str, values, rows: np.ndarray) -> None:
    """ValueError naming the first finite float64 value of the written `rows` that rounds to
    an infinite float32; NaN/inf are left to `require_finite`."""
    if not isinstance(values, np.ndarray) or values.dtype != np.float64:
        return
    picked = values[rows]
    with np.errstate(over="ignore", invalid="ignore"):
        over = np.isfinite(picked) & np.isinf(picked.astype(np.float32))
    if over.any():
        where = [int(i) for i in np.argwhere(over)[0]]
        value = float(picked[tuple(where)])
        where[0] = int(rows[where[0]])
        raise ValueError(f"{name}[{', '.join(map(str, where))}] = {value!r} is beyond float32's range")


def write_tokens(
    pools: KvPools,
    layer: int,
    slots,
    k,
    v,
    gpu: GpuBackend,
    stream: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    check_blocks: Callable[[np.ndarray], None] | None = None,
    nonfinite: int = 0,
) -> None:
    """Encode token rows `k` and `v` ([num_tokens, num_kv_heads, head_dim] float32, BF16 or
    float64 (rounded to nearest float32 first), the layer's dims) into the slots of `layer`, each side in its own format (fp8 sides divide by
    `k_scale`/`v_scale`). Everything is validated before the first byte is written; waits for
    `stream` first. Under `v_aliases_k` V is not written (`v` may be None). Host arrays are
    encoded on the host and staged with synchronous `copy_h2d`. `check_blocks`, when given, is called with
    the destination blocks (unique, sorted) before anything is written, and may raise to
    refuse them.

    Device inputs (`pagedkv.DeviceArray`, DLPack producers on the backend's device,
    SequenceTable exports for `slots`) take `pagedkv.kv_device`: on CudaBackend one kernel
    launch enqueued on `stream` (no sync, allocation or copy; `check_blocks` is not called
    and slot values are not checked on the host; NaN/inf inputs add to the device counter
    at `nonfinite`), on HostBackend numpy views of its memory through the host codecs."""
    if kv_device.launch_prepared(pools, "w", layer, slots, k, v, gpu, stream, k_scale, v_scale, nonfinite):
        return  # the same call as an earlier one: its prepared launch
    if kv_device.is_device_input(k) or kv_device.is_device_input(v):
        check_scale(k_scale), check_scale(v_scale)
        if kv_device.has_kv_kernels(gpu):
            kv_device.write_tokens(pools, layer, layer_geometry(pools, layer), slots, k, v, gpu, stream, k_scale, v_scale, nonfinite)
            return
        k, v = (kv_device.host_view(x, what, gpu) if kv_device.is_device_input(x) else x
                for x, what in ((k, "k"), (v, "v")))
    slots = kv_device.host_slots(slots, gpu)
    heads, head_dim, k_fmt, v_fmt = layer_geometry(pools, layer)
    aliased = pools.config().v_aliases_k
    block_size, layout = pools.config().block_size, pools.config().layout
    k_side = _Side.of(k_fmt, block_size, heads, head_dim, layout)
    v_side = _Side.of(v_fmt, block_size, heads, head_dim, layout)
    check_scale(k_scale), check_scale(v_scale)
    k_values = _values("k", k, heads, head_dim, None)
    num_tokens = k_values.shape[0]
    v_values = None if aliased and v is None else _values("v", v, heads, head_dim, num_tokens)
    runs = _runs(_slots(pools, slots, num_tokens), block_size)
    if check_blocks is not None:
        check_blocks(np.unique(runs.blocks))
    _fits_float32("k", k, runs.order)
    if v_values is not None:
        _fits_float32("v", v, runs.order)
    require_finite(k_values, "k", runs.order)
    if v_values is not None:
        require_finite(v_values, "v", runs.order)
    jobs = [(k_side, k_values, k_scale, pools.k_block_ptr)]
    if not aliased:
        jobs.append((v_side, v_values, v_scale, pools.v_block_ptr))
    encoded = [(side, _encode_rows(side, values[runs.order], scale), ptr) for side, values, scale, ptr in jobs]
    gpu.synchronize(stream)
    copies = 0
    for side, (data, scales), block_ptr in encoded:
        for block, offset, start, stop in zip(runs.blocks, runs.offsets, runs.starts, runs.stops):
            base = block_ptr(layer, int(block))
            for data_cols, data_at, scale_cols, scale_at in side.pieces(int(offset)):
                gpu.copy_h2d(np.ascontiguousarray(data[start:stop, data_cols]), base.offset(data_at))
                copies += 1
                if side.scale_row_bytes:
                    gpu.copy_h2d(np.ascontiguousarray(scales[start:stop, scale_cols]), base.offset(scale_at))
                    copies += 1
    _log.debug("kv_tokens_written", layer=layer, tokens=int(runs.order.size), runs=int(runs.starts.size), copies=copies)


def _encode_rows(side: _Side, values: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(data rows [tokens, row_bytes], scale rows [tokens, scale_row_bytes]) of `values`."""
    tokens = values.shape[0]
    raw = np.frombuffer(encode(values, side.fmt, scale=scale), dtype=np.uint8) if tokens else np.zeros(0, np.uint8)
    data = raw[: tokens * side.row_bytes].reshape(tokens, side.row_bytes)
    scales = raw[tokens * side.row_bytes :].reshape(tokens, side.scale_row_bytes)
    return data, scales


def read_tokens(
    pools: KvPools,
    layer: int,
    slots,
    gpu: GpuBackend,
    unrotate: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    out_k=None,
    out_v=None,
    stream: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """(k, v) float32 [num_slots, num_kv_heads, head_dim] decoded from `layer`'s slots; a -1
    slot gives a row of zeros, and a slot named more than once gives its row each time (a
    decode batch whose sequences share a prefix-cached block; writes refuse repeats). Turbo sides come back in the model's basis unless
    `unrotate=False`; fp8 sides are multiplied by `k_scale`/`v_scale`. Under `v_aliases_k`
    V is a copy of K.

    The output form (`out_k` and `out_v` given: DeviceArrays or DLPack producers shaped
    [num_slots, heads, head_dim], float32 or BF16) returns (out_k, out_v) filled: on
    CudaBackend one kernel launch enqueued on `stream` (slots must then be on the device
    too; a slot outside the cache reads as zeros), on HostBackend the host decode written
    into that memory."""
    if (out_k is None) != (out_v is None):
        raise TypeError("give both out_k and out_v, or neither")
    if out_k is not None:
        if kv_device.launch_prepared(pools, "r", layer, slots, out_k, out_v, gpu, stream, unrotate, k_scale, v_scale):
            return out_k, out_v  # the same call as an earlier one: its prepared launch
        check_scale(k_scale), check_scale(v_scale)
        if kv_device.has_kv_kernels(gpu):
            return kv_device.read_tokens(pools, layer, layer_geometry(pools, layer), slots, gpu, stream, unrotate, k_scale, v_scale, out_k, out_v)
        k, v = read_tokens(pools, layer, slots, gpu, unrotate, k_scale, v_scale)
        views = []
        for out, values, what in ((out_k, k, "out_k"), (out_v, v, "out_v")):  # both checked before either is written
            view = kv_device.host_view(out, what, gpu) if kv_device.is_device_input(out) else out
            if view.shape != values.shape:
                raise ValueError(f"{what} must be shaped {values.shape}, got {view.shape}")
            if view.dtype.name not in ("float32", "bfloat16"):
                raise TypeError(f"{what} must be float32 or bfloat16, got dtype {view.dtype}")
            views.append((view, values))
        for view, values in views:
            view[...] = values.astype(view.dtype)
        return out_k, out_v
    slots = kv_device.host_slots(slots, gpu)
    heads, head_dim, k_fmt, v_fmt = layer_geometry(pools, layer)
    aliased = pools.config().v_aliases_k
    block_size, layout = pools.config().block_size, pools.config().layout
    check_scale(k_scale), check_scale(v_scale)
    arr = _slots(pools, slots, None, repeats=True)
    inverse = None
    if arr.size > 1:
        distinct, inverse = np.unique(arr, return_inverse=True)
        if distinct.size == arr.size:
            inverse = None  # every slot once: read in place
        else:
            arr = distinct  # a repeated slot (sequences sharing a cached block): read once, fan out
    runs = _runs(arr, block_size)
    k_side = _Side.of(k_fmt, block_size, heads, head_dim, layout)
    k = _read_side(pools.k_block_ptr, layer, k_side, runs, arr.size, (heads, head_dim), gpu, unrotate, k_scale)
    if aliased:
        k = k if inverse is None else k[inverse.reshape(-1)]
        return k, k.copy()
    v_side = _Side.of(v_fmt, block_size, heads, head_dim, layout)
    v = _read_side(pools.v_block_ptr, layer, v_side, runs, arr.size, (heads, head_dim), gpu, unrotate, v_scale)
    if inverse is not None:
        k, v = k[inverse.reshape(-1)], v[inverse.reshape(-1)]
    return k, v


def _read_side(block_ptr, layer: int, side: _Side, runs: _Runs, num_slots: int, dims: tuple[int, int],
               gpu: GpuBackend, unrotate: bool, scale: float) -> np.ndarray:
    tokens = runs.order.size
    out = np.zeros((num_slots, *dims), dtype=np.float32)
    if tokens == 0:
        return out
    data = np.empty((tokens, side.row_bytes), dtype=np.uint8)
    scales = np.empty((tokens, side.scale_row_bytes), dtype=np.uint8)
    for block, offset, start, stop in zip(runs.blocks, runs.offsets, runs.starts, runs.stops):
        base: DevicePtr = block_ptr(layer, int(block))
        if side.geometry.layout == "NHD":
            gpu.copy_d2h(base.offset(side.data_offset(int(offset))), data[start:stop])
            if side.scale_row_bytes:
                gpu.copy_d2h(base.offset(side.scale_offset(int(offset))), scales[start:stop])
            continue
        for data_cols, data_at, scale_cols, scale_at in side.pieces(int(offset)):
            piece = np.empty((stop - start, side.geometry.head_data_bytes), np.uint8)
            gpu.copy_d2h(base.offset(data_at), piece)
            data[start:stop, data_cols] = piece
            if side.scale_row_bytes:
                piece = np.empty((stop - start, side.geometry.head_scale_bytes), np.uint8)
                gpu.copy_d2h(base.offset(scale_at), piece)
                scales[start:stop, scale_cols] = piece
    raw = data.tobytes() + scales.tobytes()
    out[runs.order] = decode(raw, side.fmt, tokens, *dims, scale=scale, unrotate=unrotate)
    return out
