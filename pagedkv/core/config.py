"""KvCacheConfig: the geometry of a paged KV cache and the byte size of its blocks (pure arithmetic)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .dtype import GROUP_SIZE, KvCacheDtype, side_bytes, side_data_bytes, side_scale_bytes
from .layer_groups import check_layer_groups
from .layout import SideLayout, parse_layout
from .validate import index_in_range, positive_int

MAX_BLOCK_SIZE = 2**16
"""The most tokens a block may hold."""
MAX_KV_HEADS = 2**12
"""The most KV heads a layer may have."""
MAX_HEAD_DIM = 2**14
"""The largest head_dim a layer may have."""
MAX_LAYERS = 2**12
"""The most layers a cache may have."""
MAX_BLOCKS_PER_SEQ = 2**31
"""The largest sliding window, in blocks."""
MAX_NUM_BLOCKS = 2**31 - 1
"""The most blocks a cache may have: block indices are int32 in the kernels and the tables."""
MAX_TP_SIZE = 2**10
"""The largest tensor-parallel group a cache may be a rank of."""

_BOUNDS = {
    "block_size": MAX_BLOCK_SIZE,
    "num_kv_heads": MAX_KV_HEADS,
    "head_dim": MAX_HEAD_DIM,
    "num_layers": MAX_LAYERS,
}


@dataclass(frozen=True)
class KvCacheConfig:
    """Shape and storage format of a paged KV cache.

    Layer `i` uses `layer_dtypes[i]` and `layer_dims[i]` (a `(num_kv_heads, head_dim)` pair)
    when `i` is below that sequence's length, else the global `dtype` / dims. Under
    `v_aliases_k` the V pool of every layer is its K pool (no V bytes exist).
    `cache_blocks_per_seq`, when set, is the sliding-window length in blocks.

    Every size is checked at construction (ValueError naming the field and value): a
    positive int no larger than its bound, `block_size` <= 2**16 (`MAX_BLOCK_SIZE`),
    `num_kv_heads` <= 2**12 (`MAX_KV_HEADS`, per layer too), `head_dim` <= 2**14
    (`MAX_HEAD_DIM`, per layer too), `num_layers` <= 2**12 (`MAX_LAYERS`) and
    `cache_blocks_per_seq` <= 2**31 (`MAX_BLOCKS_PER_SEQ`). A layer in a grouped format
    (nvfp4, turbo*, on either side) needs a head_dim that is a multiple of 16, since a
    group never straddles two heads.

    `layout` is "NHD" (the default: token major, docs/FORMATS.md) or "HND" (head major
    within each block, so one head's tokens, data and scales, are one contiguous chunk;
    `pagedkv.core.layout` and docs/LAYOUTS.md give the bytes).

    `tp_rank` / `tp_size` place the cache in a tensor-parallel group: the head counts above
    are this rank's (local) heads, and rank `r` holds global heads `[r * heads, (r + 1) *
    heads)` of a layer's `heads * tp_size` (`head_range`). A layer whose V aliases K (MLA:
    one latent head) is replicated: every rank holds the same head (0 of 1). `tp_size` is at
    most 2**10 (`MAX_TP_SIZE`) and `tp_rank` in `[0, tp_size)`.

    `layer_groups` (a tuple of `LayerGroup`) makes a hybrid cache: every layer in exactly
    one group, each attention group with its own block ids (see `pagedkv.groups`). Empty
    (the default) is one full-attention group of every layer: the cache of before.

    `k_scale` / `v_scale` are the fp8 sides' per-tensor dequantisation scales (`value =
    e4m3(byte) * scale`, docs/FORMATS.md), part of the cache's layout: every write and read
    of the cache uses them (an explicit, different scale is refused), a transfer peer or a
    disk tier directory with other scales over an fp8 layer is refused. Finite and positive
    as float32 (ValueError naming the field and value); 1.0 unless told.
    """

    block_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    dtype: KvCacheDtype | str
    layer_dtypes: tuple = ()
    layer_dims: tuple = ()
    cache_blocks_per_seq: int | None = None
    v_aliases_k: bool = False
    layout: str = "NHD"
    tp_rank: int = 0
    tp_size: int = 1
    layer_groups: tuple = ()
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("k_scale", "v_scale"):
            object.__setattr__(self, name, _scale(getattr(self, name), name))
        for name, bound in _BOUNDS.items():
            object.__setattr__(self, name, _bounded(getattr(self, name), name, bound))
        object.__setattr__(self, "dtype", KvCacheDtype.parse(self.dtype))
        dtypes = tuple(KvCacheDtype.parse(d) for d in self.layer_dtypes)
        dims = tuple(self._parse_dims(i, d) for i, d in enumerate(self.layer_dims))
        object.__setattr__(self, "layer_dtypes", dtypes)
        object.__setattr__(self, "layer_dims", dims)
        if len(dtypes) > self.num_layers:
            raise ValueError(
                f"layer_dtypes has {len(dtypes)} entries but num_layers is {self.num_layers}"
            )
        if len(dims) > self.num_layers:
            raise ValueError(f"layer_dims has {len(dims)} entries but num_layers is {self.num_layers}")
        if self.cache_blocks_per_seq is not None:
            object.__setattr__(
                self,
                "cache_blocks_per_seq",
                _bounded(self.cache_blocks_per_seq, "cache_blocks_per_seq", MAX_BLOCKS_PER_SEQ),
            )
        if not isinstance(self.v_aliases_k, bool):
            raise ValueError(f"v_aliases_k must be a bool, got {self.v_aliases_k!r}")
        object.__setattr__(self, "layout", parse_layout(self.layout))
        object.__setattr__(self, "tp_size", _bounded(self.tp_size, "tp_size", MAX_TP_SIZE))
        if isinstance(self.tp_rank, bool) or not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be an int in [0, {self.tp_size}) for tp_size {self.tp_size}, got {self.tp_rank!r}")
        for layer in range(self.num_layers):
            self._validate_layer(layer)
        if self.layer_groups != ():
            groups = check_layer_groups(self.layer_groups, self.num_layers, self.block_size, self.cache_blocks_per_seq)
            object.__setattr__(self, "layer_groups", groups)

    @staticmethod
    def _parse_dims(layer: int, dims: object) -> tuple[int, int]:
        try:
            heads, head_dim = dims  # type: ignore[misc]
        except (TypeError, ValueError):
            raise ValueError(
                f"layer_dims[{layer}] must be a (num_kv_heads, head_dim) pair, got {dims!r}"
            ) from None
        return (
            _bounded(heads, f"layer_dims[{layer}] num_kv_heads", MAX_KV_HEADS),
            _bounded(head_dim, f"layer_dims[{layer}] head_dim", MAX_HEAD_DIM),
        )

    def _validate_layer(self, layer: int) -> None:
        fmt = self.dtype_for_layer(layer)
        if self.v_aliases_k and fmt.is_asymmetric():
            raise ValueError(f"layer {layer}: v_aliases_k needs one format for K and V, got {fmt}")
        heads, head_dim = self.dims_for_layer(layer)
        if fmt.is_grouped() and head_dim % GROUP_SIZE:
            raise ValueError(
                f"layer {layer}: {fmt} stores {GROUP_SIZE}-element groups within a head but head_dim "
                f"is {head_dim}, not a multiple of {GROUP_SIZE} (a group would straddle two heads)"
            )

    def _check_layer(self, layer: int) -> int:
        return index_in_range(layer, self.num_layers, "layer", f"a cache of {self.num_layers} layers")

    def kv_scales(self) -> tuple[float, float]:
        """`(k_scale, v_scale)`: the fp8 sides' dequantisation scales."""
        return (self.k_scale, self.v_scale)

    def has_fp8_side(self) -> bool:
        """True when some layer stores a side in fp8 (the sides `k_scale` / `v_scale` apply to)."""
        return any(KvCacheDtype.FP8 in self.dtype_for_layer(layer).kv_pair() for layer in range(self.num_layers))

    def dtype_for_layer(self, layer: int) -> KvCacheDtype:
        """The storage format of `layer`."""
        self._check_layer(layer)
        return self.layer_dtypes[layer] if layer < len(self.layer_dtypes) else self.dtype

    def dims_for_layer(self, layer: int) -> tuple[int, int]:
        """`(num_kv_heads, head_dim)` of `layer`."""
        self._check_layer(layer)
        if layer < len(self.layer_dims):
            return self.layer_dims[layer]
        return (self.num_kv_heads, self.head_dim)

    def head_range(self, layer: int) -> tuple[int, int, int]:
        """(first global head, one past the last, global head count) of `layer` on this
        rank: `(r * heads, (r + 1) * heads, heads * tp_size)`, or `(0, heads, heads)` for a
        replicated layer (V aliases K)."""
        heads, _ = self.dims_for_layer(layer)
        if self.v_aliases_k:
            return (0, heads, heads)
        return (self.tp_rank * heads, (self.tp_rank + 1) * heads, heads * self.tp_size)

    def side_layout(self, layer: int, side: str) -> SideLayout:
        """The byte geometry of `layer`'s `side` ("K" or "V") blocks (`pagedkv.core.layout`)."""
        if side not in ("K", "V"):
            raise ValueError(f"side must be 'K' or 'V', got {side!r}")
        heads, head_dim = self.dims_for_layer(layer)
        k, v = self.dtype_for_layer(layer).kv_pair()
        fmt = k if side == "K" or self.v_aliases_k else v
        return SideLayout(fmt, self.block_size, heads, head_dim, self.layout)

    def elements_per_block_side(self, layer: int) -> int:
        """Values in one block side of `layer`: block_size * num_kv_heads * head_dim."""
        heads, head_dim = self.dims_for_layer(layer)
        return self.block_size * heads * head_dim

    def k_block_bytes_for_layer(self, layer: int) -> int:
        """Bytes of one K block of `layer` in its K side format."""
        k, _ = self.dtype_for_layer(layer).kv_pair()
        return side_bytes(k, self.elements_per_block_side(layer))

    def v_block_bytes_for_layer(self, layer: int) -> int:
        """Bytes of one V block of `layer` in its V side format (0 under `v_aliases_k`)."""
        if self.v_aliases_k:
            return 0
        _, v = self.dtype_for_layer(layer).kv_pair()
        return side_bytes(v, self.elements_per_block_side(layer))

    def block_bytes_for_layer(self, layer: int) -> int:
        """Bytes of one block of `layer`, K side (the seed's meaning)."""
        return self.k_block_bytes_for_layer(layer)

    def block_bytes(self) -> int:
        """Bytes of one block side for the global dtype and dims: the K side of an asymmetric dtype."""
        k, _ = self.dtype.kv_pair()
        return side_bytes(k, self.cache_stride_elements())

    def block_bytes_kv(self) -> int:
        """Exactly twice `block_bytes()`: one K and one V block of the global dtype, V assumed
        the K side's size (use `block_bytes_kv_all_layers` for real per-layer, per-side totals)."""
        return 2 * self.block_bytes()

    def block_bytes_kv_all_layers(self) -> int:
        """Bytes one block index costs across every layer: K + V each from the layer's own dims
        and side format, K only under `v_aliases_k`."""
        return sum(
            self.k_block_bytes_for_layer(layer) + self.v_block_bytes_for_layer(layer)
            for layer in range(self.num_layers)
        )

    def cache_stride_elements(self) -> int:
        """block_size * num_kv_heads * head_dim of the global dims."""
        return self.block_size * self.num_kv_heads * self.head_dim

    def nvfp4_data_bytes(self) -> int:
        """nvfp4 data bytes of one block side at the global dims (e/2)."""
        return side_data_bytes(KvCacheDtype.NVFP4, self.cache_stride_elements())

    def nvfp4_scale_bytes(self) -> int:
        """nvfp4 scale bytes of one block side at the global dims (e/16)."""
        return side_scale_bytes(KvCacheDtype.NVFP4, self.cache_stride_elements())

    def turbo4_data_bytes(self) -> int:
        """turbo4 data bytes of one block side at the global dims (e/2)."""
        return side_data_bytes(KvCacheDtype.TURBO4, self.cache_stride_elements())

    def turbo4_scale_bytes(self) -> int:
        """turbo4 scale bytes of one block side at the global dims (e/16)."""
        return side_scale_bytes(KvCacheDtype.TURBO4, self.cache_stride_elements())

    def turbo3_data_bytes(self) -> int:
        """turbo3 data bytes of one block side at the global dims (3e/8)."""
        return side_data_bytes(KvCacheDtype.TURBO3, self.cache_stride_elements())

    def turbo3_scale_bytes(self) -> int:
        """turbo3 scale bytes of one block side at the global dims (e/16)."""
        return side_scale_bytes(KvCacheDtype.TURBO3, self.cache_stride_elements())

    def turbo2_data_bytes(self) -> int:
        """turbo2 data bytes of one block side at the global dims (e/4)."""
        return side_data_bytes(KvCacheDtype.TURBO2, self.cache_stride_elements())

    def turbo2_scale_bytes(self) -> int:
        """turbo2 scale bytes of one block side at the global dims (e/16)."""
        return side_scale_bytes(KvCacheDtype.TURBO2, self.cache_stride_elements())

    def turbo8_data_bytes(self) -> int:
        """turbo8 data bytes of one block side at the global dims (e)."""
        return side_data_bytes(KvCacheDtype.TURBO8, self.cache_stride_elements())

    def turbo8_scale_bytes(self) -> int:
        """turbo8 scale bytes of one block side at the global dims (2e/16: BF16 scales)."""
        return side_scale_bytes(KvCacheDtype.TURBO8, self.cache_stride_elements())

    def has_mixed_formats(self) -> bool:
        """True when layers differ in format or dims, or a format is asymmetric."""
        fmts = {self.dtype_for_layer(layer) for layer in range(self.num_layers)}
        dims = {self.dims_for_layer(layer) for layer in range(self.num_layers)}
        return len(fmts) > 1 or len(dims) > 1 or any(f.is_asymmetric() for f in fmts)


def _bounded(value: object, what: str, bound: int) -> int:
    """`value` as a positive int no larger than `bound`; ValueError naming `what` otherwise."""
    number = positive_int(value, what)
    if number > bound:
        raise ValueError(f"{what} is {number}, past the bound of {bound}")
    return number


def _scale(value: object, name: str) -> float:
    """`value` as a float that is finite and positive in float32; ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise ValueError(f"{name} must be a finite positive number, got {value!r:.60}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite positive number, got {value!r:.60}") from None
    if not math.isfinite(number) or number <= 0 or number > 3.4028234663852886e38 or number < 1.401298464324817e-45:
        raise ValueError(f"{name} must be a finite positive number (as float32), got {value!r:.60}")
    return number
