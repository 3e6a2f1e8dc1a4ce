"""KV rows on the device: the launches of `pagedkv_kv_write` / `pagedkv_kv_read`
(nvrtc_src/kv_rows.cu), byte-exact with the host codecs of pagedkv.codecs, and the
argument structures and geometry check of the same file's exact checksum kernels
(`pagedkv_kv_checksum_partial` / `_final`, launched by kernels.BlockKernels.reduce_kv_blocks).

`KvKernels` is a mixin of CudaBackend. Its launch methods take device addresses only and
enqueue one kernel launch on `stream`: no host synchronisation, no allocation and no copy
per call (the rotation sign tables are constants of the kernel source), so a step can be captured in a CUDA graph after a first call.
`KvSideArgs` names one side of a call: its format, pool and rows.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ..backends.protocol import BlockRegions, DevicePtr
from ..codecs.rotation import ROTATED_HEAD_DIMS
from ..core.dtype import SIDE_FORMATS, KvCacheDtype, side_bytes
from ..core.layout import parse_layout
from ..core.validate import index_in_range, non_negative_int, positive_int

KV_THREADS = 128
"""Threads per CTA of the KV row kernels (KV_THREADS in kv_rows.cu)."""

FORMAT_CODES = {
    KvCacheDtype.BF16: 0,
    KvCacheDtype.FP8: 1,
    KvCacheDtype.NVFP4: 2,
    KvCacheDtype.TURBO4: 3,
    KvCacheDtype.TURBO3: 4,
    KvCacheDtype.TURBO2: 5,
    KvCacheDtype.TURBO8: 6,
}
"""The FMT_* code of each side format in kv_rows.cu."""

SKIP_SIDE = -1
"""The format code of a side a call does not touch (V under v_aliases_k)."""

_SIDE_FIELDS = [
    ("fmt", ctypes.c_int32),
    ("pool", ctypes.c_uint64),
    ("block_stride", ctypes.c_int64),
    ("rows", ctypes.c_uint64),
    ("row_stride", ctypes.c_int64),
    ("bf16", ctypes.c_int32),
    ("scale", ctypes.c_float),
    ("first", ctypes.c_int32),
    ("last", ctypes.c_int32),
    ("hnd", ctypes.c_int32),
]


def _fields() -> list:
    head = [
        ("slots", ctypes.c_uint64),
        ("num_tokens", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("limit", ctypes.c_int64),
        ("inv_sqrt_n", ctypes.c_float),
        ("nonfinite", ctypes.c_uint64),
    ]
    tail = [("layers", ctypes.c_uint64), ("num_layers", ctypes.c_int32)]
    return head + [(f"k_{n}", t) for n, t in _SIDE_FIELDS] + [(f"v_{n}", t) for n, t in _SIDE_FIELDS] + tail


class KvWriteArgs(ctypes.Structure):
    """Parameters of `pagedkv_kv_write` / `pagedkv_kv_write16` (kv_rows.cu): one layer's sides
    inline (`num_layers` 0) or a device layer table."""

    _fields_ = _fields()


class KvReadArgs(ctypes.Structure):
    """Parameters of `pagedkv_kv_read` / `pagedkv_kv_read16` (kv_rows.cu), laid out as
    KvWriteArgs (`nonfinite` unused)."""

    _fields_ = _fields()


class KvLayerSide(ctypes.Structure):
    """One side of one layer in the device layer table of `pagedkv_kv_write` / `_read`
    (struct KvLayerSide in kv_rows.cu)."""

    _fields_ = [
        ("pool", ctypes.c_uint64),
        ("block_stride", ctypes.c_int64),
        ("rows", ctypes.c_uint64),
        ("row_stride", ctypes.c_int64),
        ("fmt", ctypes.c_int32),
        ("bf16", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("first", ctypes.c_int32),
        ("last", ctypes.c_int32),
        ("hnd", ctypes.c_int32),
    ]


class KvLayer(ctypes.Structure):
    """One layer of the device layer table of `pagedkv_kv_write` / `_read` (struct KvLayer in kv_rows.cu)."""

    _fields_ = [
        ("heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("inv_sqrt_n", ctypes.c_float),
        ("pad", ctypes.c_int32),
        ("side", KvLayerSide * 2),
    ]


class KvCheckSlotsArgs(ctypes.Structure):
    """Parameters of `pagedkv_kv_check_slots` (kv_rows.cu)."""

    _fields_ = [
        ("slots", ctypes.c_uint64),
        ("num_tokens", ctypes.c_int32),
        ("limit", ctypes.c_int64),
        ("duplicate", ctypes.c_uint64),
    ]


ONE_PATH_KERNELS = ("_nvfp4", "_turbo_h128", "_turbo8_h128")
"""Suffixes of kv_rows.cu's one-path row kernels (`pagedkv_kv_write_nvfp4`, ...): sides of one
kind on one path only, each with that path's registers alone and a batch of units a warp
loads at once (see `row_kernel_suffix`)."""

KERNEL_TABLE = [("pagedkv_kv_write", KvWriteArgs, KV_THREADS), ("pagedkv_kv_read", KvReadArgs, KV_THREADS),
                ("pagedkv_kv_write16", KvWriteArgs, KV_THREADS), ("pagedkv_kv_read16", KvReadArgs, KV_THREADS),
                *[(f"pagedkv_kv_{op}{suffix}", args, KV_THREADS)
                  for suffix in ONE_PATH_KERNELS for op, args in (("write", KvWriteArgs), ("read", KvReadArgs))],
                ("pagedkv_kv_check_slots", KvCheckSlotsArgs, KV_THREADS)]
"""(kernel name, argument structure, threads per CTA) of kv_rows.cu's row kernels; the `16`
ones take bf16 and fp8 sides only (fewer registers, more CTAs an SM), the ONE_PATH_KERNELS
ones the sides of their one path."""

WARPS = KV_THREADS // 32

_NO_INLINE_LAYER = {"heads": 0, "head_dim": 0, "inv_sqrt_n": 0.0,
                    **{f"{p}_{n}": (-1 if n in ("fmt", "first", "last") else (1.0 if n == "scale" else 0))
                       for p in "kv" for n, _ in _SIDE_FIELDS}}
"""The inline layer fields of a layer-table launch (unused by the kernel)."""
_ROWS16 = frozenset((0, 1, -1))  # FMT_BF16, FMT_FP8, a skipped side
_TURBO_KIND = {3: 3, 4: 3, 5: 3, 6: 6}  # FMT_TURBO4/3/2 share one kind (FMT_TURBO4); FMT_TURBO8 its own


def _side_path(fmt: int, first: int, head_dim: int) -> str | None:
    """The one-path kernel suffix a side fits (None: only the every-format kernels)."""
    if fmt == 2:
        return "_nvfp4"
    if fmt in _TURBO_KIND and first >= 0 and head_dim == 128:
        return "_turbo_h128" if _TURBO_KIND[fmt] == 3 else "_turbo8_h128"
    return None


def row_kernel_suffix(sides) -> str:
    """The suffix of the row kernel for sides given as (format code, first sign table,
    head_dim): "16" when every side is bf16, fp8 or skipped; a ONE_PATH_KERNELS suffix when
    every side that is not skipped fits that one path (nvfp4; rotated turbo4/3/2 of head_dim
    128; rotated turbo8 of head_dim 128); else "" (the every-format kernels)."""
    sides = [s for s in sides if s[0] != SKIP_SIDE]
    if all(fmt in _ROWS16 for fmt, _, _ in sides):
        return "16"
    paths = {_side_path(*s) for s in sides}
    return paths.pop() if len(paths) == 1 and None not in paths else ""


def side_units(fmt: int, heads: int, head_dim: int, first: int, tokens: int, hnd: bool = False) -> int:
    """Warp units of one side of a launch (kv_rows.cu's side_units): what sizes the grid. A
    side of HND blocks (`hnd`) runs as `heads` one-head sides (kv_launch in kv_rows.cu), each
    rounding its own units up."""
    if fmt < 0:
        return 0
    if hnd and heads > 1:
        return heads * side_units(fmt, 1, head_dim, first, tokens)
    n = heads * head_dim
    if fmt <= 1:
        return (tokens * ((n + 15) // 16) + 31) // 32
    if first >= 0:
        return tokens * heads
    return (tokens * (n // 16) + 31) // 32


def layers_units(table: "ctypes.Array") -> tuple[int, int]:
    """(per token, fixed): an upper bound of the warp units of a layer-table launch of t tokens
    is per_token * t + fixed (each flat side rounds up once)."""
    per_token, fixed = 0, 0
    for entry in table:
        for side in entry.side:
            # an HND side of several heads is that many one-head sides (kv_launch in kv_rows.cu)
            sides, heads = (entry.heads, 1) if side.hnd and entry.heads > 1 else (1, entry.heads)
            n = heads * entry.head_dim
            if side.fmt < 0:
                continue
            if side.fmt <= 1:
                per_token += sides * -(-n // 16)
                fixed += sides
            elif side.first >= 0:
                per_token += 32 * entry.heads
            else:
                per_token += sides * (n // 16)
                fixed += sides
    return -(-per_token // 32), fixed
"""(kernel name, argument structure, threads per CTA) of kv_rows.cu's row kernels."""


class KvChecksumPartialArgs(ctypes.Structure):
    """Parameters of `pagedkv_kv_checksum_partial` (kv_rows.cu)."""

    _fields_ = [
        ("pool", ctypes.c_uint64),
        ("block_stride", ctypes.c_int64),
        ("blocks", ctypes.c_uint64),
        ("num_blocks", ctypes.c_int32),
        ("fmt", ctypes.c_int32),
        ("row_elements", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("partials", ctypes.c_uint64),
    ]


class KvChecksumFinalArgs(ctypes.Structure):
    """Parameters of `pagedkv_kv_checksum_final` (kv_rows.cu)."""

    _fields_ = [
        ("partials", ctypes.c_uint64),
        ("num_partials", ctypes.c_int32),
        ("out", ctypes.c_uint64),
    ]


CHECKSUM_KERNELS = [("pagedkv_kv_checksum_partial", KvChecksumPartialArgs), ("pagedkv_kv_checksum_final", KvChecksumFinalArgs)]
"""(kernel name, argument structure) of kv_rows.cu's checksum kernels, launched with
nvrtc.REDUCE_THREADS threads (its -DCHECKSUM_THREADS)."""

_INT32_MAX = 2**31 - 1


def check_kv_side_row(
    regions: BlockRegions, region: int, fmt: KvCacheDtype, block_size: int, row_elements: int
) -> tuple[int, int, int, KvCacheDtype]:
    """`(region, base, stride, fmt)` of the pool row a checksum reads, after checking the
    index, that `fmt` is a side format, that `block_size` and `row_elements` (values a
    token: heads * head_dim, a multiple of 16) are positive ints the kernels take, and that
    a block of that geometry is exactly the row's block size; IndexError/ValueError/
    TypeError name the bad value."""
    region = index_in_range(region, len(regions), "region", f"a table of {len(regions)} regions")
    if not isinstance(fmt, KvCacheDtype) or fmt not in FORMAT_CODES:
        raise ValueError(f"fmt must be a side format ({', '.join(f.value for f in FORMAT_CODES)}), got {fmt!r}")
    block_size = positive_int(block_size, "block_size")
    row_elements = positive_int(row_elements, "row_elements")
    if row_elements % 16:
        raise ValueError(f"row_elements must be a multiple of 16, got {row_elements}")
    if block_size * row_elements > _INT32_MAX:
        raise ValueError(f"a block of {block_size} x {row_elements} values is above the kernels' limit {_INT32_MAX}")
    nbytes = int(regions.nbytes[region])
    want = side_bytes(fmt, block_size * row_elements)
    if want != nbytes:
        raise ValueError(
            f"region {region} holds {nbytes}-byte blocks; {fmt.value} of {block_size} x {row_elements} values "
            f"is {want} bytes"
        )
    return region, int(regions.bases[region]), int(regions.strides[region]), fmt


def checksum_chunks(blocks: np.ndarray, fmt: KvCacheDtype, block_size: int, row_elements: int, stride: int,
                    layout: str, heads: int | None) -> tuple[np.ndarray, int, int]:
    """(blocks, stride, row_elements) the checksum kernel reads for the listed `blocks` (int64)
    of a pool of `layout` blocks with `heads` heads of `row_elements // heads` values, whose
    blocks are `stride` bytes apart. The kernel reads a block as its data section then its
    scale section (NHD); an HND block of a grouped format is `heads` chunks, each byte for
    byte an NHD block of one head (docs/LAYOUTS.md), so such a block is handed over as its
    chunks: chunk h of block b is "block" b * (stride / chunk) + h of a pool of chunk-sized
    blocks (the sums do not depend on the order of the values). NHD, one head, and bf16 / fp8
    (a block all values, no scales) keep their blocks, whatever their head_dim. `heads` may
    be None for NHD only (an HND block's chunks cannot be found without it). ValueError
    naming the bad value: `layout` not a layout, `heads` None for HND or not a positive int,
    and, only where a block is split into head chunks, `heads` not splitting a token into
    heads of whole multiples of 16 values, an HND stride that is not a whole number of
    chunks, or a chunk index past the kernels' int32 limit."""
    layout = parse_layout(layout)
    if heads is None:
        if layout == "HND":
            raise ValueError("heads must be given for layout HND (the heads a token, which place its head chunks), got None")
        heads = 1
    heads = positive_int(heads, "heads")
    if layout == "NHD" or heads == 1 or not SIDE_FORMATS[fmt].grouped:
        return blocks, stride, row_elements
    if row_elements % heads or (row_elements // heads) % 16:
        raise ValueError(f"heads must split {row_elements} values a token into heads of a multiple of 16, got {heads}")
    chunk = side_bytes(fmt, block_size * row_elements) // heads
    if stride % chunk:
        raise ValueError(f"an HND block stride of {stride} bytes is not a whole number of {chunk}-byte head chunks")
    per_block = stride // chunk
    chunks = (blocks.astype(np.int64)[:, None] * per_block + np.arange(heads, dtype=np.int64)).reshape(-1)
    if chunks.size and int(chunks.max()) > _INT32_MAX:
        raise ValueError(f"head chunk index {int(chunks.max())} is above the kernels' limit {_INT32_MAX}")
    return chunks, chunk, row_elements // heads


MAX_LAUNCH_HEADS = 2**16 - 1
"""The most heads a layer of a row launch may have (kv_rows.cu counts (side, head chunk) in
one int, the chunk in the low 16 bits)."""

MAX_LAUNCH_LAYERS = 2**14 - 1
"""The most layers a layer table may hold and a layer launch (`kv_write_layers` /
`kv_read_layers`) may take (its 2 * layers sides in the word's 15 upper bits)."""


def _check_launch_counts(heads: int, layers: int = 1) -> None:
    if heads > MAX_LAUNCH_HEADS:
        raise ValueError(f"heads is {heads}, more than a row launch's {MAX_LAUNCH_HEADS}")
    if layers > MAX_LAUNCH_LAYERS:
        raise ValueError(f"a layer table of {layers} layers is more than a row launch's {MAX_LAUNCH_LAYERS}")


def _inv_sqrt_n(head_dim: int) -> float:
    return float(np.float32(1.0 / np.sqrt(head_dim)))


@dataclass(frozen=True)
class KvSideArgs:
    """One side of a KV row launch: side format `fmt` (or None: not touched), the pool's
    first block `pool` and `block_stride` bytes between blocks, the token rows at `rows`
    (float32, or BF16 when `bf16`), `row_stride` elements apart, `[heads, head_dim]`
    contiguous within a row; `scale` is fp8's dequantisation scale; `rotated` asks for the
    Walsh-Hadamard rotation (write) or unrotation (read) of a turbo side whose head_dim
    has one; `layout` is the pool's block layout, "NHD" or "HND" (pagedkv.core.layout;
    ValueError naming anything else)."""

    fmt: KvCacheDtype | None
    pool: int
    block_stride: int
    rows: int
    row_stride: int
    bf16: bool = False
    scale: float = 1.0
    rotated: bool = True
    layout: str = "NHD"

    def __post_init__(self):
        parse_layout(self.layout)


SIGN_TABLE_WORDS = {128: (0, 4), 256: (8, 16), 512: (24, 40)}
"""head_dim -> (signs1, signs2) word offsets in kv_rows.cu's WHT_SIGNS bit-mask table."""


class KvKernels:
    """The KV row half of CudaBackend (a mixin: CudaBackend provides `_enter`, `_lock`,
    `_stream`, `_launchers` and `_grid`)."""

    def _side_fields(self, prefix: str, side: KvSideArgs, head_dim: int, reading: bool) -> dict:
        if side.fmt is None:
            fields = dict(fmt=SKIP_SIDE, pool=0, block_stride=0, rows=0, row_stride=0, bf16=0, scale=1.0, first=-1, last=-1,
                          hnd=0)
        else:
            first = last = -1
            if side.rotated and SIDE_FORMATS[side.fmt].rotated and head_dim in ROTATED_HEAD_DIMS:
                s1, s2 = SIGN_TABLE_WORDS[head_dim]
                first, last = (s2, s1) if reading else (s1, s2)
            fields = dict(
                fmt=FORMAT_CODES[side.fmt], pool=int(side.pool), block_stride=int(side.block_stride),
                rows=int(side.rows), row_stride=int(side.row_stride), bf16=int(bool(side.bf16)),
                scale=float(np.float32(side.scale)), first=first, last=last, hnd=int(side.layout == "HND"),
            )
        return {f"{prefix}_{k}": v for k, v in fields.items()}

    def kv_layer_table(self, layers, reading: bool = False) -> bytes:
        """The device table of `kv_write_layers` (`kv_read_layers` when `reading`): for each
        layer of `layers`, (heads, head_dim, K side, V side) as KvSideArgs of the rows to write
        (or the output rows to decode into; a side with fmt None is not touched), packed as
        kv_rows.cu's KvLayer array."""
        return bytes(self._layer_table(layers, reading))

    def _layer_table(self, layers, reading: bool):
        _check_launch_counts(max((entry[0] for entry in layers), default=1), len(layers))
        table = (KvLayer * len(layers))()
        for entry, (heads, head_dim, k, v) in zip(table, layers):
            entry.heads, entry.head_dim, entry.inv_sqrt_n = heads, head_dim, _inv_sqrt_n(head_dim)
            for i, (prefix, side) in enumerate((("k", k), ("v", v))):
                fields = self._side_fields(prefix, side, head_dim, reading)
                target = entry.side[i]
                target.pool, target.block_stride = fields[f"{prefix}_pool"], fields[f"{prefix}_block_stride"]
                target.rows, target.row_stride = fields[f"{prefix}_rows"], fields[f"{prefix}_row_stride"]
                target.fmt, target.bf16, target.scale = fields[f"{prefix}_fmt"], fields[f"{prefix}_bf16"], fields[f"{prefix}_scale"]
                target.first, target.last = fields[f"{prefix}_first"], fields[f"{prefix}_last"]
                target.hnd = fields[f"{prefix}_hnd"]
        return table

    def kv_layer_launch(self, table_bytes: bytes) -> tuple[str, int, int]:
        """(row kernel suffix, units per token, fixed units) of a layer table's bytes: what
        `kv_write_layers` / `kv_read_layers` take to pick their kernel (`row_kernel_suffix`
        of every side of the table) and size the grid."""
        table = (KvLayer * (len(table_bytes) // ctypes.sizeof(KvLayer))).from_buffer_copy(table_bytes)
        suffix = row_kernel_suffix((side.fmt, side.first, entry.head_dim) for entry in table for side in entry.side)
        per_token, fixed = layers_units(table)
        return suffix, per_token, fixed

    def kv_write_layers(self, table: DevicePtr, num_layers: int, slots: DevicePtr, num_tokens: int,
                        block_size: int, limit: int, stream: int, nonfinite: int = 0,
                        launch: tuple[str, int, int] | None = None) -> None:
        """Enqueue on `stream` one launch writing `num_tokens` rows of each of the
        `num_layers` layers of the device table at `table` (`kv_layer_table`'s bytes, in
        this backend's memory) into the slots at `slots`, as `kv_write_rows` does per layer.
        `launch` is `kv_layer_launch` of the table (None: the every-format kernel at the
        grid's most CTAs). `num_layers` must be an int in 0..MAX_LAUNCH_LAYERS (ValueError
        naming it, before anything is enqueued); nothing is checked on the device."""
        self._layers_launch("pagedkv_kv_write", table, num_layers, slots, num_tokens, block_size, limit,
                            stream, launch, int(nonfinite))

    def kv_read_layers(self, table: DevicePtr, num_layers: int, slots: DevicePtr, num_tokens: int,
                       block_size: int, limit: int, stream: int, launch: tuple[str, int, int] | None = None) -> None:
        """Enqueue on `stream` one launch decoding the `num_tokens` slots at `slots` of each of
        the `num_layers` layers of the device table at `table` (`kv_layer_table(...,
        reading=True)`'s bytes) into each layer's output rows (a slot outside 0..limit-1
        gives zeros). `launch` and the `num_layers` check as for `kv_write_layers`."""
        self._layers_launch("pagedkv_kv_read", table, num_layers, slots, num_tokens, block_size, limit,
                            stream, launch, 0)

    def _layers_launch(self, name: str, table, num_layers: int, slots, num_tokens: int, block_size: int, limit: int,
                       stream, launch, nonfinite: int) -> None:
        handle = self._stream(stream)
        # kv_launch counts (side, chunk) in one int, the side in the upper 16 bits: 2 *
        # num_layers sides past 2^15 overflow it (and read past the table)
        num_layers = non_negative_int(num_layers, "num_layers")
        if num_layers > MAX_LAUNCH_LAYERS:
            raise ValueError(f"num_layers is {num_layers}, more than a layer launch's {MAX_LAUNCH_LAYERS}")
        if num_tokens == 0 or num_layers == 0:
            return
        suffix, per_token, fixed = launch if launch is not None else ("", 1 << 30, 0)
        name += suffix
        units = per_token * num_tokens + fixed
        with self._lock:
            self._enter()
            self._launchers[name].launch(
                self._grid(name, -(-units // WARPS)), handle, **_NO_INLINE_LAYER, layers=int(table),
                num_layers=num_layers, slots=int(slots), num_tokens=num_tokens, block_size=block_size, limit=limit,
                nonfinite=nonfinite)

    def _kv_prepare(self, name: str, slots: int, num_tokens: int, heads: int, head_dim: int, block_size: int,
                    limit: int, k: KvSideArgs, v: KvSideArgs, extra: dict) -> "PreparedLaunch | None":
        """The launch `_kv_launch` would enqueue, prepared (None for 0 tokens)."""
        if num_tokens == 0:
            return None
        _check_launch_counts(heads)
        inv_sqrt_n = _inv_sqrt_n(head_dim)
        fields = dict(
            slots=int(slots), num_tokens=num_tokens, heads=heads, head_dim=head_dim, block_size=block_size,
            limit=limit, inv_sqrt_n=inv_sqrt_n, **extra,
            **self._side_fields("k", k, head_dim, name.endswith("read")),
            **self._side_fields("v", v, head_dim, name.endswith("read")),
        )
        name += row_kernel_suffix((fields[f"{p}_fmt"], fields[f"{p}_first"], head_dim) for p in "kv")
        units = (side_units(fields["k_fmt"], heads, head_dim, fields["k_first"], num_tokens, fields["k_hnd"])
                 + side_units(fields["v_fmt"], heads, head_dim, fields["v_first"], num_tokens, fields["v_hnd"]))
        from .launch import PreparedLaunch  # not at import: pagedkv.kv_device imports this module

        return PreparedLaunch(self, self._launchers[name], self._grid(name, -(-units // WARPS)),
                              dict(fields, layers=0, num_layers=0))

    def kv_prepare_write(self, slots: DevicePtr, num_tokens: int, heads: int, head_dim: int, block_size: int,
                         limit: int, k: KvSideArgs, v: KvSideArgs, nonfinite: int = 0) -> "PreparedLaunch | None":
        """`kv_write_rows` with these arguments as a PreparedLaunch (`launch(stream)` is then
        one cuLaunchKernel, nothing rebuilt); None for 0 tokens."""
        return self._kv_prepare("pagedkv_kv_write", slots, num_tokens, heads, head_dim, block_size, limit, k, v,
                                {"nonfinite": int(nonfinite)})

    def kv_prepare_read(self, slots: DevicePtr, num_tokens: int, heads: int, head_dim: int, block_size: int,
                        limit: int, k: KvSideArgs, v: KvSideArgs) -> "PreparedLaunch | None":
        """`kv_read_rows` with these arguments as a PreparedLaunch; None for 0 tokens."""
        return self._kv_prepare("pagedkv_kv_read", slots, num_tokens, heads, head_dim, block_size, limit, k, v,
                                {"nonfinite": 0})

    def kv_prepare_check_slots(self, slots: DevicePtr, num_tokens: int, limit: int,
                               duplicate: int) -> "PreparedLaunch | None":
        """The debug check of a write's slots as a PreparedLaunch: the smallest slot in
        0..limit-1 that two of the `num_tokens` slots name goes into the device uint64 at
        `duplicate` (atomicMin; all ones: none). None for 0 tokens."""
        if num_tokens == 0:
            return None
        from .launch import PreparedLaunch

        name = "pagedkv_kv_check_slots"
        return PreparedLaunch(self, self._launchers[name], self._grid(name, -(-num_tokens // KV_THREADS)),
                              dict(slots=int(slots), num_tokens=num_tokens, limit=limit, duplicate=int(duplicate)))

    def kv_prepare_layers(self, reading: bool, table: DevicePtr, num_layers: int, slots: DevicePtr, num_tokens: int,
                          block_size: int, limit: int, nonfinite: int = 0,
                          launch: tuple[str, int, int] | None = None) -> "PreparedLaunch | None":
        """`kv_write_layers` (`kv_read_layers` when `reading`) as a PreparedLaunch; None for
        no tokens or layers."""
        if num_tokens == 0 or num_layers == 0:
            return None
        name = "pagedkv_kv_read" if reading else "pagedkv_kv_write"
        suffix, per_token, fixed = launch if launch is not None else ("", 1 << 30, 0)
        name += suffix
        units = per_token * num_tokens + fixed
        fields = dict(_NO_INLINE_LAYER, layers=int(table), num_layers=num_layers, slots=int(slots),
                      num_tokens=num_tokens, block_size=block_size, limit=limit, nonfinite=int(nonfinite))
        from .launch import PreparedLaunch

        return PreparedLaunch(self, self._launchers[name], self._grid(name, -(-units // WARPS)), fields)

    def _kv_launch(self, name: str, slots: int, num_tokens: int, heads: int, head_dim: int, block_size: int,
                   limit: int, k: KvSideArgs, v: KvSideArgs, stream: int, extra: dict) -> None:
        handle = self._stream(stream)
        if num_tokens == 0:
            return
        _check_launch_counts(heads)
        inv_sqrt_n = _inv_sqrt_n(head_dim)
        with self._lock:
            self._enter()
            fields = dict(
                slots=int(slots), num_tokens=num_tokens, heads=heads, head_dim=head_dim, block_size=block_size,
                limit=limit, inv_sqrt_n=inv_sqrt_n, **extra,
                **self._side_fields("k", k, head_dim, name.endswith("read")),
                **self._side_fields("v", v, head_dim, name.endswith("read")),
            )
            name += row_kernel_suffix((fields[f"{p}_fmt"], fields[f"{p}_first"], head_dim) for p in "kv")
            units = (side_units(fields["k_fmt"], heads, head_dim, fields["k_first"], num_tokens, fields["k_hnd"])
                     + side_units(fields["v_fmt"], heads, head_dim, fields["v_first"], num_tokens, fields["v_hnd"]))
            self._launchers[name].launch(self._grid(name, -(-units // WARPS)), handle, layers=0, num_layers=0,
                                         **fields)

    def kv_write_rows(self, slots: DevicePtr, num_tokens: int, heads: int, head_dim: int, block_size: int,
                      limit: int, k: KvSideArgs, v: KvSideArgs, stream: int, nonfinite: int = 0) -> None:
        """Enqueue on `stream` the encoding of `num_tokens` rows of each side into the slots
        at `slots` (device int64; a slot outside 0..limit-1, -1 included, is skipped), one
        launch for both sides; NaN/inf inputs add to the device uint64 at `nonfinite` (when
        not 0). The caller has validated geometry and addresses; nothing is checked on the
        device."""
        self._kv_launch("pagedkv_kv_write", slots, num_tokens, heads, head_dim, block_size, limit, k, v, stream,
                        {"nonfinite": int(nonfinite)})

    def kv_read_rows(self, slots: DevicePtr, num_tokens: int, heads: int, head_dim: int, block_size: int,
                     limit: int, k: KvSideArgs, v: KvSideArgs, stream: int) -> None:
        """Enqueue on `stream` the decoding of the slots at `slots` into each side's rows
        (float32 or BF16; a slot outside 0..limit-1 gives zeros), one launch for both sides;
        turbo sides are unrotated when the side asks for `rotated`."""
        self._kv_launch("pagedkv_kv_read", slots, num_tokens, heads, head_dim, block_size, limit, k, v, stream,
                        {"nonfinite": 0})
