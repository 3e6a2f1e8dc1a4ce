"""The disk tier's I/O thread: every file read and write of one tier, in FIFO order, off
the engine's thread.

The engine thread copies a block into a staging slot (a bounded buffer the tier owns) and
queues a `WriteJob`; it never waits for a write. The thread takes every job queued so far
as one batch: compresses (zstd, when the tier does) and checksums each block (XXH3-64 of the
stored bytes), writes runs of consecutive slots with one `pwritev`, optionally fdatasyncs,
and only then appends the batch's index records in one write. Each job comes back as a
`Completion` (`take_completions`), failed ones with the error; a failed index append is
truncated away so the log stays scannable. Reads (`read`) queue behind the writes before
them, so a read of a slot sees the write queued earlier; each block is one `preadv`
scattering straight into the host block's rows, verified against its record's checksum.

`FileOps` holds the OS calls; a test replaces one to inject ENOSPC or EIO.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from typing import Any, NamedTuple, Sequence

import numpy as np

from ..core.log import get_logger
from . import disk_index
from .disk_index import CODEC_RAW, CODEC_ZSTD, IndexRecord

_log = get_logger("disk_tier")


def _checksum(chunks: Sequence[Any]) -> int:
    import xxhash

    if len(chunks) == 1:
        return xxhash.xxh3_64_intdigest(chunks[0])
    state = xxhash.xxh3_64()
    for chunk in chunks:
        state.update(chunk)
    return state.intdigest()


class FileOps:
    """The OS calls of the I/O thread (an instance attribute, so a test can replace one)."""

    def __init__(self) -> None:
        self.pwritev = os.pwritev
        self.pwrite = os.pwrite
        self.preadv = os.preadv
        self.pread = os.pread
        self.fdatasync = os.fdatasync
        self.ftruncate = os.ftruncate


class WriteJob(NamedTuple):
    """Write staging slot `staging` (its first `nbytes`) into disk slot `slot`, then index it
    with `meta` (an IndexRecord whose stored bytes, codec and checksum the thread fills in)."""

    slot: int
    staging: int
    nbytes: int
    meta: IndexRecord


class Completion(NamedTuple):
    """The outcome of one WriteJob: the record appended (None when it failed) and the error."""

    slot: int
    staging: int
    record: IndexRecord | None
    error: str | None


class ReadJob(NamedTuple):
    """Read disk slot `slot`, described by `record`, into `buffers` (writable byte views whose
    lengths add up to the block's bytes: the host block's rows)."""

    slot: int
    record: IndexRecord
    buffers: list


class _ReadRequest:
    def __init__(self, jobs: list[ReadJob]):
        self.jobs = jobs
        self.results: list[str | None] = []
        self.done = threading.Event()


_STOP = object()


class DiskIO:
    """The thread and its queue over an open slot file and index file (descriptors the
    caller owns and closes after `close`)."""

    def __init__(self, slots_fd: int, index_fd: int | None, index_end: int, slot_bytes: int, staging: np.ndarray,
                 compression: str | None, durable: bool):
        self.ops = FileOps()
        self._slots_fd = slots_fd
        self._index_fd = index_fd
        self._index_end = index_end
        self._slot_bytes = slot_bytes
        self._staging = staging
        self._compression = compression
        self._durable = durable
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done: collections.deque[Completion] = collections.deque()
        self.bytes_written = 0  # stored (compressed) bytes, written by the thread only
        self.bytes_raw = 0  # the same blocks' raw bytes
        self.bytes_read = 0
        self._thread = threading.Thread(target=self._run, name="pagedkv-disk-io", daemon=True)
        self._thread.start()

    # -- the engine's side ----------------------------------------------------------------

    def submit(self, job: WriteJob) -> None:
        """Queue a write (never blocks)."""
        self._queue.put(job)

    def take_completions(self) -> list[Completion]:
        """The writes finished since the last call, in order."""
        out = []
        done = self._done
        while done:
            out.append(done.popleft())
        return out

    def read(self, jobs: list[ReadJob]) -> list[str | None]:
        """Read the slots of `jobs` into their buffers, after every write queued before;
        blocks until done. Per job: None when the bytes were read and match the record's
        checksum, else what went wrong (the buffers may then hold anything)."""
        if not jobs:
            return []
        request = _ReadRequest(jobs)
        self._queue.put(request)
        request.done.wait()
        return request.results

    def barrier(self) -> None:
        """Block until every job queued before this call is done."""
        request = _ReadRequest([])
        self._queue.put(request)
        request.done.wait()

    def close(self) -> None:
        """Finish every queued job, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        compressor = decompressor = None
        if self._compression == "zstd":
            import zstandard  # the optional `zstd` extra; the tier checked it is installed

            compressor, decompressor = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
        pending: list[WriteJob] = []
        while True:
            item = self._queue.get()
            items = [item]
            try:
                while True:
                    items.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            for item in items:
                if isinstance(item, WriteJob):
                    pending.append(item)
                    continue
                if pending:
                    self._write_batch(pending, compressor)
                    pending = []
                if item is _STOP:
                    return
                self._read(item, decompressor)
            if pending:
                self._write_batch(pending, compressor)
                pending = []

    def _write_batch(self, jobs: list[WriteJob], compressor: Any) -> None:
        records: list[IndexRecord] = []
        try:
            payloads = []
            for job in jobs:
                raw = self._staging[job.staging, : job.nbytes]
                codec, payload = CODEC_RAW, raw
                if compressor is not None:
                    packed = compressor.compress(raw)
                    if len(packed) < job.nbytes:
                        codec, payload = CODEC_ZSTD, packed
                payloads.append(payload)
                records.append(job.meta._replace(slot=job.slot, stored_bytes=len(payload), codec=codec,
                                                 checksum=_checksum([payload])))
            self._write_slots(jobs, payloads)
            if self._durable:
                self.ops.fdatasync(self._slots_fd)
            self._append(records)
        except Exception as err:  # noqa: BLE001 - any failure: the batch is not cached, the engine goes on
            message = f"{type(err).__name__}: {err}"
            for job in jobs:
                self._done.append(Completion(job.slot, job.staging, None, message))
            return
        for job, record in zip(jobs, records):
            self.bytes_written += record.stored_bytes
            self.bytes_raw += job.nbytes
            self._done.append(Completion(job.slot, job.staging, record, None))

    def _write_slots(self, jobs: list[WriteJob], payloads: list) -> None:
        """Write each payload at its slot: runs of consecutive slots in one pwritev."""
        order = sorted(range(len(jobs)), key=lambda i: jobs[i].slot)
        run: list[int] = []
        for i in order + [None]:
            if run and (i is None or jobs[i].slot != jobs[run[-1]].slot + 1 or len(run) >= 512):
                self._write_run([jobs[j].slot for j in run], [payloads[j] for j in run])
                run = []
            if i is not None:
                run.append(i)

    def _write_run(self, slots: list[int], payloads: list) -> None:
        slot_bytes = self._slot_bytes
        buffers = []
        for k, payload in enumerate(payloads):
            buffers.append(memoryview(payload).cast("B"))
            pad = slot_bytes - len(payload)
            if k + 1 < len(payloads) and pad:  # keep the next slot's bytes at its own offset
                buffers.append(memoryview(bytes(pad)))
        offset = slots[0] * slot_bytes
        total = sum(len(b) for b in buffers)
        written = self.ops.pwritev(self._slots_fd, buffers, offset)
        if written < total:  # a short write: finish it piece by piece
            rest = b"".join(bytes(b) for b in buffers)[written:]
            while rest:
                n = self.ops.pwrite(self._slots_fd, rest, offset + written)
                if n <= 0:
                    raise OSError(f"short write at offset {offset + written}")
                written += n
                rest = rest[n:]

    def _append(self, records: list[IndexRecord]) -> None:
        if self._index_fd is None:
            raise OSError("the index is not writable")
        data = b"".join(disk_index.encode(r) for r in records)
        start = self._index_end
        try:
            done = 0
            while done < len(data):
                n = self.ops.pwrite(self._index_fd, data[done:], start + done)
                if n <= 0:
                    raise OSError(f"short index write at offset {start + done}")
                done += n
            if self._durable:
                self.ops.fdatasync(self._index_fd)
        except BaseException:
            try:
                self.ops.ftruncate(self._index_fd, start)  # no torn record left for the scan to stop at
            except OSError as err:
                _log.warning("disk_tier_index_truncate_failed", error=str(err))
                self._index_fd = None  # appending after a torn record would hide every later one
            raise
        self._index_end = start + len(data)

    def _read(self, request: _ReadRequest, decompressor: Any) -> None:
        try:
            jobs = request.jobs
            i = 0
            while i < len(jobs):
                run = self._raw_run(jobs, i)
                if len(run) > 1:
                    request.results.extend(self._read_run(run))
                    i += len(run)
                else:
                    request.results.append(self._read_one(jobs[i], decompressor))
                    i += 1
        except Exception as err:  # noqa: BLE001 - reported per job
            message = f"{type(err).__name__}: {err}"
            request.results.extend([message] * (len(request.jobs) - len(request.results)))
        finally:
            request.done.set()

    def _raw_run(self, jobs: list[ReadJob], i: int) -> list[ReadJob]:
        """The raw jobs from `i` on whose slots follow each other (at most IOV_MAX buffers)."""
        run = [jobs[i]]
        buffers = len(jobs[i].buffers) + 1
        while (i + len(run) < len(jobs) and run[-1].record.codec == CODEC_RAW
               and jobs[i + len(run)].slot == run[-1].slot + 1 and jobs[i + len(run)].record.codec == CODEC_RAW
               and buffers + len(jobs[i + len(run)].buffers) + 1 <= 1024):
            buffers += len(jobs[i + len(run)].buffers) + 1
            run.append(jobs[i + len(run)])
        return run

    def _read_run(self, run: list[ReadJob]) -> list[str | None]:
        """Raw blocks in consecutive slots: one preadv for all of them (the padding between
        blocks into a scratch buffer), then each block's checksum."""
        buffers, totals = [], []
        for k, job in enumerate(run):
            total = sum(len(b) for b in job.buffers)
            totals.append(total)
            buffers.extend(job.buffers)
            if k + 1 < len(run) and self._slot_bytes > total:
                buffers.append(memoryview(bytearray(self._slot_bytes - total)))
        want = sum(len(b) for b in buffers)
        try:
            n = self.ops.preadv(self._slots_fd, buffers, run[0].slot * self._slot_bytes)
        except OSError as err:
            return [f"{type(err).__name__}: {err}"] * len(run)
        self.bytes_read += n
        out = []
        for job, total in zip(run, totals):
            if job.record.stored_bytes != total:
                out.append(f"record of {job.record.stored_bytes} bytes for a block of {total}")
            elif n < want:
                out.append(f"short read: {n} of {want} bytes")
            else:
                out.append(None if _checksum(job.buffers) == job.record.checksum else "checksum mismatch")
        return out

    def _read_one(self, job: ReadJob, decompressor: Any) -> str | None:
        record = job.record
        total = sum(len(b) for b in job.buffers)
        offset = job.slot * self._slot_bytes
        try:
            if record.codec == CODEC_RAW:
                if record.stored_bytes != total:
                    return f"record of {record.stored_bytes} bytes for a block of {total}"
                n = self.ops.preadv(self._slots_fd, job.buffers, offset)
                if n != total:
                    return f"short read: {n} of {total} bytes"
                self.bytes_read += n
                return None if _checksum(job.buffers) == record.checksum else "checksum mismatch"
            if record.codec != CODEC_ZSTD or decompressor is None:
                return f"codec {record.codec} not readable by this tier"
            data = self.ops.pread(self._slots_fd, record.stored_bytes, offset)
            self.bytes_read += len(data)
            if len(data) != record.stored_bytes or _checksum([data]) != record.checksum:
                return "checksum mismatch"
            raw = decompressor.decompress(data, max_output_size=total)
        except OSError as err:
            return f"{type(err).__name__}: {err}"
        except Exception as err:  # noqa: BLE001 - a corrupt frame
            return f"{type(err).__name__}: {err}"
        if len(raw) != total:
            return f"decompressed {len(raw)} bytes for a block of {total}"
        at = 0
        for buffer in job.buffers:
            n = len(buffer)
            buffer[:] = raw[at : at + n]
            at += n
        return None
