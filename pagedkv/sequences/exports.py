"""The sequence table's exports for attention kernels: block tables, CSR page tables and
slot mappings of a batch of sequences, as host arrays, and their device copies in buffers
the table owns (`ExportBuffers`).

The exports are cut from the table's kept arrays (`batch.KeptBatch`). The builders here
(`block_table_of`, `page_table_of`, `slot_mapping_of`) rebuild the same arrays from the
sequence records (`blocks`, `num_tokens`, `dropped`, `step_start`) from scratch: they are
the reference the kept exports are tested against, byte for byte.
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable, NamedTuple, Sequence

import numpy as np

from ..backends.protocol import DevicePtr, GpuBackend
from ..core.guard import guarded
from ..core.log import get_logger
from ..core.teardown import free_each
from ..core.validate import non_negative_int
from ..errors import KvCacheError
from ..interop.views import DeviceArrayPtr, export_dlpack, export_dlpack_device

_log = get_logger("sequence_table")

_ALIGN = 16  # bytes between arrays packed into one upload


class PageTable(NamedTuple):
    """The CSR block lists of paged-attention kernels (FlashInfer's `paged_kv_indptr`,
    `paged_kv_indices`, `paged_kv_last_page_len`): sequence i's blocks are
    `indices[indptr[i]:indptr[i+1]]`; `last_page_len[i]` tokens fill its last block."""

    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray


class Exported(NamedTuple):
    """An export for kernels: `host` (a numpy array, or a PageTable of arrays) and, when the
    table has a backend, `device` (a DevicePtr, or a PageTable of DevicePtrs) into a buffer
    the table owns and overwrites on the next export of the same kind; else None.
    A single-array export is a DLPack producer of `device` when there is one, else of
    `host`; each device pointer is one too (`pagedkv.views.DeviceArrayPtr`).

    `np.asarray(export)` is the host array (what `write_tokens`/`read_tokens` take as
    slots); a page table's parts are `export.indptr`, `.indices` and `.last_page_len`, each
    an Exported of one array."""

    host: object
    device: object

    __dlpack__ = export_dlpack
    __dlpack_device__ = export_dlpack_device

    @property
    def pagedkv_backend(self):
        """The backend holding `device` (None without one: the host array is exported)."""
        source = self.device[0] if isinstance(self.device, tuple) else self.device
        return getattr(source, "pagedkv_backend", None)

    def __array__(self, dtype=None, copy=None):
        """The host array (numpy's conversion protocol); a page-table export raises TypeError."""
        if isinstance(self.host, PageTable):
            raise TypeError(
                "a page-table export holds three arrays: take np.asarray(export.indptr), "
                "export.indices or export.last_page_len"
            )
        arr = np.asarray(self.host, dtype=dtype)
        return arr.copy() if copy else arr

    def _part(self, index: int) -> "Exported":
        if not isinstance(self.host, PageTable):
            raise AttributeError(f"only a page-table export has parts, this one holds {type(self.host).__name__}")
        return Exported(self.host[index], None if self.device is None else self.device[index])

    @property
    def indptr(self) -> "Exported":
        """A page-table export's `indptr` (host array and device pointer)."""
        return self._part(0)

    @property
    def indices(self) -> "Exported":
        """A page-table export's `indices` (host array and device pointer)."""
        return self._part(1)

    @property
    def last_page_len(self) -> "Exported":
        """A page-table export's `last_page_len` (host array and device pointer)."""
        return self._part(2)


def block_table_of(seqs: Sequence[Any]) -> np.ndarray:
    """The `[len(seqs), max blocks]` int32 table of each sequence's held blocks, -1 padded."""
    width = max((len(s.blocks) for s in seqs), default=0)
    table = np.full((len(seqs), width), -1, dtype=np.int32)
    for row, seq in enumerate(seqs):
        table[row, : len(seq.blocks)] = seq.blocks
    return table


def page_table_of(seqs: Sequence[Any], block_size: int) -> PageTable:
    """The int32 CSR triple of the held blocks (`SequenceTable.page_table` states the rule)."""
    lengths = np.fromiter((len(s.blocks) for s in seqs), dtype=np.int32, count=len(seqs))
    indptr = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=indptr[1:])
    indices = np.fromiter((b for s in seqs for b in s.blocks), dtype=np.int32, count=int(indptr[-1]))
    last = np.fromiter(
        (s.num_tokens - (s.dropped + len(s.blocks) - 1) * block_size if s.blocks else 0 for s in seqs),
        dtype=np.int32,
        count=len(seqs),
    )
    return PageTable(indptr, indices, last)


