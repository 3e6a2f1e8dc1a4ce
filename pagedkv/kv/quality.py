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


CHUNK_ELEMENTS = 1 << 20
"""Values (tokens x heads x head_dim) of one chunk: the table's work streams over the tokens
in chunks of `chunk_tokens(heads, head_dim)` tokens, so its memory is bounded by the chunk
(about 100 MB over the interpreter's), not by the token count."""

QUERIES = 8
"""Synthetic queries per head."""


def chunk_tokens(heads: int, head_dim: int, chunk_elements: int | None = None) -> int:
    """Tokens per chunk for rows of `heads` x `head_dim`: `chunk_elements` (default
    `CHUNK_ELEMENTS`) values, at least one token."""
    limit = CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    return max(1, limit // (heads * head_dim))


class SyntheticKv:
    """The seeded synthetic KV of `synthetic_kv`, made chunk by chunk: `chunks()` yields
    `(k, v)` float32 rows of successive chunks of at most `chunk` tokens, equal to the rows of
    one `synthetic_kv` call (the generators are restarted from their recorded states, so
    each pass draws the same values); `q` is the queries. Making it is one pass over the
    draws (to record where V's start) and one over K (for the queries' score spread)."""

    def __init__(self, tokens: int, heads: int, head_dim: int, seed: int = 0, chunk: int | None = None):
        self.tokens, self.heads, self.head_dim = tokens, heads, head_dim
        self.chunk = chunk_tokens(heads, head_dim) if chunk is None else chunk
        rng = np.random.default_rng(seed)
        self._spread = np.exp(rng.normal(0.0, 0.5, (heads, head_dim)))
        self._k_state = rng.bit_generator.state
        for n in self.sizes():
            rng.standard_t(4, (n, heads, head_dim))  # K's draws, skipped: what follows them is needed now
        self._outliers = np.stack([rng.choice(head_dim, 4, replace=False) for _ in range(heads)])
        self._offsets = [rng.normal(0, 12, 4) for _ in range(heads)]
        self._v_spread = np.exp(rng.normal(0.0, 0.3, (heads, head_dim)))
        self._v_state = rng.bit_generator.state
        for n in self.sizes():
            rng.standard_t(5, (n, heads, head_dim))
        self._v_out = rng.integers(0, head_dim, heads)
        q = rng.standard_normal((QUERIES, heads, head_dim))
        for h in range(heads):
            q[:, h, self._outliers[h]] *= 3
        q *= (SCORE_SPREAD / self._score_std(q))[..., None]
        self.q = q.astype(np.float32)

    def sizes(self) -> list[int]:
        """The token count of each chunk, in order."""
        full, rest = divmod(self.tokens, self.chunk)
        return [self.chunk] * full + ([rest] if rest else [])

    def _score_std(self, q: np.ndarray) -> np.ndarray:
        """The standard deviation over all tokens of `q kᵀ / sqrt(d)`, per query and head,
        merged chunk by chunk (Chan's pairwise update)."""
        count, mean, m2 = 0, 0.0, 0.0
        for k, _ in self._chunks64(values=False):
            scores = np.einsum("qhd,thd->qht", q, k) / np.sqrt(self.head_dim)
            n, c_mean = scores.shape[-1], scores.mean(axis=-1)
            c_m2 = ((scores - c_mean[..., None]) ** 2).sum(axis=-1)
            delta, total = c_mean - mean, count + n
            mean = mean + delta * (n / total)
            m2 = m2 + c_m2 + delta**2 * (count * n / total)
            count = total
        return np.sqrt(m2 / count)

    def _chunks64(self, values: bool = True):
        k_rng, v_rng = np.random.default_rng(), np.random.default_rng()
        k_rng.bit_generator.state, v_rng.bit_generator.state = self._k_state, self._v_state
        heads, head_dim = self.heads, self.head_dim
        for n in self.sizes():
            k = k_rng.standard_t(4, (n, heads, head_dim)) * self._spread
            for h in range(heads):
                k[:, h, self._outliers[h]] = k[:, h, self._outliers[h]] * 8 + self._offsets[h]
            v = None
            if values:
                v = v_rng.standard_t(5, (n, heads, head_dim)) * self._v_spread
                v[:, np.arange(heads), self._v_out] *= 6
            yield k, v

    def chunks(self):
        """(k, v) float32 `[n, heads, head_dim]` of each chunk in turn (a new pass each call)."""
        for k, v in self._chunks64():
            yield k.astype(np.float32), v.astype(np.float32)


def synthetic_kv(tokens: int, heads: int, head_dim: int, seed: int = 0):
    """(k, v, q) float32, shaped [tokens, heads, head_dim] (q: [queries=8, heads, head_dim]),
    whole (`SyntheticKv` makes the same rows chunk by chunk).

    K: Student-t(4) values, per-channel spreads, 4 outlier channels per head carrying a
    large per-channel offset and spread (as rotary keys show); V: Student-t(5), milder spread,
    1 outlier channel per head; Q: Gaussian, weighted up on K's outlier channels, each query
    scaled so its scores `q kᵀ / sqrt(d)` spread with standard deviation 2 over the tokens
    (a softmax neither flat nor one-hot, as real attention heads mostly are)."""
    data = SyntheticKv(tokens, heads, head_dim, seed)
    parts = list(data.chunks())
    return np.concatenate([k for k, _ in parts]), np.concatenate([v for _, v in parts]), data.q


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


class StreamedAttention:
    """`attention(q, k, v)` over k and v given chunk by chunk (`add`), the softmax kept as a
    running maximum, sum and weighted sum per query and head (memory: one chunk's scores)."""

    def __init__(self, q: np.ndarray):
        self._q = q.astype(np.float64)
        queries, heads, head_dim = q.shape
        self._max = np.full((heads, queries), -np.inf)
        self._sum = np.zeros((heads, queries))
        self._acc = np.zeros((heads, queries, head_dim))

    def add(self, k: np.ndarray, v: np.ndarray) -> None:
        """Take the next chunk's `k` and `v` rows ([n, H, D])."""
        scores = np.einsum("qhd,thd->hqt", self._q, k.astype(np.float64)) / np.sqrt(self._q.shape[-1])
        top = np.maximum(self._max, scores.max(axis=-1))
        keep = np.exp(self._max - top)
        p = np.exp(scores - top[..., None])
        self._sum = self._sum * keep + p.sum(axis=-1)
        self._acc = self._acc * keep[..., None] + np.einsum("hqt,thd->hqd", p, v.astype(np.float64))
        self._max = top

    def result(self) -> np.ndarray:
        """The attention output so far, [Q, H, D] float64."""
        return (self._acc / self._sum[..., None]).transpose(1, 0, 2)


class _RelMse:
    """`E[(x̂-x)²] / E[x²]` summed chunk by chunk."""

    def __init__(self):
        self.err = self.ref = 0.0

    def add(self, approx: np.ndarray, exact: np.ndarray) -> None:
        exact64 = exact.astype(np.float64)
        self.err += float(np.sum((approx - exact64) ** 2))
        self.ref += float(np.sum(exact64**2))

    def value(self) -> float:
        return self.err / self.ref


def _cosines(out: np.ndarray, ref: np.ndarray) -> np.ndarray:
    dot = (out * ref).sum(-1)
    return dot / (np.linalg.norm(out, axis=-1) * np.linalg.norm(ref, axis=-1))


def _passes(data: SyntheticKv, progress, label: str, step: int, steps: int):
    """`data.chunks()`, reporting `progress(label, step, steps, tokens_done, tokens)` after each."""
    done = 0
    for k, v in data.chunks():
        yield k, v
        done += k.shape[0]
        if progress is not None:
            progress(label, step, steps, done, data.tokens)


def quality_table(tokens: int = 512, heads: int = 8, head_dim: int = 128, seed: int = 0) -> list[QualityRow]:
    """One QualityRow per format (in KvCacheDtype order) on `synthetic_kv(tokens, heads, head_dim, seed)`."""
    return list(quality_rows(tokens, heads, head_dim, seed))


def quality_rows(tokens: int = 512, heads: int = 8, head_dim: int = 128, seed: int = 0, progress=None,
                 chunk: int | None = None):
    """`quality_table`'s rows one at a time, each as soon as it is measured (a caller can
    show them as they come). The work streams over the tokens in chunks of `chunk` tokens
    (default `chunk_tokens(heads, head_dim)`): a pass for the BF16 reference, then one per
    format, each regenerating the chunks, so memory does not grow with `tokens`.
    `progress`, when given, is called after each chunk with (what: "reference" or the
    format's name, pass number from 1, passes, tokens done in this pass, tokens); it
    prints nothing itself."""
    data = SyntheticKv(tokens, heads, head_dim, seed, chunk)
    formats = list(KvCacheDtype)
    steps = 1 + len(formats)
    reference = StreamedAttention(data.q)
    for k, v in _passes(data, progress, "reference", 1, steps):
        reference.add(_round_trip(k, KvCacheDtype.BF16, False), _round_trip(v, KvCacheDtype.BF16, False))
    ref = reference.result()
    for step, fmt in enumerate(formats, 2):
        k_fmt, v_fmt = fmt.kv_pair()
        k_rot, v_rot = k_fmt.is_wht_rotated(), v_fmt.is_wht_rotated()
        rotated = k_rot or v_rot
        attn, attn_raw = StreamedAttention(data.q), StreamedAttention(data.q)
        k_mse, k_mse_raw, v_mse, v_mse_raw = _RelMse(), _RelMse(), _RelMse(), _RelMse()
        for k, v in _passes(data, progress, str(fmt), step, steps):
            k_hat, v_hat = _round_trip(k, k_fmt, k_rot), _round_trip(v, v_fmt, v_rot)
            attn.add(k_hat, v_hat)
            k_mse.add(k_hat, k), v_mse.add(v_hat, v)
            if rotated:
                k_raw = _round_trip(k, k_fmt, False) if k_rot else k_hat
                v_raw = _round_trip(v, v_fmt, False) if v_rot else v_hat
                attn_raw.add(k_raw, v_raw)
                if k_rot:
                    k_mse_raw.add(k_raw, k)
                if v_rot:
                    v_mse_raw.add(v_raw, v)
        cos = _cosines(attn.result(), ref)
        yield QualityRow(
            fmt=fmt,
            bits=fmt.bits_per_element(),
            k_rel_mse=k_mse.value(),
            k_rel_mse_norot=k_mse_raw.value() if k_rot else None,
            v_rel_mse=v_mse.value(),
            v_rel_mse_norot=v_mse_raw.value() if v_rot else None,
            attn_cos_mean=float(cos.mean()),
            attn_cos_min=float(cos.min()),
            attn_cos_mean_norot=float(_cosines(attn_raw.result(), ref).mean()) if rotated else None,
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
               devices=TIER_DEVICE_FORMATS, progress=None, chunk: int | None = None) -> list[TierRow]:
    """One TierRow per (device format, smaller tier format) on `synthetic_kv(...)`: the
    device values are `decode(device, encode(device, x))`, the tier's `encode(tier, .)` of
    them decoded and encoded back into the device format (what HostTier(format=...) does,
    byte for byte). Streamed in chunks like `quality_rows` (a reference pass per device
    format, then a pass per pairing); `progress` as there ("<device> reference" or
    "<device> -> <tier>")."""
    data = SyntheticKv(tokens, heads, head_dim, seed, chunk)
    n = tokens * heads * head_dim
    plans = []
    for device in devices:
        device = KvCacheDtype.parse(device)
        dk, dv = device.kv_pair()
        size = _side_bytes(dk, n) + _side_bytes(dv, n)
        tiers = [tier for tier in KvCacheDtype if tier != device
                 and _side_bytes(tier.kv_pair()[0], n) + _side_bytes(tier.kv_pair()[1], n) <= size]
        plans.append((device, size, tiers))
    steps = sum(1 + len(tiers) for _, _, tiers in plans)
    step, rows = 0, []
    for device, size, tiers in plans:
        dk, dv = device.kv_pair()
        step += 1
        reference = StreamedAttention(data.q)
        for k, v in _passes(data, progress, f"{device} reference", step, steps):
            reference.add(_round_trip(k, dk, True), _round_trip(v, dv, True))
        ref = reference.result()
        for tier in tiers:
            tk, tv = tier.kv_pair()
            step += 1
            attn, k_mse, v_mse = StreamedAttention(data.q), _RelMse(), _RelMse()
            for k, v in _passes(data, progress, f"{device} -> {tier}", step, steps):
                k_dev, v_dev = _round_trip(k, dk, True), _round_trip(v, dv, True)
                k_back = _round_trip(_round_trip(k_dev, tk, True), dk, True) if tk != dk else k_dev
                v_back = _round_trip(_round_trip(v_dev, tv, True), dv, True) if tv != dv else v_dev
                attn.add(k_back, v_back)
                k_mse.add(k_back, k_dev), v_mse.add(v_back, v_dev)
            tier_size = _side_bytes(tk, n) + _side_bytes(tv, n)
            cos = _cosines(attn.result(), ref)
            rows.append(TierRow(device, tier, size / tier_size, k_mse.value(), v_mse.value(),
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
