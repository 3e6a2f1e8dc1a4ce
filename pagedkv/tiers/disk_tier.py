"""DiskTier: fixed-size slots in a directory below a HostTier, kept across restarts.

Files (`disk_layout`): `layout.json` (what a slot holds), `slots.bin` (slot s at byte
`s * slot_bytes`), `index.log` (append-only records, `disk_index`) and `writer.lock` (one
writer per directory, `flock`). A tier is made with a directory and a size and bound to a
host tier by `PrefixCache(..., disk_tier=...)`, which checks the layout (a directory
written with another one is refused, `DiskLayoutMismatch`, nothing read), reads the index
and rebuilds its chains: a directory written by an earlier process comes up warm.

Writes never block the engine: a block is copied into one of `queue_blocks` staging slots
and written by the I/O thread (`disk_io`); with every staging slot busy the block is simply
not written (`stats().skipped_writes`). A slot's record is appended only after its bytes,
and every read is checked against the record's checksum, so a torn or missing write (a
crash, a power loss without `durable=True`) is dropped, never served. Disk full, a
read-only directory and I/O errors degrade to "not cached" with a warning and are counted
(`stats()`); nothing is raised into the engine's step.

Sharing: any number of processes may open one directory with `read_only=True` for hits
while one writer fills it. A reader sees the index as it was when it opened; a slot the
writer has reused since fails its checksum and is dropped (never served). Two writers are
refused (the lock).

Bookkeeping mirrors the host tier's: a free list of slots (lowest first), an LRU of the
slots holding cached blocks, and which slots have a write in flight.
"""

from __future__ import annotations

import collections
import heapq
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..core.log import get_logger
from ..core.validate import positive_int
from ..errors import KvCacheError
from . import disk_index, disk_layout
from .disk_index import IndexRecord
from .disk_layout import DiskLayoutMismatch
from .disk_io import DiskIO, ReadJob, WriteJob

_log = get_logger("disk_tier")

COMPACT_SLACK = 1024
"""The index is rewritten at open when it holds more than twice its live records plus this."""


@dataclass(frozen=True)
class DiskTierStats:
    """A disk tier's counters since it was bound: slots and cached blocks now; blocks written,
    writes skipped (every staging slot busy), writes failed (disk full, I/O error); blocks
    read, reads dropped (checksum mismatch, short or failed read); stored and raw bytes
    written (their ratio is the lossless compression's); blocks restored at open; and
    `degraded`, the reason the tier writes nothing (read-only directory, ...) or None."""

    slots: int
    cached_blocks: int
    pending_writes: int
    writes: int
    skipped_writes: int
    failed_writes: int
    reads: int
    failed_reads: int
    bytes_written: int
    bytes_raw: int
    restored_blocks: int
    degraded: str | None

    @property
    def compression_ratio(self) -> float:
        """Raw bytes over stored bytes of the blocks written (1.0 before any write)."""
        return self.bytes_raw / self.bytes_written if self.bytes_written else 1.0


