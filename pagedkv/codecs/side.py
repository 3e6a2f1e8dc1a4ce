"""One block side in the byte layout of FORMATS.md: `encode` values to bytes, `decode` back.

A side holds `block_size` token rows of `n = num_kv_heads * head_dim` elements. bf16 and
fp8 store the elements; the grouped formats store data rows then scale rows. Turbo sides
are rotated per head vector (head_dim 128, 256, 512) before encoding.
"""

from __future__ import annotations

import numpy as np

from ..core.dtype import GROUP_SIZE, SIDE_FORMATS, KvCacheDtype, side_bytes, side_data_bytes
from ..core.lazy_dtypes import ml
from . import groups
from .codebooks import turbo_codebook
from .floats import bf16_decode, bf16_encode, e4m3_decode, e4m3_encode
from .packing import pack, unpack
from .rotation import rotate as _rotate
from .rotation import unrotate as _unrotate


def side_format(fmt: "KvCacheDtype | str") -> KvCacheDtype:
    """`fmt` parsed and checked to be one of the seven symmetric side formats."""
    parsed = KvCacheDtype.parse(fmt)
    if parsed not in SIDE_FORMATS:
        k, v = parsed.kv_pair()
        raise ValueError(
            f"{parsed} is asymmetric: encode each side in its own format ({k} for K, {v} for V, "
            f"from kv_pair())"
        )
    return parsed


def check_side_geometry(fmt: KvCacheDtype, num_kv_heads: int, head_dim: int) -> None:
    """Raise ValueError when a grouped format is asked for a head_dim not a multiple of 16."""
    for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if fmt.is_grouped() and head_dim % GROUP_SIZE:
        raise ValueError(
            f"{fmt} stores {GROUP_SIZE}-element groups within a head: head_dim {head_dim} is not "
            f"a multiple of {GROUP_SIZE}"
        )


def check_scale(scale: float) -> np.float32:
    """`scale` as float32; ValueError unless it is finite and positive."""
    value = np.float32(scale)
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    return value


def as_float32_values(values, what: str = "values", check_finite: bool = True) -> np.ndarray:
    """`values` (float32 or ml_dtypes.bfloat16, shaped [tokens, heads, head_dim]) as a float32
    array; TypeError for another dtype, ValueError for another rank or (with `check_finite`)
    a NaN/inf."""
    if not isinstance(values, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(values).__name__}")
    if values.dtype not in (np.dtype(np.float32), np.dtype(ml().bfloat16)):
        raise TypeError(f"{what} must be float32 or bfloat16, got dtype {values.dtype}")
    if values.ndim != 3:
        raise ValueError(f"{what} must be shaped [tokens, num_kv_heads, head_dim], got shape {values.shape}")
    out = values.astype(np.float32)
    if check_finite:
        require_finite(out, what)
    return out


def require_finite(x: np.ndarray, what: str, rows: np.ndarray | None = None) -> None:
    """ValueError naming the first NaN or inf of `x` (only the listed `rows` when given; the
    index reported is the row's index in `x`)."""
    picked = x if rows is None else x[rows]
    finite = np.isfinite(picked)
    if not finite.all():
        where = [int(i) for i in np.argwhere(~finite)[0]]
        value = picked[tuple(where)]
        if rows is not None:
            where[0] = int(rows[where[0]])
        raise ValueError(
            f"{what} holds a non-finite value {value} at index {tuple(where)}: no format stores NaN or inf"
        )


def encode(values, fmt, *, scale: float = 1.0, rotate: bool = True) -> bytes:
    """One block side of `block_size = values.shape[0]` in `fmt`'s FORMATS.md layout.

    `values` are float32 or BF16, shaped [tokens, num_kv_heads, head_dim], all finite; `fmt`
    is a symmetric KvCacheDtype or its name. `scale` is fp8's per-tensor dequantisation scale
    (bytes hold E4M3(x / scale)); the other formats ignore it. Turbo formats rotate each head
    vector first unless `rotate=False`."""
    fmt = side_format(fmt)
    x = as_float32_values(values)
    tokens, heads, head_dim = x.shape
    if tokens == 0:
        raise ValueError(f"values holds 0 tokens (shape {x.shape}): a block side to encode needs at least one")
    check_side_geometry(fmt, heads, head_dim)
    scale = check_scale(scale)
    if fmt.is_wht_rotated() and rotate:
        x = _rotate(x)
    rows = x.reshape(tokens, heads * head_dim)
    spec = SIDE_FORMATS[fmt]
    if spec.codec == "bf16":
        return bf16_encode(rows).astype("<u2").tobytes()
    if spec.codec == "e4m3":
        return e4m3_encode(rows / scale).tobytes()
    grouped = rows.reshape(tokens, -1, GROUP_SIZE)
    if spec.codec == "turbo8":
        data, scale_bits = groups.turbo8_encode(grouped)
        scale_bytes = scale_bits.astype("<u2").view(np.uint8)
    else:
        if spec.codec == "nvfp4":
            codes, scale_bytes = groups.nvfp4_encode(grouped)
        else:
            codes, scale_bytes = groups.turbo_encode(grouped, *turbo_codebook(fmt))
        data = pack(codes.reshape(tokens, -1), spec.data_bits)
    return data.tobytes() + np.ascontiguousarray(scale_bytes).tobytes()


def decode(data, fmt, block_size: int, num_kv_heads: int, head_dim: int, *, scale: float = 1.0,
           unrotate: bool = True) -> np.ndarray:
    """float32 [block_size, num_kv_heads, head_dim] values of one block side in `fmt`.

    `data` is exactly `side_bytes(fmt, block_size * num_kv_heads * head_dim)` bytes. Turbo
    values come back in the model's basis (`unrotate=True`) or in the stored, rotated basis
    an attention kernel works in (`unrotate=False`). `scale` multiplies fp8 values only."""
    fmt = side_format(fmt)
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    check_side_geometry(fmt, num_kv_heads, head_dim)
    scale = check_scale(scale)
    raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    n = num_kv_heads * head_dim
    expected = side_bytes(fmt, block_size * n)
    if raw.size != expected:
        raise ValueError(
            f"{fmt} block side of {block_size} x {num_kv_heads} x {head_dim} is {expected} bytes, got {raw.size}"
        )
    shape = (block_size, num_kv_heads, head_dim)
    spec = SIDE_FORMATS[fmt]
    if spec.codec == "bf16":
        return bf16_decode(raw.view("<u2")).reshape(shape)
    if spec.codec == "e4m3":
        return (e4m3_decode(raw) * scale).reshape(shape)
    data_bytes = side_data_bytes(fmt, block_size * n)
    body = raw[:data_bytes].reshape(block_size, -1)
    scales = raw[data_bytes:].reshape(block_size, n // GROUP_SIZE, -1)
    if spec.codec == "turbo8":
        scale_bits = scales.copy().view("<u2")[..., 0]
        x = groups.turbo8_decode(body.reshape(block_size, -1, GROUP_SIZE), scale_bits)
    else:
        codes = unpack(body, spec.data_bits).reshape(block_size, -1, GROUP_SIZE)
        scale_bytes = scales[..., 0]
        if spec.codec == "nvfp4":
            x = groups.nvfp4_decode(codes, scale_bytes)
        else:
            x = groups.turbo_decode(codes, scale_bytes, turbo_codebook(fmt)[0])
    x = x.reshape(shape)
    if fmt.is_wht_rotated() and unrotate:
        x = _unrotate(x)
    return x
