"""The sequence table's side of prefix reuse: reserve a prompt's cached prefix before its
blocks are allocated, promote the host-tier part of it, then confirm (or cancel, when the
sequence is not added after all); and offer a sequence's full blocks when it is cached.

All of it runs inside the table's guarded call (the guard is the prefix cache's), so the
prefix cache's unguarded `_reserve_bytes` / `_confirm_checked` / `_cancel_checked` /
`_insert_checked` are called directly.
"""

from __future__ import annotations

from typing import Any

from ..backends.protocol import GpuBackend
from .prefix_cache import PrefixCache, PrefixMatch


class PrefixReuse:
    """A table's prefix reuse through `prefix`; promotions run on `stream` of `gpu` (with
    no backend, on the prefix cache's swap stream, and the host waits for them)."""

    def __init__(self, prefix: PrefixCache, gpu: GpuBackend | None, stream: object):
        self.prefix = prefix
        self._gpu = gpu
        self._stream = stream

    def reserve(self, data: bytes, n: int, adapter_id: int, keys: Any = None) -> PrefixMatch:
        """The cached run of a prompt of `n` tokens (`data`: their int64 bytes), never its
        last token, with references taken on its device blocks and its host part kept from
        being dropped until `promote` or `cancel`."""
        if n <= 1:
            return PrefixMatch([], 0)
        prefix = self.prefix
        found = prefix._reserve_bytes(data[: 8 * (n - 1)], adapter_id, keys)
        if found.host_blocks:
            prefix._tiering.pin(found)
        if found.disk_blocks:
            prefix._disk.pin(found.disk_path)
        return found

    def load(self, found: PrefixMatch) -> None:
        """Read the disk part of `found` into host blocks (the engine waits for this read):
        it joins the host part, which `promote` brings to the device. What fails to read is
        dropped from the match (and the cache)."""
        if found.disk_blocks:
            self.prefix._disk.load(found)

    def promote(self, found: PrefixMatch, fresh: list[int]) -> None:
        """Bring the host part of `found` into the first of `fresh` (device blocks the table
        holds, one per host block): one swap_in. A swap error propagates, nothing changed."""
        if found.host_blocks:
            gpu = self._gpu
            stream = self._stream if gpu is not None else self.prefix._swap_stream
            self.prefix._tiering.promote(found, fresh[: len(found.host_blocks)], gpu, stream, wait=gpu is None)

    def confirm(self, n: int, found: PrefixMatch) -> None:
        """The sequence of `n` prompt tokens was added: count the lookup, refresh recency."""
        if n > 1:
            self.prefix._confirm_checked(n - 1, found)

    def cancel(self, found: PrefixMatch) -> None:
        """The sequence was not added: hand back what `reserve` took, as if it never ran."""
        tiering = self.prefix._tiering
        if tiering is not None:
            tiering.unpin(found)
        disk = self.prefix._disk
        if disk is not None and found.disk_blocks:
            disk.unpin(found.disk_path)
        if found.blocks:
            self.prefix._cancel_checked(found)

    def offer(self, seq: Any, block_size: int) -> int:
        """Cache a sequence's full, fully known blocks (none once its window dropped one,
        or when the prefix cache is closed); returns how many were newly cached."""
        prefix = self.prefix
        if prefix._closed or seq.dropped:
            return 0
        full = min(len(seq.tokens), seq.num_tokens) // block_size
        if not full:
            return 0
        return prefix._insert_checked(seq.tokens, seq.blocks, full, seq.adapter_id, True, seq.salt, hint=seq.cached)