class DiskTier:
    """A disk tier in `directory` of `capacity_bytes` (whole slots; None: the size the
    directory was created with). `compression`: None or "zstd" (lossless, on the I/O thread;
    the `zstd` extra). `format`: the stored pagedkv format, which is the host tier's (set it
    there: `HostTier(..., format=...)`; given here it must agree). `read_only`: share a
    directory another process writes. `queue_blocks`: staging slots, the bound of the
    write queue. `durable`: fdatasync the slots before each index append and the index after
    (survives power loss, slower); without it a process crash loses nothing written."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int | None = None, *,
                 compression: str | None = None, format: str | None = None, read_only: bool = False,
                 queue_blocks: int = 64, durable: bool = False):
        self._directory = os.fspath(directory)
        if not isinstance(self._directory, str) or not self._directory:
            raise TypeError(f"directory must be a path, got {directory!r}")
        self._capacity = None if capacity_bytes is None else positive_int(capacity_bytes, "disk tier capacity_bytes")
        if compression not in disk_layout.COMPRESSIONS:
            raise ValueError(f"compression must be one of {disk_layout.COMPRESSIONS}, got {compression!r}")
        if compression == "zstd":
            try:
                import zstandard  # noqa: F401
            except ImportError:
                raise ImportError("DiskTier(compression='zstd') needs the zstandard package: "
                                  "pip install 'pagedkv[zstd]'") from None
        self._compression = compression
        if format is not None:
            from ..core.dtype import KvCacheDtype

            format = str(KvCacheDtype.parse(format))
        self._format = format
        for name, flag in (("read_only", read_only), ("durable", durable)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        self._read_only = read_only
        self._durable = durable
        self._queue_blocks = positive_int(queue_blocks, "queue_blocks")
        self._bound = False
        self._closed = False
        self._io: DiskIO | None = None
        self._fds: list[int] = []
        self._degraded: str | None = None
        self._counts = collections.Counter()
        self._failing = False
        self._finished: list[tuple[int, bool]] = []

    # -- binding --------------------------------------------------------------------------

    def bind(self, host_tier: Any, block_size: int | None = None) -> list[IndexRecord]:
        """Open the directory for `host_tier`'s blocks (once; PrefixCache does it). Refuses
        another layout (DiskLayoutMismatch, nothing read), a format other than the host
        tier's, a second writer; returns the stored records of live slots, oldest first, for
        the prefix cache to rebuild its chains from (it frees those it cannot use).
        `block_size`: tokens per record (default: the host tier's cache's block size; given
        for a state group's tier of a hybrid cache, whose records end one match unit)."""
        if self._bound:
            raise KvCacheError(f"{self.label()} is already bound to a prefix cache")
        if self._closed:
            raise KvCacheError(f"{self.label()} is closed")
        layout, block_size = self.describe_for(host_tier, block_size)
        self.check_layout(layout)
        existing = disk_layout.read_layout(self._directory)
        self._layout = layout
        self._fingerprint = disk_layout.fingerprint(layout)
        self._slot_bytes = layout["slot_bytes"]
        self._block_bytes = layout["block_bytes"]
        self._block_size = block_size
        if self._capacity is not None:
            slots = self._capacity // self._slot_bytes
            if slots < 1:
                raise ValueError(f"disk tier capacity_bytes {self._capacity} is less than one slot ({self._slot_bytes} bytes)")
        elif existing is not None:
            slots = int(existing.get("capacity_slots", 0))
        else:
            raise ValueError(f"{self._directory} holds no disk tier yet: give capacity_bytes")
        self._num_slots = slots
        records = self._open(existing is not None)
        self._bound = True
        self._free = list(range(self._num_slots))
        self._records: dict[int, IndexRecord] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._pending: dict[int, int] = {}  # slot -> staging slot, while its write is in flight
        self._orphans: set[int] = set()  # pending slots freed meanwhile: free once written
        self._staging_free = list(range(self._queue_blocks)) if self._io is not None else []
        live = disk_index.newest_per_slot(records, self._num_slots)
        for slot, record in live.items():
            self._records[slot] = record
        used = set(live)
        self._free = [s for s in range(self._num_slots) if s not in used]
        heapq.heapify(self._free)
        newest = {id(r) for r in live.values()}
        restored = [r for r in records if id(r) in newest]
        self._counts["restored"] = len(restored)
        _log.info("disk_tier_opened", directory=self._directory, slots=self._num_slots, slot_bytes=self._slot_bytes,
                  restored=len(restored), writable=self.is_writable(), compression=self._compression)
        return restored

    def describe_for(self, host_tier: Any, block_size: int | None = None) -> tuple[dict, int]:
        """(the layout description, tokens per record) this tier would record for
        `host_tier`'s blocks (see `bind`); ValueError for a format other than the host tier's."""
        if self._format is not None and self._format != host_tier.format_name():
            raise ValueError(
                f"DiskTier(format={self._format!r}) stores the host tier's blocks, which hold "
                f"{host_tier.format_name()!r}: give format={self._format!r} to the HostTier (blocks are encoded "
                "on the device, once, on the way down)")
        config = getattr(host_tier.cache(), "config", None)
        if config is None:  # a state group's slots: no K/V config
            if block_size is None:
                raise ValueError("a state group's disk tier needs block_size (tokens per record)")
            layout = disk_layout.describe(host_tier.rows(), block_size, False, host_tier.format_name(),
                                          self._compression)
            return layout, positive_int(block_size, "disk tier block_size")
        config = config()
        block_size = config.block_size if block_size is None else positive_int(block_size, "disk tier block_size")
        layout = disk_layout.describe(host_tier.rows(), block_size, config.v_aliases_k, host_tier.format_name(),
                                      self._compression, config.layout, config.kv_scales())
        return layout, block_size

    def check_layout(self, layout: dict) -> None:
        """DiskLayoutMismatch (every difference named, nothing read but `layout.json`) when
        the directory holds blocks of a layout other than `layout`."""
        existing = disk_layout.read_layout(self._directory)
        if existing is not None:
            diffs = disk_layout.differences(layout, disk_layout.comparable(existing))
            if diffs:
                raise DiskLayoutMismatch(f"{self._directory} holds blocks of another layout: " + "; ".join(diffs))

    def _open(self, exists: bool) -> list[IndexRecord]:
        """Open the files (creating them for a writer); returns the index's records."""
        directory = self._directory
        index_path = os.path.join(directory, disk_layout.INDEX_FILE)
        slots_path = os.path.join(directory, disk_layout.SLOTS_FILE)
        if not self._read_only:
            try:
                return self._open_writer(exists, slots_path, index_path)
            except BlockingIOError:
                self._close_fds()
                raise KvCacheError(f"{directory} is in use by another writer: open it with read_only=True to "
                                   "share it for hits") from None
            except OSError as err:
                self._close_fds()
                self._degrade(f"{type(err).__name__}: {err}")
                if not exists:
                    self._num_slots = 0
                    return []
        return self._open_reader(slots_path, index_path)

    def _open_writer(self, exists: bool, slots_path: str, index_path: str) -> list[IndexRecord]:
        import fcntl

        os.makedirs(self._directory, exist_ok=True)
        lock = os.open(os.path.join(self._directory, disk_layout.LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        self._fds.append(lock)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not exists:
            disk_layout.write_layout(self._directory, self._layout, self._num_slots)
        found = disk_index.read_index(index_path, self._fingerprint, self._block_size)
        records, end = found if found is not None else ([], 0)
        live = disk_index.newest_per_slot(records, self._num_slots)
        if found is None or len(records) > 2 * len(live) + COMPACT_SLACK:
            records = [r for r in records if live.get(r.slot) is r]
            disk_index.rewrite(index_path, self._fingerprint, records)
            disk_layout.fsync_directory(self._directory)
            end = disk_index.HEADER_BYTES + sum(len(disk_index.encode(r)) for r in records)
        slots_fd = os.open(slots_path, os.O_RDWR | os.O_CREAT, 0o644)
        self._fds.append(slots_fd)
        if os.fstat(slots_fd).st_size < self._num_slots * self._slot_bytes:
            os.ftruncate(slots_fd, self._num_slots * self._slot_bytes)  # sparse: disk is used as slots fill
        index_fd = os.open(index_path, os.O_RDWR)
        self._fds.append(index_fd)
        if os.fstat(index_fd).st_size != end:
            os.ftruncate(index_fd, end)  # a torn tail record: appends go after the last good one
        staging = np.empty((self._queue_blocks, self._slot_bytes), dtype=np.uint8)
        staging.fill(0)  # fault the pages in now, not on the engine's first demotions
        self._io = DiskIO(slots_fd, index_fd, end, self._slot_bytes, staging, self._compression, self._durable)
        return records

    def _open_reader(self, slots_path: str, index_path: str) -> list[IndexRecord]:
        found = disk_index.read_index(index_path, self._fingerprint, self._block_size)
        try:
            slots_fd = os.open(slots_path, os.O_RDONLY)
        except OSError as err:
            self._degrade(f"{type(err).__name__}: {err}")
            self._num_slots = 0
            return []
        self._fds.append(slots_fd)
        if self._degraded is None:
            self._degraded = "read_only"
        self._io = DiskIO(slots_fd, None, 0, self._slot_bytes, np.empty((0, self._slot_bytes), np.uint8),
                          self._compression, False)
        return found[0] if found is not None else []

    def _degrade(self, reason: str) -> None:
        self._degraded = reason
        _log.warning("disk_tier_not_writable", directory=self._directory, reason=reason)

    # -- facts ----------------------------------------------------------------------------

    def label(self) -> str:
        """A short name for messages."""
        return f"DiskTier({self._directory!r})"

    def directory(self) -> str:
        """The tier's directory."""
        return self._directory

    def compression(self) -> str | None:
        """The lossless compression of stored blocks (None or "zstd")."""
        return self._compression

    def is_bound(self) -> bool:
        """True once a prefix cache opened the directory (and until `close`)."""
        return self._bound and not self._closed

    def is_writable(self) -> bool:
        """True when blocks can be written (bound, open, not read-only or degraded)."""
        return self._io is not None and not self._read_only and self._degraded is None and not self._closed

    def num_slots(self) -> int:
        """Slots in the tier (0 before `bind`)."""
        return self._num_slots if self._bound else 0

    def slot_bytes(self) -> int:
        """Bytes of one slot (a block's bytes rounded up to 4 KiB)."""
        self._check_bound()
        return self._slot_bytes

    def num_free_slots(self) -> int:
        """Slots holding nothing."""
        return len(self._free) if self._bound else 0

    def record(self, slot: int) -> IndexRecord | None:
        """The record of the block in `slot` (None while its write is in flight, or empty)."""
        return self._records.get(slot) if self._bound else None

    def is_pending(self, slot: int) -> bool:
        """True while `slot`'s write is in flight."""
        return self._bound and slot in self._pending

    def _check_bound(self) -> None:
        if not self._bound:
            raise KvCacheError(f"{self.label()} is not bound to a prefix cache yet")
        if self._closed:
            raise KvCacheError(f"{self.label()} is closed")

    # -- slots and their LRU --------------------------------------------------------------

    def alloc_slot(self) -> int | None:
        """A free slot (lowest first), or None when none is free or the tier cannot write."""
        if not self.is_writable() or not self._free or not self._staging_free:
            return None
        return heapq.heappop(self._free)

    def free_slots(self, slots: Sequence[int]) -> None:
        """Give slots back (they leave the LRU); a slot whose write is in flight becomes free
        when it completes."""
        for slot in slots:
            if slot not in self._lru and slot not in self._records and slot not in self._pending:
                continue  # already free
            self._lru.pop(slot, None)
            self._records.pop(slot, None)
            if slot in self._pending:
                self._orphans.add(slot)
            else:
                heapq.heappush(self._free, slot)

    def touch(self, slots: Sequence[int]) -> None:
        """Mark slots used now, in order (the last is the most recent)."""
        lru = self._lru
        if not lru:
            lru.update(dict.fromkeys(slots))  # a fresh LRU (at start): one C loop
            return
        for slot in slots:
            lru[slot] = None
            lru.move_to_end(slot)

    def oldest(self):
        """The cached slots, least recently used first (lazy: do not change the LRU while iterating)."""
        return iter(self._lru)

    def num_cached_blocks(self) -> int:
        """Slots holding (or being written with) a cached block."""
        return len(self._lru)

    # -- writes ---------------------------------------------------------------------------

    def write(self, slot: int, rows: Sequence[np.ndarray], meta: IndexRecord) -> bool:
        """Queue the write of one block (`rows`: its bytes, the host tier's rows) into
        `slot` (from `alloc_slot`), indexed with `meta` (hash, parent, adapter, tokens) once
        written. The bytes are copied now; the engine never waits for the write. False (the
        slot freed again) when no staging slot is free."""
        if not self._staging_free:
            self._counts["skipped"] += 1
            heapq.heappush(self._free, slot)
            return False
        staging = self._staging_free.pop()
        buffer = self._io._staging[staging]
        at = 0
        for row in rows:
            n = row.nbytes
            buffer[at : at + n] = row
            at += n
        self._pending[slot] = staging
        self._lru[slot] = None
        self._lru.move_to_end(slot)
        self._io.submit(WriteJob(slot, staging, at, meta))
        return True

    def count_skipped(self) -> None:
        """Count one block not written because every staging slot was busy (its write queue
        full; `stats().skipped_writes`): for a caller whose `alloc_slot` gave None for that."""
        self._counts["skipped"] += 1

    def staging_free(self) -> int:
        """Staging slots free: blocks that can be queued now."""
        return len(self._staging_free) if self.is_writable() else 0

    def take_finished(self) -> list[tuple[int, bool]]:
        """The writes finished since the last call: (slot, written) for each slot still
        wanted (a failed one is freed; a warning is logged when writes start failing)."""
        self.poll()
        out, self._finished = self._finished, []
        return out

    def poll(self) -> None:
        """Take the I/O thread's completions into the bookkeeping (`take_finished` reports them)."""
        if self._io is None:
            return
        out = self._finished
        for done in self._io.take_completions():
            self._staging_free.append(done.staging)
            slot = done.slot
            del self._pending[slot]
            if done.record is not None:
                self._counts["writes"] += 1
                if self._failing:
                    self._failing = False
                    _log.warning("disk_tier_writes_recovered", directory=self._directory)
            else:
                self._counts["failed_writes"] += 1
                if not self._failing:
                    self._failing = True
                    _log.warning("disk_tier_write_failed", directory=self._directory, slot=slot, error=done.error)
            if slot in self._orphans:
                self._orphans.discard(slot)
                heapq.heappush(self._free, slot)
                continue
            if done.record is not None:
                self._records[slot] = done.record
            else:
                self._lru.pop(slot, None)
                heapq.heappush(self._free, slot)
            out.append((slot, done.record is not None))

    def flush(self) -> None:
        """Wait until every queued write is done (and take it into the bookkeeping)."""
        if self._io is not None and self._pending:
            self._io.barrier()
        self.poll()

    # -- reads ----------------------------------------------------------------------------

    def read(self, slots: Sequence[int], buffers: Sequence[Sequence[np.ndarray]]) -> list[bool]:
        """Read each slot's block into its buffers (writable byte arrays, a block's rows),
        waiting for writes of those slots still in flight first. Per slot: True when the
        bytes match the record's checksum; a failure is counted and logged, and the caller
        frees the slot (its buffers may hold anything)."""
        self._check_bound()
        if any(s in self._pending for s in slots):
            self.flush()
        jobs, index = [], []
        ok = [False] * len(slots)
        for i, (slot, rows) in enumerate(zip(slots, buffers)):
            record = self._records.get(slot)
            if record is not None:
                jobs.append(ReadJob(slot, record, [memoryview(r).cast("B") for r in rows]))
                index.append(i)
        results = self._io.read(jobs) if jobs else []
        for i, job, error in zip(index, jobs, results):
            if error is None:
                ok[i] = True
                self._counts["reads"] += 1
            else:
                self._counts["failed_reads"] += 1
                _log.warning("disk_tier_read_dropped", directory=self._directory, slot=job.slot, error=error)
        self._counts["failed_reads"] += len(slots) - len(jobs)  # no record: its write failed meanwhile
        return ok

    # -- whole-tier operations --------------------------------------------------------------

    def forget_all(self) -> None:
        """Forget every stored block, here and on disk (the index is emptied, so a restart
        finds nothing): what `PrefixCache.clear()` does to the disk tier."""
        self._check_bound()
        self.flush()
        for slot in list(self._records) + list(self._lru):
            self._lru.pop(slot, None)
            if self._records.pop(slot, None) is not None or slot not in self._free:
                heapq.heappush(self._free, slot)
        self._free = sorted(set(self._free))
        if self.is_writable():
            try:
                self._reset_index()
            except OSError as err:
                self._degrade(f"{type(err).__name__}: {err}")

    def _reset_index(self) -> None:
        """Replace the index by an empty one (the I/O thread is idle: flushed, and only the
        engine thread queues work)."""
        path = os.path.join(self._directory, disk_layout.INDEX_FILE)
        disk_index.rewrite(path, self._fingerprint, [])
        fd = os.open(path, os.O_RDWR)
        old, self._io._index_fd = self._io._index_fd, fd
        self._io._index_end = disk_index.HEADER_BYTES
        self._fds = [f for f in self._fds if f != old] + [fd]
        if old is not None:
            os.close(old)

    def stats(self) -> DiskTierStats:
        """The counters (see DiskTierStats)."""
        io = self._io
        return DiskTierStats(
            slots=self.num_slots(), cached_blocks=len(self._lru) if self._bound else 0,
            pending_writes=len(self._pending) if self._bound else 0,
            writes=self._counts["writes"], skipped_writes=self._counts["skipped"],
            failed_writes=self._counts["failed_writes"], reads=self._counts["reads"],
            failed_reads=self._counts["failed_reads"],
            bytes_written=io.bytes_written if io else 0, bytes_raw=io.bytes_raw if io else 0,
            restored_blocks=self._counts["restored"], degraded=self._degraded,
        )

    def close(self) -> None:
        """Finish every queued write, stop the I/O thread, close the files and release the
        writer lock. The directory keeps what was written. A second call does nothing."""
        if self._closed:
            return
        if self._io is not None:
            self._io.close()
            if self._bound:
                self.poll()
        self._closed = True
        self._close_fds()
        _log.info("disk_tier_closed", directory=self._directory)

    def _close_fds(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DiskTier({self._directory!r}, slots={self.num_slots()}, compression={self._compression!r})"

