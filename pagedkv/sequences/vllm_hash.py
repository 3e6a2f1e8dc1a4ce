"""vLLM v1's block hashes (`hash_scheme="vllm-sha256-cbor"`), so that a router hashing
token ids the vLLM way finds pagedkv's blocks.

As vLLM v1 computes them (`vllm/v1/core/kv_cache_utils.py`, `vllm/utils/hashing.py`):

- `sha256_cbor(x) = sha256(CBOR(x))`, CBOR in its canonical form (RFC 8949 4.2: the
  shortest head for every length and integer); a tuple is an array, None is null;
- the root (`NONE_HASH`) is `sha256_cbor(seed)` of the seed string (vLLM reads
  `PYTHONHASHSEED`);
- a block's hash is `sha256_cbor((parent_hash, tuple(token_ids), extra_keys))`, the
  parent being the root for a prompt's first block; `extra_keys` is None or the tuple of
  the block's extra keys: the keys covering it in the given order (vLLM puts the LoRA name
  first, then multimodal hashes: give them in that order), then the cache salt on a
  prompt's first block only.

`VllmHashes` computes a tree node's 32-byte digest lazily and keeps it on the node.
"""

from __future__ import annotations

import hashlib
import os
from typing import Sequence

from .block_keys import node_extra_keys

SCHEME = "vllm-sha256-cbor"
DEFAULT_SCHEME = "pagedkv-blake2b-64"
SCHEMES = (DEFAULT_SCHEME, SCHEME)


def _head(major: int, n: int) -> bytes:
    """A CBOR head: the major type and its argument `n`, in the shortest form."""
    if n < 24:
        return bytes((major << 5 | n,))
    if n < 0x100:
        return bytes((major << 5 | 24, n))
    if n < 0x10000:
        return bytes((major << 5 | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((major << 5 | 26,)) + n.to_bytes(4, "big")
    return bytes((major << 5 | 27,)) + n.to_bytes(8, "big")


def cbor(value: object) -> bytes:
    """The canonical CBOR of None, bool, int, bytes, str and tuples/lists of them (an int
    beyond 64 bits as a bignum, tags 2 and 3, as cbor2 writes it)."""
    if value is None:
        return b"\xf6"
    if value is True:
        return b"\xf5"
    if value is False:
        return b"\xf4"
    if isinstance(value, int):
        if value >= 0:
            if value < 1 << 64:
                return _head(0, value)
            raw = value.to_bytes((value.bit_length() + 7) // 8, "big")
            return b"\xc2" + _head(2, len(raw)) + raw
        n = -1 - value
        if n < 1 << 64:
            return _head(1, n)
        raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
        return b"\xc3" + _head(2, len(raw)) + raw
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        return _head(2, len(raw)) + raw
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return _head(3, len(raw)) + raw
    if isinstance(value, (tuple, list)):
        return _head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"no canonical CBOR for {type(value).__name__} {value!r:.60} in a block hash")


def _token_array(tokens: Sequence[int]) -> bytes:
    """`cbor(tuple(tokens))` for token ids in [0, 2**63), without a call per token."""
    out = [_head(4, len(tokens))]
    append = out.append
    for t in tokens:
        if t < 24:
            append(bytes((t,)))
        elif t < 0x100:
            append(bytes((24, t)))
        elif t < 0x10000:
            append(b"\x19" + t.to_bytes(2, "big"))
        elif t < 0x100000000:
            append(b"\x1a" + t.to_bytes(4, "big"))
        else:
            append(b"\x1b" + t.to_bytes(8, "big"))
    return b"".join(out)


def sha256_cbor(value: object) -> bytes:
    """sha256 of the canonical CBOR of `value` (vLLM's `sha256_cbor`)."""
    return hashlib.sha256(cbor(value)).digest()


def root_digest(seed: str) -> bytes:
    """vLLM's `NONE_HASH` for the seed string (its `PYTHONHASHSEED`)."""
    return sha256_cbor(seed)


def block_digest(parent: bytes, tokens: Sequence[int], extra_keys: tuple | None) -> bytes:
    """vLLM's hash of one full block: sha256 of CBOR([parent, [tokens...], extra_keys])."""
    body = b"\x83" + _head(2, len(parent)) + parent + _token_array(tokens) + cbor(extra_keys)
    return hashlib.sha256(body).digest()


def resolve_seed(hash_seed: object) -> str:
    """The seed string of the vLLM scheme: `hash_seed`, else `PYTHONHASHSEED`; ValueError
    when neither is set (vLLM would draw a random root no router can know)."""
    if hash_seed is None:
        hash_seed = os.environ.get("PYTHONHASHSEED")
        if hash_seed is None:
            raise ValueError(
                f'hash_scheme="{SCHEME}" needs hash_seed= (the engines\' PYTHONHASHSEED string), '
                "or PYTHONHASHSEED set: without it vLLM roots every chain at random bytes"
            )
    if not isinstance(hash_seed, str):
        raise TypeError(f"hash_seed must be a str (as PYTHONHASHSEED is), got {type(hash_seed).__name__} {hash_seed!r:.60}")
    return hash_seed


class VllmHashes:
    """Digests of tree nodes under vLLM's scheme, computed on first use and kept on each
    node (`Node.digest`), parents first."""

    def __init__(self, seed: str, block_size: int):
        self.seed = seed
        self.root = root_digest(seed)
        self.block_size = block_size

    def __call__(self, node) -> bytes:
        """The node's digest (the root's for a root)."""
        if node.block == -1:
            return self.root
        if node.digest is not None:
            return node.digest
        chain = []
        while node.block != -1 and node.digest is None:
            chain.append(node)
            node = node.parent
        parent = self.root if node.block == -1 else node.digest
        step = 8 * self.block_size
        for n in reversed(chain):
            tokens = [int.from_bytes(n.key[i : i + 8], "little") for i in range(0, step, 8)]
            n.digest = parent = block_digest(parent, tokens, node_extra_keys(n, self.block_size))
        return parent
