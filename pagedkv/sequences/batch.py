"""The sequence table's persistent batch: one stable row per live sequence and the arrays
its exports are cut from, kept up to date as sequences change (`KeptBatch`).

Rows: a sequence gets the next row when it is added (or forked) and keeps it while it
lives. Freeing the sequence in row r moves the sequence of the LAST row into r (one row
copy), so the rows stay dense, 0..n-1: this is the only way the batch order changes, and
`SequenceTable.batch_ids()` always names the current order. An engine that exports with
`seq_ids=None` (the whole batch) gets rows in that order.

Kept arrays (rows past n and entries past a row's length are always -1 / 0):
- `table[row, :lens[row]]`: the row's held blocks, oldest first (int32, -1 padded);
- `lens[row]`: its held block count; `dropped[row]`: blocks the window released.
Token counts and step starts stay on the sequence records (the per-token hot path writes
no array); exports gather them, one attribute read per row. The whole batch's gather is kept
(`starts`, `counts`, valid while `gathered`) until the owner reports a change (`stale()`, or
a row call below that changes counts), so one step's `slot_mapping`, `page_table` and
`seq_lens` gather once between them; a row added or removed updates the kept gather in
place, and a decode step that gave every row one token (`decoded`) shifts it in one
vectorised step, so a serving step with arrivals and finishes gathers nothing.

Dirty rows since the last device upload of the batch's block table are kept as one
contiguous range `[lo, hi)`, so that upload copies only that range when its width is
unchanged.

Kept for the whole batch's exports too (never changed in place: a change makes new arrays):
- the page table's `indices` as of its last export, with the row lengths then; the next
  export reuses it when no row changed; when at most `SPLICE_ROWS` rows changed it splices
  in the new blocks of rows that only grew and rebuilds the rows from the first one changed
  any other way (added, moved, rewritten); else it rebuilds all from the kept table (a CSR
  insertion shifts every later row, so past a few rows the vectorised rebuild is as cheap);
- `tail[row]`: the row's last held block (-1 for none), so a decode step's slots (one
  position per row, always in its last block) are `tail * block_size + position %
  block_size`, without a gather from the table.
"""

from __future__ import annotations

from typing import Any, Hashable

import numpy as np

from ..errors import KvCacheError
from .exports import PageTable

_NO_ROWS = 1 << 62

SPLICE_ROWS = 4
"""The most changed rows a whole-batch page-table export splices into its kept indices
(more: rebuilt from the kept table; measured on the serving mix, splicing 16 grown rows of
256 costs what rebuilding all 20k blocks does, about 16 us)."""


