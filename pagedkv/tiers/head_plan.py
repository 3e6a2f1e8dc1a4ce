"""Which bytes of a block go where between two caches of different TP placement or layout.

A pool (one layer's K or V) on each side is described by `PoolGeometry`: its side layout
(format, block size, local heads, head_dim, NHD/HND), the global heads it holds and its
block stride. `block_template` pairs the pieces (pagedkv.core.layout) of the heads both
pools hold, sorted by source offset and merged wherever the source and the destination are
both contiguous: the byte runs one block pair moves, as (source offset, destination offset,
size) within the blocks. `descriptors` turns templates and block pairs into NIXL rows; a
template that is one whole block on both sides lets consecutive block pairs merge too.

Worked example: an HND bf16 layer of 8 heads x 128, block 16 (chunk 4096 bytes, stride
32768) sending to a TP 2 rank holding heads [4, 8): the template is the one run (16384, 0,
16384), so 256 scattered blocks give 256 descriptors for this pool, as a same-layout
transfer of those blocks does. The same source in NHD gives one 1024-byte run per token
(16 per block) to an NHD rank and one 256-byte run per (token, head) (64 per block) to an
HND rank: a head's tokens are not contiguous in an NHD block.

Replicated layers (MLA: V aliases K, one latent head) go to a receiving rank from one
sending rank only: `replica_sender(dst_rank, src_tp, dst_tp)`, the rank holding the
receiver's first head if the heads were split evenly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.layout import SideLayout


@dataclass(frozen=True)
class PoolGeometry:
    """One pool as a transfer sees it: its byte layout, global heads `[head_start,
    head_start + geometry.heads)`, whether it is replicated, and its block stride."""

    geometry: SideLayout
    head_start: int
    replicated: bool
    stride: int


def replica_sender(dst_rank: int, src_tp: int, dst_tp: int) -> int:
    """The sending rank that sends replicated layers to receiving rank `dst_rank`."""
    return dst_rank * src_tp // dst_tp


def overlap(src: PoolGeometry, dst: PoolGeometry) -> range:
    """The global heads both pools hold (empty when none)."""
    lo = max(src.head_start, dst.head_start)
    hi = min(src.head_start + src.geometry.heads, dst.head_start + dst.geometry.heads)
    return range(lo, max(lo, hi))


def block_template(src: PoolGeometry, dst: PoolGeometry) -> np.ndarray:
    """(k, 3) int64 rows of (source offset, destination offset, size) moving the heads both
    pools hold from a source block to a destination block, merged into the largest runs;
    (0, 3) when they share no head."""
    heads = overlap(src, dst)
    if not heads:
        return np.zeros((0, 3), np.int64)
    s_off, sizes, _ = src.geometry.pieces(range(heads.start - src.head_start, heads.stop - src.head_start))
    d_off, d_sizes, _ = dst.geometry.pieces(range(heads.start - dst.head_start, heads.stop - dst.head_start))
    if not np.array_equal(sizes, d_sizes):  # the handshake refuses other formats or head_dims first
        raise ValueError("pools of different piece sizes cannot be mapped")
    order = np.argsort(s_off, kind="stable")
    s_off, d_off, sizes = s_off[order], d_off[order], sizes[order]
    joins = (s_off[1:] == s_off[:-1] + sizes[:-1]) & (d_off[1:] == d_off[:-1] + sizes[:-1])
    starts = np.concatenate([[0], np.flatnonzero(~joins) + 1])
    run_sizes = np.add.reduceat(sizes, starts)
    return np.stack([s_off[starts], d_off[starts], run_sizes], axis=1).astype(np.int64)


def whole_block(template: np.ndarray, src: PoolGeometry, dst: PoolGeometry) -> bool:
    """True when `template` moves one whole block onto one whole block (runs of
    consecutive block pairs may then merge into one descriptor)."""
    return (template.shape[0] == 1 and int(template[0, 0]) == 0 and int(template[0, 1]) == 0
            and int(template[0, 2]) == src.stride == dst.stride)


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) runs covering the pairs `zip(src, dst)`, ordered by
    destination, where a run is a stretch of pairs whose sources and destinations both go up
    by one. Example: src [9, 4, 5], dst [7, 0, 1] gives [(4, 0, 2), (9, 7, 1)]."""
    runs: list[list[int]] = []
    for d, s in sorted(zip(dst, src)):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]  # type: ignore[misc]


def descriptors(plans: list[tuple[int, int, PoolGeometry, PoolGeometry, np.ndarray]],
                src_blocks: list[int], dst_blocks: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source rows, destination rows): (k, 2) uint64 arrays of (address, bytes) for every
    plan `(src base address, dst base address, src pool, dst pool, template)` and block
    pair, in plan order; a whole-block template merges consecutive pairs into runs."""
    runs = np.array(block_runs(src_blocks, dst_blocks), dtype=np.int64).reshape(-1, 3)
    order = np.argsort(np.asarray(dst_blocks), kind="stable")
    s_blocks = np.asarray(src_blocks, dtype=np.int64)[order]
    d_blocks = np.asarray(dst_blocks, dtype=np.int64)[order]
    src_rows, dst_rows = [], []
    for src_base, dst_base, src, dst, template in plans:
        if template.shape[0] == 0:
            continue
        if whole_block(template, src, dst):
            s = src_base + runs[:, 0] * src.stride
            d = dst_base + runs[:, 1] * dst.stride
            n = runs[:, 2] * src.stride
        else:
            s = (src_base + s_blocks[:, None] * src.stride + template[None, :, 0]).reshape(-1)
            d = (dst_base + d_blocks[:, None] * dst.stride + template[None, :, 1]).reshape(-1)
            n = np.broadcast_to(template[None, :, 2], (d_blocks.size, template.shape[0])).reshape(-1)
        src_rows.append(np.stack([s, n], axis=1))
        dst_rows.append(np.stack([d, n], axis=1))
    if not src_rows:
        return np.zeros((0, 2), np.uint64), np.zeros((0, 2), np.uint64)
    return np.concatenate(src_rows).astype(np.uint64), np.concatenate(dst_rows).astype(np.uint64)
