"""The disk tier's append-only index: one record per block written into a slot.

A record is appended only after its block's bytes were written (and, with `durable`,
fsynced), so a record never names bytes that were not written; a slot's newest record is
the one that counts. Each record carries what rebuilds the prefix tree without reading a
slot (adapter id, chain hash, parent hash, the block's token ids, extra keys) and what
proves the slot's bytes when they are read (the stored length, the codec and an XXH3-64
checksum of the stored bytes). A record ends with a CRC32 of itself: a record torn by a
crash fails it, and the scan stops there (a writer truncates the torn tail before
appending).

File: an 8-byte magic, the 16-character layout fingerprint, then records. Record
(little-endian): magic `PKVR`, u32 record length, u32 slot, u32 stored bytes, u8 codec
(0 raw, 1 zstd), u8 kind (1 store), u16 extra-key bytes, u64 adapter id, u64 chain hash,
u64 parent hash, u64 checksum, then `block_size` int64 token ids, the extra keys, and u32
CRC32 of everything before it. Example: block size 16, no extra keys: 52 + 128 + 4 = 184
bytes a record.
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import NamedTuple

FILE_MAGIC = b"PKVDIDX1"
HEADER_BYTES = len(FILE_MAGIC) + 16
RECORD_MAGIC = b"PKVR"
KIND_STORE = 1
CODEC_RAW, CODEC_ZSTD = 0, 1
_FIXED = struct.Struct("<4sIIIBBHQQQQ")
_CRC = struct.Struct("<I")


class IndexRecord(NamedTuple):
    """One stored block: where it is, what it is, and how to prove its bytes."""

    slot: int
    stored_bytes: int
    codec: int
    adapter_id: int
    hash: int
    parent_hash: int
    checksum: int
    tokens: bytes  # block_size int64 little-endian token ids: the block's key
    extra: bytes = b""


def header(fingerprint: str) -> bytes:
    """The index file's first bytes for a layout of `fingerprint`."""
    return FILE_MAGIC + fingerprint.encode("ascii")[:16].ljust(16, b"0")


def encode(record: IndexRecord) -> bytes:
    """The bytes of one record, CRC included."""
    length = _FIXED.size + len(record.tokens) + len(record.extra) + _CRC.size
    body = _FIXED.pack(RECORD_MAGIC, length, record.slot, record.stored_bytes, record.codec, KIND_STORE,
                       len(record.extra), record.adapter_id, record.hash, record.parent_hash,
                       record.checksum) + record.tokens + record.extra
    return body + _CRC.pack(zlib.crc32(body))


def scan(data: bytes, block_size: int) -> tuple[list[IndexRecord], int]:
    """(records, end of the last valid record) of an index file's bytes after the header.
    The scan stops at the first record that is torn, has a wrong CRC, or is not a store of
    `block_size` tokens: nothing after a bad record is trusted."""
    records: list[IndexRecord] = []
    token_bytes = 8 * block_size
    offset, end = HEADER_BYTES, len(data)
    unpack, crc = _FIXED.unpack_from, zlib.crc32
    fixed = _FIXED.size
    offset = _scan_plain(data, offset, block_size, records)  # the common case, in one C loop
    while offset + fixed + _CRC.size <= end:
        magic, length, slot, stored, codec, kind, extra_len, adapter, hash_, parent, checksum = unpack(data, offset)
        if (magic != RECORD_MAGIC or kind != KIND_STORE or length != fixed + token_bytes + extra_len + _CRC.size
                or offset + length > end):
            break
        body_end = offset + length - _CRC.size
        if crc(data[offset:body_end]) != _CRC.unpack_from(data, body_end)[0]:
            break
        tokens = data[offset + fixed : offset + fixed + token_bytes]
        extra = data[offset + fixed + token_bytes : body_end]
        records.append(IndexRecord(slot, stored, codec, adapter, hash_, parent, checksum, tokens, extra))
        offset += length
    return records, offset


def _scan_plain(data: bytes, offset: int, block_size: int, records: list[IndexRecord]) -> int:
    """Append the leading run of records without extra keys (all one size) to `records`;
    returns where the run stops (the general scan goes on from there)."""
    size = _FIXED.size + 8 * block_size + _CRC.size
    whole = struct.Struct(_FIXED.format + f"{8 * block_size}sI")
    n = (len(data) - offset) // size
    view = memoryview(data)
    crc = zlib.crc32
    make = IndexRecord
    for i, (magic, length, slot, stored, codec, kind, extra_len, adapter, hash_, parent, checksum, tokens,
            check) in enumerate(whole.iter_unpack(view[offset : offset + n * size])):
        at = offset + i * size
        if (magic != RECORD_MAGIC or kind != KIND_STORE or length != size or extra_len
                or crc(view[at : at + size - _CRC.size]) != check):
            return at
        records.append(make(slot, stored, codec, adapter, hash_, parent, checksum, tokens))
    return offset + n * size


def read_index(path: str, fingerprint: str, block_size: int) -> tuple[list[IndexRecord], int] | None:
    """(records, valid end) of the index at `path`, or None when there is no file or its
    header is not this layout's (a file written with another layout, or torn at creation)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    if data[:HEADER_BYTES] != header(fingerprint):
        return None
    return scan(data, block_size)


def newest_per_slot(records: list[IndexRecord], num_slots: int) -> dict[int, IndexRecord]:
    """slot -> the newest record naming it, for slots below `num_slots`."""
    out: dict[int, IndexRecord] = {}
    for record in records:
        if record.slot < num_slots:
            out[record.slot] = record
    return out


def rewrite(path: str, fingerprint: str, records: list[IndexRecord]) -> None:
    """Replace the index at `path` by one holding `records` only (compaction, or emptying):
    a temporary file, fsync, rename."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header(fingerprint) + b"".join(encode(r) for r in records))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