class KeptBatch:
    """Rows of live sequences and their kept block table (the module docstring states the
    rules). Each record must carry `blocks`, `dropped`, `num_tokens`, `step_start` and a
    writable `row` slot; the owner calls `add`/`remove` as sequences start and end and
    `block_appended`/`rewrite` after it changed a record's blocks or `dropped`."""

    __slots__ = ("seqs", "ids", "table", "lens", "dropped", "windowed", "arange", "lo", "hi", "dev_width", "dev_rows",
                 "tail", "pt_indices", "pt_lens", "pt_ptr", "pt_from", "pt_grown", "gathered", "starts", "counts")

    def __init__(self) -> None:
        self.seqs: list[Any] = []  # row -> record
        self.ids: list[Hashable] = []  # row -> sequence id
        self.table = np.full((16, 16), -1, dtype=np.int32)
        self.lens = np.zeros(16, dtype=np.int32)
        self.dropped = np.zeros(16, dtype=np.int64)
        self.windowed = False  # True once any row had a block released by the window
        self.arange = np.arange(16, dtype=np.intp)
        self.lo, self.hi = _NO_ROWS, 0  # rows changed since the last device upload
        self.dev_width = -1  # width of the batch table on the device; -1: the buffer holds something else
        self.dev_rows = 0  # rows of it the device holds
        self.tail = np.full(16, -1, dtype=np.int64)  # row -> its last held block
        self.pt_indices: np.ndarray | None = None  # the page table's indices at its last whole-batch export
        self.pt_lens = np.zeros(0, dtype=np.int32)  # the row lengths then
        self.pt_ptr = np.zeros(1, dtype=np.int32)  # the indptr then
        self.pt_from = _NO_ROWS  # the first row changed other than by appended blocks since
        self.pt_grown = 0  # blocks appended to rows since (an upper bound on the rows that grew)
        self.gathered = False  # True while starts[:n] / counts[:n] hold every row's step start / num_tokens
        self.starts = np.zeros(16, dtype=np.int64)
        self.counts = np.zeros(16, dtype=np.int64)

    # -- keeping -------------------------------------------------------------------------

    def _reserve(self, rows: int, width: int) -> None:
        """Grow the kept arrays (doubling) to hold `rows` rows of `width` blocks."""
        cap_rows, cap_width = self.table.shape
        if rows <= cap_rows and width <= cap_width:
            return
        new_rows, new_width = cap_rows, cap_width
        while new_rows < rows:
            new_rows *= 2
        while new_width < width:
            new_width *= 2
        table = np.full((new_rows, new_width), -1, dtype=np.int32)
        table[:cap_rows, :cap_width] = self.table
        self.table = table
        if new_rows > cap_rows:
            self.lens = np.concatenate([self.lens, np.zeros(new_rows - cap_rows, dtype=np.int32)])
            self.dropped = np.concatenate([self.dropped, np.zeros(new_rows - cap_rows, dtype=np.int64)])
            self.tail = np.concatenate([self.tail, np.full(new_rows - cap_rows, -1, dtype=np.int64)])
            self.starts = np.concatenate([self.starts, np.zeros(new_rows - cap_rows, dtype=np.int64)])
            self.counts = np.concatenate([self.counts, np.zeros(new_rows - cap_rows, dtype=np.int64)])
        if new_width > cap_width:
            self.dev_width = -1  # (the device layout follows the export width, not this capacity)

    def stale(self) -> None:
        """A record's `num_tokens` or `step_start` changed: the kept gather is dropped."""
        self.gathered = False

    def decoded(self, kept: bool) -> None:
        """Every row's record got exactly one token (step start = the old count, count + 1);
        `kept`: the gather was kept when that step began (else it stays dropped)."""
        if kept:
            n = len(self.seqs)
            counts = self.counts[:n]
            self.starts[:n] = counts
            counts += 1
        self.gathered = kept

    def _gather(self, seqs: list[Any], rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """int64 (step starts, num_tokens) of `seqs`; of the whole batch (`rows` None) the
        kept arrays' views (valid until the next change: callers read, never keep them)."""
        n = len(seqs)
        if rows is None and self.gathered:
            return self.starts[:n], self.counts[:n]
        starts = np.fromiter([s.step_start for s in seqs], dtype=np.int64, count=n)
        counts = np.fromiter([s.num_tokens for s in seqs], dtype=np.int64, count=n)
        if rows is None:
            self.starts[:n], self.counts[:n], self.gathered = starts, counts, True
        return starts, counts

    def _touch(self, row: int) -> None:
        if row < self.lo:
            self.lo = row
        if row >= self.hi:
            self.hi = row + 1

    def add(self, seq_id: Hashable, seq: Any) -> None:
        """Give `seq` the next row and write its blocks (and its counts, into a kept gather) there."""
        row = len(self.seqs)
        blocks = seq.blocks
        self._reserve(row + 1, len(blocks))
        if self.gathered:
            self.starts[row], self.counts[row] = seq.step_start, seq.num_tokens
        self.seqs.append(seq)
        self.ids.append(seq_id)
        seq.row = row
        self.table[row, : len(blocks)] = blocks
        self.lens[row] = len(blocks)
        self.dropped[row] = seq.dropped
        self.tail[row] = blocks[-1] if blocks else -1
        if seq.dropped:
            self.windowed = True
        self._touch(row)
        if row < self.pt_from:
            self.pt_from = row

    def remove(self, seq: Any) -> None:
        """Drop `seq`'s row; the last row's sequence moves into it (its counts too, in a kept gather)."""
        row, last = seq.row, len(self.seqs) - 1
        table, lens = self.table, self.lens
        if row != last:
            moved = self.seqs[last]
            width = max(int(lens[row]), int(lens[last]))
            table[row, :width] = table[last, :width]
            lens[row], self.dropped[row] = lens[last], self.dropped[last]
            self.tail[row] = self.tail[last]
            if self.gathered:
                self.starts[row], self.counts[row] = self.starts[last], self.counts[last]
            self.seqs[row], self.ids[row] = moved, self.ids[last]
            moved.row = row
            self._touch(row)
        table[last, : lens[last]] = -1
        lens[last], self.dropped[last] = 0, 0
        self.tail[last] = -1
        if row < self.pt_from:
            self.pt_from = row
        self.seqs.pop()
        self.ids.pop()
        seq.row = -1
        if self.dev_rows > last:
            self.dev_rows = last

    def block_appended(self, seq: Any) -> None:
        """`seq.blocks` grew by one block at its end (its token counts may change too)."""
        self.gathered = False
        row, blocks = seq.row, seq.blocks
        k = len(blocks)  # (the kept length is k - 1: the records and the rows agree)
        table = self.table
        if k > table.shape[1]:
            self._reserve(len(self.seqs), k)
            table = self.table
        table[row, k - 1] = self.tail[row] = blocks[-1]
        self.lens[row] = k
        self.pt_grown += 1
        if row < self.lo:
            self.lo = row
        if row >= self.hi:
            self.hi = row + 1

    def rewrite(self, seq: Any) -> None:
        """Write `seq`'s row again from its record (after any change of its blocks or `dropped`)."""
        self.gathered = False
        row, blocks = seq.row, seq.blocks
        n = len(blocks)
        self._reserve(len(self.seqs), n)
        old = int(self.lens[row])
        self.table[row, :n] = blocks
        if old > n:
            self.table[row, n:old] = -1
        self.lens[row] = n
        self.dropped[row] = seq.dropped
        self.tail[row] = blocks[-1] if blocks else -1
        if seq.dropped:
            self.windowed = True
        self._touch(row)
        if row < self.pt_from:
            self.pt_from = row

    def _all_rows(self, n: int) -> np.ndarray:
        """0..n-1 as intp (a kept array, sliced)."""
        if self.arange.size < n:
            self.arange = np.arange(max(n, 2 * self.arange.size), dtype=np.intp)
        return self.arange[:n]

    def uploaded(self, width: int, rows: int) -> None:
        """The device now holds the first `rows` rows of the batch's table at `width`."""
        self.dev_width, self.dev_rows = width, rows
        self.lo, self.hi = _NO_ROWS, 0

    def check(self, live: dict) -> None:
        """KvCacheError unless the rows are exactly the live sequences (`live`: id -> record)
        and every kept array equals a rebuild from the records."""
        n = len(self.seqs)
        if n != len(live) or len(self.ids) != n or any(live.get(i) is not s for i, s in zip(self.ids, self.seqs)):
            raise KvCacheError(f"the persistent batch holds {n} rows for {len(live)} live sequences")
        for row, seq in enumerate(self.seqs):
            k = len(seq.blocks)
            if seq.row != row or int(self.lens[row]) != k or int(self.dropped[row]) != seq.dropped:
                raise KvCacheError(f"row {row} of the persistent batch is out of date")
            if self.table[row, :k].tolist() != seq.blocks or (self.table[row, k:] != -1).any():
                raise KvCacheError(f"row {row} of the kept block table differs from its sequence's blocks")
            if int(self.tail[row]) != (seq.blocks[-1] if k else -1):
                raise KvCacheError(f"row {row}'s kept last block is {int(self.tail[row])}, not its sequence's")
            if self.gathered and (int(self.starts[row]), int(self.counts[row])) != (seq.step_start, seq.num_tokens):
                raise KvCacheError(
                    f"row {row}'s kept step start and token count are {int(self.starts[row])}, "
                    f"{int(self.counts[row])}, not its sequence's {seq.step_start}, {seq.num_tokens}"
                )
        if (self.table[n:] != -1).any() or self.lens[n:].any() or (self.tail[n:] != -1).any():
            raise KvCacheError("the kept block table holds blocks past its last row")

    # -- exports -------------------------------------------------------------------------

    def block_table(self, rows: np.ndarray | None) -> np.ndarray:
        """The `[len(rows), max blocks]` int32 block table of `rows` (None: every row), a new array."""
        if rows is None:
            n = len(self.seqs)
            width = int(self.lens[:n].max()) if n else 0
            return self.table[:n, :width].copy()
        width = int(self.lens[rows].max()) if rows.size else 0
        return self.table[rows, :width]

    def _batch_indices(self, n: int, lens: np.ndarray) -> np.ndarray:
        """The page table's indices of the whole batch (`n` rows of `lens`), from the kept
        ones when at most `SPLICE_ROWS` rows changed since the last export (the module
        docstring), else rebuilt from the kept table."""
        kept, table = self.pt_indices, self.table
        d = min(self.pt_from, n, self.pt_lens.size)  # rows before d changed only by appended blocks
        if kept is not None and n - d + min(self.pt_grown, d) <= SPLICE_ROWS:
            old_lens = self.pt_lens
            grown = np.flatnonzero(lens[:d] != old_lens[:d]).tolist() if d else []
            if len(grown) + n - d <= SPLICE_ROWS:
                ptr = self.pt_ptr
                pieces, prev = [], 0
                for r in grown:
                    end = int(ptr[r + 1])
                    pieces.append(kept[prev:end])
                    pieces.append(table[r, int(old_lens[r]) : int(lens[r])])
                    prev = end
                stop = int(ptr[d])
                if not pieces and d == n:
                    return kept if stop == kept.size else kept[:stop]  # no row changed (or the last went)
                pieces.append(kept[prev:stop])
                if d < n:
                    sub = table[d:n, : int(lens[d:n].max())]
                    pieces.append(sub[sub >= 0])
                return np.concatenate(pieces)
        sub = table[:n, : int(lens.max()) if n else 0].copy()  # (contiguous: the mask runs faster)
        return sub[sub >= 0]  # row-major: each row's held blocks in order (-1 pads the rest)

    def page_table(self, seqs: list[Any], rows: np.ndarray | None, block_size: int) -> PageTable:
        """The int32 CSR triple of `seqs` (rows `rows`, None: every row, its indices kept)."""
        if rows is None:
            n = len(seqs)
            lens = self.lens[:n]
            indptr = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(lens, out=indptr[1:])
            indices = self._batch_indices(n, lens)
            self.pt_indices, self.pt_lens, self.pt_ptr, self.pt_from = indices, lens.copy(), indptr.copy(), _NO_ROWS
            self.pt_grown = 0
        else:
            sub = self.block_table(rows)
            n = sub.shape[0]
            lens = self.lens[rows]
            indptr = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(lens, out=indptr[1:])
            indices = sub[sub >= 0]  # row-major: each row's held blocks in order (-1 pads the rest)
        dropped = self.dropped[:n] if rows is None else self.dropped[rows]
        tokens = self._gather(seqs, rows)[1]
        last = np.where(lens > 0, tokens - (dropped + lens - 1) * block_size, 0).astype(np.int32)
        return PageTable(indptr, indices.astype(np.int32, copy=False), last)

    def seq_lens(self, seqs: list[Any], rows: np.ndarray | None, block_size: int) -> np.ndarray:
        """int32 tokens the held blocks of each of `seqs` (rows `rows`, None: every row)
        cover (`num_tokens` less what a sliding window released), a new array."""
        lens = self._gather(seqs, rows)[1].astype(np.int32)
        if self.windowed:  # (else no record dropped a block)
            dropped = self.dropped[: len(seqs)] if rows is None else self.dropped[rows]
            lens -= (dropped * block_size).astype(np.int32)
        return lens

    def slot_mapping(self, seqs: list[Any], rows: np.ndarray | None, block_size: int, pad_to: int | None) -> np.ndarray:
        """int64 slots of the positions each of `seqs` (rows `rows`) introduced in its latest
        step, in order, -1 padded to `pad_to` (ValueError when fewer than the slots)."""
        n = len(seqs)
        bs = block_size
        starts, ends = self._gather(seqs, rows)
        counts = ends - starts
        total = int(counts.sum())
        odd = np.flatnonzero(counts != 1) if total != n or (n and int(counts.min()) != 1) else None
        if odd is None or odd.size <= SPLICE_ROWS:
            # a decode step: one position each, the row's last (its block is the last held
            # one); the few other rows (an arrival's prompt, a truncated row) spliced in
            tail = self.tail[:n] if rows is None else self.tail[rows]
            slots = tail * bs + starts % bs
            if odd is not None:
                pieces, prev = [], 0
                for r in odd.tolist():
                    pieces.append(slots[prev:r])
                    row = r if rows is None else int(rows[r])
                    positions = np.arange(int(starts[r]), int(ends[r]), dtype=np.int64)
                    column = positions // bs - int(self.dropped[row])
                    pieces.append(self.table[row, column].astype(np.int64) * bs + positions % bs)
                    prev = r + 1
                pieces.append(slots[prev:])
                slots = np.concatenate(pieces)
        else:
            if rows is None:
                rows = self._all_rows(n)
            row_of = np.repeat(rows, counts)
            first = np.repeat(np.cumsum(counts) - counts, counts)
            positions = np.arange(total, dtype=np.int64) - first + np.repeat(starts, counts)
            column = positions // bs
            if self.windowed:
                column -= self.dropped[row_of]
            slots = self.table[row_of, column].astype(np.int64) * bs + positions % bs
        if pad_to is not None:
            if pad_to < total:
                raise ValueError(f"pad_to must be an int >= the {total} slots, got {pad_to!r}")
            out = np.full(pad_to, -1, dtype=np.int64)
            out[:total] = slots
            return out
        return slots
