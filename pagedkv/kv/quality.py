"""How much each storage format costs in bits and loses in accuracy (`pagedkv quality`'s table).

On synthetic KV shaped like a real model's (heavy-tailed values, a few outlier channels per
head in K, seeded), each format's K and V sides go through the host codec and back. The
table gives bits per element, the relative MSE `E[(x̂-x)²] / E[x²]` of K and V (turbo sides
also without rotation), and the cosine similarity of the attention output
`softmax(q kᵀ / sqrt(d)) v` against BF16 K and V, for a few queries per head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..codecs import decode, encode
from ..core.dtype import KvCacheDtype

SCORE_SPREAD = 2.0
"""Standard deviation over tokens of each synthetic query's attention scores."""


@dataclass(frozen=True)
class QualityRow:
    """One format's line of the quality table; `*_norot` are None for a side that never rotates."""

    fmt: KvCacheDtype
    bits: float
    k_rel_mse: float
    k_rel_mse_norot: float | None
    v_rel_mse: float
    v_rel_mse_norot: float | None
    attn_cos_mean: float
    attn_cos_min: float
    attn_cos_mean_norot: float | None


def synthetic_kv(tokens: int, heads: int, head_dim: int, seed: int = 0):
    """(k, v, q) float32, shaped [tokens, heads, head_dim] (q: [queries=8, heads, head_dim]).

    K: Student-t(4) values, per-channel spreads, 4 outlier channels per head carrying a
    large per-channel offset and spread (as rotary keys show); V: Student-t(5), milder spread,
    1 outlier channel per head; Q: Gaussian, weighted up on K's outlier channels, each query
    scaled so its scores `q kᵀ / sqrt(d)` spread with standard deviation 2 over the tokens
    (a softmax neither flat nor one-hot, as real attention heads mostly are)."""
    rng = np.random.default_rng(seed)
    spread = np.exp(rng.normal(0.0, 0.5, (heads, head_dim)))
    k = rng.standard_t(4, (tokens, heads, head_dim)) * spread
    outliers = np.stack([rng.choice(head_dim, 4, replace=False) for _ in range(heads)])
    for h in range(heads):
        k[:, h, outliers[h]] = k[:, h, outliers[h]] * 8 + rng.normal(0, 12, 4)
    v_spread = np.exp(rng.normal(0.0, 0.3, (heads, head_dim)))
    v = rng.standard_t(5, (tokens, heads, head_dim)) * v_spread
    v_out = rng.integers(0, head_dim, heads)
    v[:, np.arange(heads), v_out] *= 6
    q = rng.standard_normal((8, heads, head_dim))
    for h in range(heads):
        q[:, h, outliers[h]] *= 3
    scores = np.einsum("qhd,thd->qht", q, k) / np.sqrt(head_dim)
    q *= (SCORE_SPREAD / scores.std(axis=-1))[..., None]
    return k.astype(np.float32), v.astype(np.float32), q.astype(np.float32)


def _round_trip(x: np.ndarray, fmt: KvCacheDtype, rotate: bool) -> np.ndarray:
    tokens, heads, head_dim = x.shape
    return decode(encode(x, fmt, rotate=rotate), fmt, tokens, heads, head_dim, unrotate=rotate)


def _rel_mse(approx: np.ndarray, exact: np.ndarray) -> float:
    exact64 = exact.astype(np.float64)
    return float(np.mean((approx - exact64) ** 2) / np.mean(exact64**2))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(q kᵀ / sqrt(d)) v per head, float64: q [Q, H, D], k and v [T, H, D] -> [Q, H, D]."""
    scores = np.einsum("qhd,thd->hqt", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqt,thd->qhd", p, v.astype(np.float64))


def _cosines(out: np.ndarray, ref: np.ndarray) -> np.ndarray:
    dot = (out * ref).sum(-1)
    return dot / (np.linalg.norm(out, axis=-1) * np.linalg.norm(ref, axis=-1))


def quality_table(tokens: int = 512, heads: int = 8, head_dim: int = 128, seed: int = 0) -> list[QualityRow]:
    """One QualityRow per format (in KvCacheDtype order) on `synthetic_kv(tokens, heads, head_dim, seed)`."""
    return list(quality_rows(tokens, heads, head_dim, seed))


def quality_rows(tokens: int = 512, heads: int = 8, head_dim: int = 128, seed: int = 0):
    """`quality_table`'s rows one at a time, each as soon as it is measured (a caller can
    show them as they come)."""
    k, v, q = synthetic_kv(tokens, heads, head_dim, seed)
    cache: dict[tuple[str, KvCacheDtype, bool], np.ndarray] = {}

    def side(name: str, x: np.ndarray, fmt: KvCacheDtype, rotate: bool) -> np.ndarray:
        key = (name, fmt, rotate and fmt.is_wht_rotated())
        if key not in cache:
            cache[key] = _round_trip(x, fmt, key[2])
        return cache[key]

    reference = attention(q, side("k", k, KvCacheDtype.BF16, False), side("v", v, KvCacheDtype.BF16, False))
    for fmt in KvCacheDtype:
        k_fmt, v_fmt = fmt.kv_pair()
        k_hat, v_hat = side("k", k, k_fmt, True), side("v", v, v_fmt, True)
        cos = _cosines(attention(q, k_hat, v_hat), reference)
        rotated = k_fmt.is_wht_rotated() or v_fmt.is_wht_rotated()
        k_raw, v_raw = side("k", k, k_fmt, False), side("v", v, v_fmt, False)
        yield (
            QualityRow(
                fmt=fmt,
                bits=fmt.bits_per_element(),
                k_rel_mse=_rel_mse(k_hat, k),
                k_rel_mse_norot=_rel_mse(k_raw, k) if k_fmt.is_wht_rotated() else None,
                v_rel_mse=_rel_mse(v_hat, v),
                v_rel_mse_norot=_rel_mse(v_raw, v) if v_fmt.is_wht_rotated() else None,
                attn_cos_mean=float(cos.mean()),
                attn_cos_min=float(cos.min()),
                attn_cos_mean_norot=float(_cosines(attention(q, k_raw, v_raw), reference).mean()) if rotated else None,
            )
        )


def format_table(rows: list[QualityRow]) -> str:
    """The rows as a fixed-width text table, one format a line."""
    return "\n".join([*table_head(), *map(format_row, rows)])


def table_head() -> list[str]:
    """The table's two head lines (column names, a rule)."""
    head = (
        f"{'format':<16} {'bits':>5} {'K relMSE':>9} {'(no rot)':>9} {'V relMSE':>9} {'(no rot)':>9} "
        f"{'attn cos':>9} {'cos min':>9} {'(no rot)':>9}"
    )
    return [head, "-" * len(head)]


