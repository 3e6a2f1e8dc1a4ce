"""Where a block side keeps each (token, head): the NHD and HND byte layouts (pure arithmetic).

A block side of a layer holds `block_size` tokens x `heads` heads x `head_dim` elements.
Each (token, head) owns one data piece of `head_dim * bits / 8` bytes and, in a grouped
format, one scale piece of `head_dim / 16 * scale_size` bytes (a group never straddles two
heads). The two layouts place the same pieces differently:

- **NHD** (the default, docs/FORMATS.md): token major. Data section: token `t`'s row of
  every head at `t * row_bytes`, head `h` at `+ h * head_data_bytes`; then the scale section
  at `data_section`, token `t` at `data_section + t * scale_row_bytes`, head `h` at
  `+ h * head_scale_bytes`.
- **HND**: head major. The block is `heads` consecutive head chunks of `chunk_bytes =
  side_bytes / heads`; head `h`'s chunk is exactly an NHD block of one head: its data
  section (token `t` at `t * head_data_bytes`), then its scale section (token `t` at
  `block_size * head_data_bytes + t * head_scale_bytes`). One head's tokens, data and
  scales, are contiguous, so heads `[a, b)` of a block are the one byte range
  `[a * chunk_bytes, b * chunk_bytes)`.

With one head the two layouts are the same bytes. Worked example, turbo4, block 4, 2 heads
of 16: head data 8 bytes, head scales 1 byte, chunk 36 bytes; (token 2, head 1) has its data
at 2*16 + 8 = 40 and its scale at 64 + 2*2 + 1 = 69 in NHD, at 36 + 2*8 = 52 and
36 + 32 + 2 = 70 in HND.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtype import KvCacheDtype, side_data_bytes, side_scale_bytes

LAYOUTS = ("NHD", "HND")
"""The block layouts a cache may use; NHD is the default."""


def parse_layout(value: object) -> str:
    """`value` as one of `LAYOUTS`; ValueError naming it otherwise."""
    if not isinstance(value, str) or value not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {value!r}")
    return value


@dataclass(frozen=True)
class SideLayout:
    """The byte geometry of one block side: format, block size, heads, head_dim and layout."""

    fmt: KvCacheDtype
    block_size: int
    heads: int
    head_dim: int
    layout: str = "NHD"

    @property
    def head_data_bytes(self) -> int:
        """Data bytes of one (token, head)."""
        return side_data_bytes(self.fmt, self.head_dim)

    @property
    def head_scale_bytes(self) -> int:
        """Scale bytes of one (token, head) (0 for bf16 and fp8)."""
        return side_scale_bytes(self.fmt, self.head_dim)

    @property
    def row_bytes(self) -> int:
        """Data bytes of one token, every head."""
        return self.heads * self.head_data_bytes

    @property
    def scale_row_bytes(self) -> int:
        """Scale bytes of one token, every head."""
        return self.heads * self.head_scale_bytes

    @property
    def data_section(self) -> int:
        """Bytes of every data piece of a block (NHD: where the scale section starts)."""
        return self.block_size * self.row_bytes

    @property
    def side_bytes(self) -> int:
        """Bytes of one block side (the same in both layouts)."""
        return self.block_size * (self.row_bytes + self.scale_row_bytes)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one head's chunk in HND (all its tokens, data then scales)."""
        return self.block_size * (self.head_data_bytes + self.head_scale_bytes)

    def data_offset(self, token: int, head: int = 0) -> int:
        """Byte offset, in a block, of (token, head)'s data piece."""
        if self.layout == "NHD":
            return token * self.row_bytes + head * self.head_data_bytes
        return head * self.chunk_bytes + token * self.head_data_bytes

    def scale_offset(self, token: int, head: int = 0) -> int:
        """Byte offset, in a block, of (token, head)'s scale piece."""
        if self.layout == "NHD":
            return self.data_section + token * self.scale_row_bytes + head * self.head_scale_bytes
        return head * self.chunk_bytes + self.block_size * self.head_data_bytes + token * self.head_scale_bytes

    def pieces(self, heads: range | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offset, size, canonical index) of every piece of heads `heads` (all by default)
        in one block, as int64 arrays in the canonical order (section, head, token): data
        pieces first, then scale pieces. The canonical index numbers a piece by global
        meaning, so two layouts' pieces of the same (section, head, token) pair up."""
        heads = range(self.heads) if heads is None else heads
        h = np.repeat(np.arange(heads.start, heads.stop, dtype=np.int64), self.block_size)
        t = np.tile(np.arange(self.block_size, dtype=np.int64), len(heads))
        offs, sizes = [self._offsets(t, h, "data")], [np.full(h.size, self.head_data_bytes, np.int64)]
        if self.head_scale_bytes:
            offs.append(self._offsets(t, h, "scale"))
            sizes.append(np.full(h.size, self.head_scale_bytes, np.int64))
        return np.concatenate(offs), np.concatenate(sizes), np.arange(sum(o.size for o in offs), dtype=np.int64)

    def _offsets(self, t: np.ndarray, h: np.ndarray, section: str) -> np.ndarray:
        if section == "data":
            if self.layout == "NHD":
                return t * self.row_bytes + h * self.head_data_bytes
            return h * self.chunk_bytes + t * self.head_data_bytes
        if self.layout == "NHD":
            return self.data_section + t * self.scale_row_bytes + h * self.head_scale_bytes
        return h * self.chunk_bytes + self.block_size * self.head_data_bytes + t * self.head_scale_bytes

    def to_nhd(self, raw: np.ndarray) -> np.ndarray:
        """The bytes of one block side (uint8, `side_bytes` long) in NHD order (a copy; the
        same bytes for an NHD side)."""
        raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
        if self.layout == "NHD" or self.heads == 1:
            return raw.copy()
        t, n, db, sb = self.block_size, self.heads, self.head_data_bytes, self.head_scale_bytes
        chunks = raw.reshape(n, self.chunk_bytes)
        data = chunks[:, : t * db].reshape(n, t, db).transpose(1, 0, 2).reshape(-1)
        scales = chunks[:, t * db :].reshape(n, t, sb).transpose(1, 0, 2).reshape(-1)
        return np.concatenate([data, scales])

    def from_nhd(self, raw: np.ndarray) -> np.ndarray:
        """The inverse of `to_nhd`: NHD bytes of one block side in this side's layout."""
        raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
        if self.layout == "NHD" or self.heads == 1:
            return raw.copy()
        t, n, db, sb = self.block_size, self.heads, self.head_data_bytes, self.head_scale_bytes
        data = raw[: self.data_section].reshape(t, n, db).transpose(1, 0, 2).reshape(n, t * db)
        scales = raw[self.data_section :].reshape(t, n, sb).transpose(1, 0, 2).reshape(n, t * sb)
        return np.concatenate([data, scales], axis=1).reshape(-1)