def slot_mapping_of(seqs: Sequence[Any], block_size: int, pad_to: int | None) -> np.ndarray:
    """int64 slots of the positions each sequence's latest step introduced, in batch
    order, -1 padded to `pad_to` (already checked against the cache's slot count)."""
    bs = block_size
    out: list[int] = []
    for seq in seqs:
        blocks, dropped = seq.blocks, seq.dropped
        if seq.num_tokens - seq.step_start <= 16:
            out.extend(blocks[p // bs - dropped] * bs + p % bs for p in range(seq.step_start, seq.num_tokens))
        else:
            positions = np.arange(seq.step_start, seq.num_tokens, dtype=np.int64)
            held = np.asarray(blocks, dtype=np.int64)
            out.extend((held[positions // bs - dropped] * bs + positions % bs).tolist())
    slots = np.array(out, dtype=np.int64)
    if pad_to is not None:
        if pad_to < slots.size:
            raise ValueError(f"pad_to must be an int >= the {slots.size} slots, got {pad_to!r}")
        slots = np.concatenate([slots, np.full(pad_to - slots.size, -1, dtype=np.int64)])
    return slots


class ExportBuffers:
    """One device buffer per kind of export on `gpu` (None: no backend, nothing uploaded),
    grown when an export outgrows it; `upload` packs the arrays of one export and copies
    them in ONE copy, ordered on `stream` for DLPack consumers."""

    def __init__(self, gpu: GpuBackend | None, stream: object):
        self._gpu = gpu
        self._stream = stream
        self._buffers: dict[str, tuple[DevicePtr, int]] = {}
        self._stale: list[DevicePtr] = []  # replaced buffers whose free failed

    def upload(self, kind: str, arrays: list[np.ndarray]):
        """Pack `arrays` into one host buffer and copy it to this kind's device buffer in one
        copy; the DevicePtr of each array (one, or a list), or None without a backend."""
        if self._gpu is None:
            return None
        offsets, total = [], 0
        for arr in arrays:
            offsets.append(total)
            total += -(-arr.nbytes // _ALIGN) * _ALIGN
        staging = np.zeros(max(total, _ALIGN), dtype=np.uint8)
        for arr, offset in zip(arrays, offsets):
            staging[offset : offset + arr.nbytes] = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        base = self._device_buffer(kind, staging.nbytes)
        self._gpu.copy_h2d(staging, base)
        ptrs = [DeviceArrayPtr(base.offset(o), arr, self._gpu, self._stream) for arr, o in zip(arrays, offsets)]
        return ptrs[0] if len(ptrs) == 1 else ptrs

    def upload_batch_table(self, batch: Any, table: np.ndarray):
        """The device copy of the persistent batch's block table `table` (a new C-contiguous
        array cut from `batch`): when the device already holds this batch's table at the
        same width, only the rows changed since (one contiguous range) and new rows are
        copied; else the whole table, as `upload`. None without a backend."""
        if self._gpu is None:
            return None
        n, width = table.shape
        current = self._buffers.get("block_table")
        incremental = batch.dev_width == width and current is not None and current[1] >= table.nbytes
        batch.dev_width = -1  # until this upload is done
        if incremental:
            base = current[0]
            start = min(batch.lo, batch.dev_rows)
            stop = n if n > batch.dev_rows else min(batch.hi, n)
            if start < stop:
                self._gpu.copy_h2d(table[start:stop], base.offset(start * width * table.itemsize))
            ptr = DeviceArrayPtr(base, table, self._gpu, self._stream)
        else:
            ptr = self.upload("block_table", [table])
        batch.uploaded(width, n)
        return ptr

    def _device_buffer(self, kind: str, nbytes: int) -> DevicePtr:
        current = self._buffers.get(kind)
        if current is not None and current[1] >= nbytes:
            return current[0]
        size = max(nbytes, 2 * current[1] if current else 4096)
        ptr = self._gpu.alloc(size)
        self._buffers[kind] = (ptr, size)  # recorded before the old one is freed
        if current is not None:
            try:
                self._gpu.free(current[0])
            except Exception as err:  # noqa: BLE001 - the export goes on; release retries the free
                self._stale.append(current[0])
                _log.error("sequence_table_buffer_free_failed", error=str(err))
        return ptr

    def release(self, gpu: GpuBackend | None) -> None:
        """Free every buffer on the table's backend (`gpu` if it has none): each attempted,
        the first error raised, a buffer whose free failed kept for the next call. Once
        all are freed a further call does nothing."""
        pending = [ptr for ptr, _ in self._buffers.values()] + self._stale
        if not pending:
            return
        if gpu is not None and self._gpu is not None and gpu is not self._gpu:
            raise KvCacheError(
                f"release with {type(gpu).__name__} {gpu!r:.60}, but the table's export buffers are on "
                f"{type(self._gpu).__name__} {self._gpu!r:.60}"
            )
        backend = self._gpu or gpu
        if backend is None:
            raise ValueError(f"release needs the backend that holds the table's {len(pending)} export buffer(s)")
        self._buffers = {}
        self._stale, first = free_each(pending, backend.free, _log, "sequence_table_buffer_free_failed")
        if first is not None:
            raise first


class SequenceExports:
    """The export half of `SequenceTable` (it sets `_seqs`, `_bs`, `_cache`, `_exports`,
    `_batch`, `_guard` and `_get`): every export is guarded like the table's other calls.

    Every export takes `seq_ids` (an iterable of live ids, each at most once, in the order
    wanted) or None: the table's persistent batch, `batch_ids()`, in row order. Exports are
    cut from arrays the table keeps as sequences change (`batch.KeptBatch`), so their cost
    follows the batch's size, not a rebuild from every held block; with None the block
    table's device copy uploads only the rows changed since its previous upload."""

    def _seq_list(self, seq_ids: Iterable[Hashable]) -> list[Any]:
        """The live sequences of `seq_ids`, each at most once; TypeError for a str, a
        non-iterable or an unordered collection (a set: its order is undefined), ValueError naming a repeated id, KeyError naming an unknown one."""
        if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__iter__"):
            raise TypeError(f"seq_ids must be an iterable of sequence ids, got {seq_ids!r:.60}")
        if isinstance(seq_ids, (set, frozenset, dict)) or type(seq_ids).__name__ in ("dict_keys", "dict_values"):
            raise TypeError(f"seq_ids must be ordered (a list or tuple: its order is the rows' order), "
                            f"got a {type(seq_ids).__name__}")
        ids = list(seq_ids)
        live = self._seqs
        try:
            seqs = [live[s] for s in ids]
        except KeyError:
            seqs = [self._get(s) for s in ids]  # raises naming the unknown id
        if len(set(map(id, seqs))) != len(seqs):
            seen: set[int] = set()
            for seq_id, seq in zip(ids, seqs):
                if id(seq) in seen:
                    raise ValueError(f"sequence {seq_id!r} is listed more than once in seq_ids")
                seen.add(id(seq))
        return seqs

    def _records(self, seq_ids: Iterable[Hashable] | None) -> tuple[list[Any], Any]:
        """(records, rows) of `seq_ids`; rows is None for the whole batch (seq_ids None)."""
        batch = self._batch
        if seq_ids is None:
            return batch.seqs, None
        seqs = self._seq_list(seq_ids)
        return seqs, np.fromiter([s.row for s in seqs], dtype=np.intp, count=len(seqs))

    @guarded
    def batch_ids(self) -> list[Hashable]:
        """The persistent batch's ids in row order: what an export with `seq_ids=None`
        covers. A sequence keeps its row while it lives; added (or forked) sequences take
        the next row; freeing one moves the last row's sequence into its row, the only way
        this order changes."""
        return list(self._batch.ids)

    @guarded
    def block_table(self, seq_ids: Iterable[Hashable] | None = None) -> Exported:
        """A `[num_seqs, max_blocks]` int32 table of each sequence's held blocks, padded
        with -1 (A holding [7, 2, 9] and B [4] give `[[7, 2, 9], [4, -1, -1]]`); `seq_ids`
        None: the whole batch (`batch_ids()`). The export is a DLPack producer: of the
        device buffer with a backend, else of the host array (a new array each call)."""
        batch = self._batch
        if seq_ids is None:
            table = batch.block_table(None)
            return Exported(table, self._exports.upload_batch_table(batch, table))
        seqs, rows = self._records(seq_ids)
        table = batch.block_table(rows)
        batch.dev_width = -1  # the device buffer now holds this table, not the batch's
        return Exported(table, self._exports.upload("block_table", [table]))

    @guarded
    def page_table(self, seq_ids: Iterable[Hashable] | None = None) -> Exported:
        """The CSR triple `(indptr, indices, last_page_len)`, int32, of the held blocks
        (`seq_ids` None: the whole batch).

        `last_page_len` follows FlashInfer's rule: between 1 and `block_size` for a sequence
        with tokens, so its held length is `(pages - 1) * block_size + last_page_len`. A
        sequence with no tokens holds no pages (`indptr[i] == indptr[i+1]`) and gets 0.
        Example, block_size 4: A holds blocks [7, 2, 9] with 9 tokens, B [4] with 3, C none::

            indptr        = [0, 3, 4, 4]
            indices       = [7, 2, 9, 4]
            last_page_len = [1, 3, 0]

        With a backend, `device` is a PageTable of DLPack producers (kDLCPU on HostBackend,
        kDLCUDA on CudaBackend); without one, `host` holds numpy arrays (DLPack producers too)."""
        seqs, rows = self._records(seq_ids)
        host = self._batch.page_table(seqs, rows, self._bs)
        device = self._exports.upload("page_table", list(host))
        return Exported(host, None if device is None else PageTable(*device))

    @guarded
    def seq_lens(self, seq_ids: Iterable[Hashable] | None = None) -> Exported:
        """int32 per sequence (`seq_ids` None: the whole batch), in batch order: the tokens
        its held blocks cover, the `seq_lens` FlashAttention and vLLM's kernels take beside
        the block table (with a sliding window, `num_tokens - first_block_position`; with
        lookahead, the drafts included). The export (and `device`, with a backend) is a
        DLPack producer like the others."""
        seqs, rows = self._records(seq_ids)
        lens = self._batch.seq_lens(seqs, rows, self._bs)
        return Exported(lens, self._exports.upload("seq_lens", [lens]))

    @guarded
    def slot_mapping(self, seq_ids: Iterable[Hashable] | None = None, pad_to: int | None = None) -> Exported:
        """int64 slots (`block * block_size + offset`) of the tokens each sequence's latest
        `add` or `append` introduced (for `add`, those after the prefix-cache match),
        sequence after sequence (`seq_ids` None: the whole batch), padded with -1 (skip) to
        `pad_to` entries (at most the cache's slot count, `num_blocks * block_size`).

        Example, block_size 4: A holds blocks [7, 2, 9] and its latest append added
        positions 7 and 8; B holds [4] and was just added with 3 tokens::

            slot_mapping(["A", "B"], pad_to=6) = [2*4+3, 9*4+0, 4*4+0, 4*4+1, 4*4+2, -1]
                                               = [11, 36, 16, 17, 18, -1]

        The export (and `device`, with a backend) is a DLPack producer."""
        bs = self._bs
        if pad_to is not None:
            pad_to = non_negative_int(pad_to, "pad_to")
            limit = self._cache.num_blocks() * bs
            if pad_to > limit:
                raise ValueError(f"pad_to is {pad_to}, more than the cache's {limit} slots")
        seqs, rows = self._records(seq_ids)
        slots = self._batch.slot_mapping(seqs, rows, bs, pad_to)
        return Exported(slots, self._exports.upload("slot_mapping", [slots]))


def token_slots_of(seq: Any, block_size: int, start: int, stop: int) -> np.ndarray:
    """int64 slots of positions [start, stop) of `seq` (already checked against its held blocks)."""
    positions = np.arange(start, stop, dtype=np.int64)
    held = np.asarray(seq.blocks, dtype=np.int64)
    return held[positions // block_size - seq.dropped] * block_size + positions % block_size


class SequenceQueries:
    """Membership, count and ids of a sequence table's live sequences (it sets `_seqs`, a
    dict of id -> record in the order they were added)."""

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def seq_ids(self) -> list[Hashable]:
        """Live sequence ids, in the order they were added."""
        return list(self._seqs)


class LengthExports:
    """The length and whole-sequence slot exports of `SequenceTable` (it sets what
    `SequenceExports` names), guarded like its other calls."""

    @guarded
    def token_slots(self, seq_id: Hashable, start: int = 0, stop: int | None = None) -> Exported:
        """int64 slots of positions [start, stop) of one sequence (stop defaults to its end,
        drafts of a lookahead included): a whole prompt's prefill. `start` may not precede
        `first_block_position` (blocks a window released have no slots) and `stop` may not
        pass the end: ValueError naming the value. The export (and `device`, with a backend)
        is a DLPack producer."""
        seq = self._get(seq_id)
        end = seq.num_tokens
        start = non_negative_int(start, "start")
        stop = end if stop is None else non_negative_int(stop, "stop")
        first = seq.dropped * self._bs
        if stop > end:
            raise ValueError(f"stop is {stop}, past the {end} positions of sequence {seq_id!r}")
        if start > stop:
            raise ValueError(f"start is {start}, after stop {stop}")
        if start < first and start < stop:
            raise ValueError(f"start is {start}, but the window released positions before {first} of sequence {seq_id!r}")
        slots = token_slots_of(seq, self._bs, start, stop)
        return Exported(slots, self._exports.upload("token_slots", [slots]))
