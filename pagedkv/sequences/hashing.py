"""The prefix cache's block keys and chained hashes.

A block's key is its tokens as int64 little-endian bytes (exact: a hash collision can never
hand one prompt another prompt's KV). Its hash is 64-bit blake2b of the parent's hash (8
bytes, little-endian) then the key, chained from a root hash per adapter: the same on every
machine and process, for KV-event consumers that track other engines' caches.
"""

from __future__ import annotations

import array
import hashlib
import sys
from typing import Sequence

HASH_START = hashlib.blake2b(digest_size=8)
"""The empty blake2b-64 state; `.copy()` per block is cheaper than a constructor."""


def root_hash(adapter_id: int) -> int:
    """The 64-bit hash a root contributes as the parent of an adapter's first blocks."""
    digest = hashlib.blake2b(b"pagedkv-prefix-root" + adapter_id.to_bytes(8, "little"), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def chain_hash(parent_hash: int, tokens: Sequence[int]) -> int:
    """blake2b-64 of the parent's hash (8 bytes, little-endian) then the tokens (int64
    little-endian): stable across processes and machines."""
    return int.from_bytes(chain_digest(parent_hash.to_bytes(8, "little"), int64_bytes(tokens)), "little")


def chain_digest(parent_digest: bytes, token_bytes: bytes) -> bytes:
    """The 8-byte digest `chain_hash` reads, from the parent's 8 bytes and the tokens' int64 bytes."""
    state = HASH_START.copy()
    state.update(parent_digest + token_bytes)
    return state.digest()


def int64_bytes(tokens: Sequence[int]) -> bytes:
    """Valid token ids (ints in [0, 2**63)) as int64 little-endian bytes: a block's key."""
    try:
        data = array.array("Q", tokens)  # the same bytes for ids >= 0, and much faster to build than "q"
    except OverflowError:
        data = array.array("q", tokens)
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        data.byteswap()
    return data.tobytes()