def format_row(r: QualityRow) -> str:
    """One row of the table."""

    def opt(value: float | None, spec: str) -> str:
        return format(value, spec) if value is not None else f"{'-':>9}"

    return (
        f"{str(r.fmt):<16} {r.bits:>5.2f} {r.k_rel_mse:>9.2e} {opt(r.k_rel_mse_norot, '>9.2e')} "
        f"{r.v_rel_mse:>9.2e} {opt(r.v_rel_mse_norot, '>9.2e')} {r.attn_cos_mean:>9.6f} "
        f"{r.attn_cos_min:>9.6f} {opt(r.attn_cos_mean_norot, '>9.6f')}"
    )


def describe(tokens: int, heads: int, head_dim: int, seed: int) -> str:
    """The header line naming the data the table was measured on."""
    return (
        f"synthetic KV: {tokens} tokens x {heads} KV heads x head_dim {head_dim}, seed {seed}; "
        f"K Student-t(4) + 4 outlier channels/head, V Student-t(5); 8 queries/head "
        f"(score std {SCORE_SPREAD}); attention cosine vs BF16 K and V"
    )


@dataclass(frozen=True)
class TierRow:
    """The error one tier pairing adds: blocks stored in `device` on the device, kept in
    `tier` below it (`HostTier(format=tier)`), brought back into `device`. `ratio` is device
    bytes over tier bytes; the relative MSEs and the attention cosine compare the values
    after the round trip with the values the device held (not the original ones)."""

    device: KvCacheDtype
    tier: KvCacheDtype
    ratio: float
    k_rel_mse: float
    v_rel_mse: float
    attn_cos_mean: float
    attn_cos_min: float


TIER_DEVICE_FORMATS = (KvCacheDtype.BF16, KvCacheDtype.FP8)
"""The device formats `tier_table` pairs with every smaller format by default."""


def _side_bytes(fmt: KvCacheDtype, n: int) -> int:
    from ..core.dtype import side_bytes

    return side_bytes(fmt, n)


def tier_table(tokens: int = 512, heads: int = 8, head_dim: int = 128, seed: int = 0,
               devices=TIER_DEVICE_FORMATS) -> list[TierRow]:
    """One TierRow per (device format, smaller tier format) on `synthetic_kv(...)`: the
    device values are `decode(device, encode(device, x))`, the tier's `encode(tier, .)` of
    them decoded and encoded back into the device format (what HostTier(format=...) does,
    byte for byte)."""
    k, v, q = synthetic_kv(tokens, heads, head_dim, seed)
    n = tokens * heads * head_dim
    rows = []
    for device in devices:
        device = KvCacheDtype.parse(device)
        dk, dv = device.kv_pair()
        k_dev, v_dev = _round_trip(k, dk, True), _round_trip(v, dv, True)
        reference = attention(q, k_dev, v_dev)
        size = _side_bytes(dk, n) + _side_bytes(dv, n)
        for tier in KvCacheDtype:
            tk, tv = tier.kv_pair()
            tier_size = _side_bytes(tk, n) + _side_bytes(tv, n)
            if tier == device or tier_size > size:
                continue
            k_back = _round_trip(_round_trip(k_dev, tk, True), dk, True) if tk != dk else k_dev
            v_back = _round_trip(_round_trip(v_dev, tv, True), dv, True) if tv != dv else v_dev
            cos = _cosines(attention(q, k_back, v_back), reference)
            rows.append(TierRow(device, tier, size / tier_size, _rel_mse(k_back, k_dev), _rel_mse(v_back, v_dev),
                                float(cos.mean()), float(cos.min())))
    return rows


def format_tier_table(rows: list[TierRow]) -> str:
    """The tier rows as a fixed-width text table, one pairing a line."""
    head = (f"{'device':<16} {'tier':<16} {'ratio':>6} {'K relMSE':>9} {'V relMSE':>9} "
            f"{'attn cos':>9} {'cos min':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{str(r.device):<16} {str(r.tier):<16} {r.ratio:>5.2f}x {r.k_rel_mse:>9.2e} "
                     f"{r.v_rel_mse:>9.2e} {r.attn_cos_mean:>9.6f} {r.attn_cos_min:>9.6f}")
    return "\n".join(lines)
