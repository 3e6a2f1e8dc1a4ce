"""Block keys beyond the tokens: a cache salt (a namespace: no prefix-cache hit, and so no
timing signal, across salts) and extra keys attached to the blocks they cover (an image's
content hash over its placeholder tokens, a LoRA name over the whole prompt).

`block_keys(adapter_id, cache_salt, extra_keys, block_size)` checks them and returns a
`BlockKeys`, or None when there are none (the tree's plain path, unchanged). The radix tree
then roots a salted prompt under `(adapter_id, salt)` instead of `adapter_id`, and a block
that an extra key covers (even partly) is keyed by its tokens' int64 bytes followed by
`EXTRA_MARK` and the exact encoding of its extra keys, so two prompts with the same tokens
and different extra keys never share that block nor anything after it. Keys are compared
exactly (never by a digest of them).
"""

from __future__ import annotations

from ..core.validate import non_negative_int

EXTRA_MARK = b"\xffpagedkv-extra"
"""What separates a block's token bytes from its extra keys in its key."""


def _tagged(value: object, what: str) -> bytes:
    """A key's exact bytes, tagged by type so that "1", b"1" and 1 never collide."""
    if isinstance(value, str):
        raw, tag = value.encode("utf-8"), b"s"
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw, tag = bytes(value), b"b"
    elif type(value) is int:
        if value < 0:
            raise ValueError(f"{what} must be a str, bytes or an int >= 0, got {value!r}")
        raw, tag = str(value).encode("ascii"), b"i"
    else:
        raise TypeError(f"{what} must be a str, bytes or an int >= 0, got {type(value).__name__} {value!r:.60}")
    return tag + len(raw).to_bytes(4, "little") + raw


def salt_bytes(cache_salt: object) -> bytes | None:
    """`cache_salt` (None, a non-empty str or bytes) as its tagged bytes; None for no salt."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, (str, bytes)) or not cache_salt:
        raise TypeError(f"cache_salt must be a non-empty str or bytes, got {type(cache_salt).__name__} {cache_salt!r:.60}")
    return _tagged(cache_salt, "cache_salt")


def extra_key_ranges(extra_keys: object) -> tuple[tuple[int, int, object], ...]:
    """`extra_keys` (an iterable of `(offset, length, key)`: token positions `[offset,
    offset + length)`, length >= 1, key a str, bytes or int >= 0) checked, in the given
    order; ValueError / TypeError naming the bad entry."""
    if extra_keys is None:
        return ()
    if isinstance(extra_keys, (str, bytes)) or not hasattr(extra_keys, "__iter__"):
        raise TypeError(f"extra_keys must be an iterable of (offset, length, key), got {extra_keys!r:.60}")
    out = []
    for i, entry in enumerate(extra_keys):
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            raise ValueError(f"extra_keys[{i}] must be (offset, length, key), got {entry!r:.60}")
        offset = non_negative_int(entry[0], f"extra_keys[{i}] offset")
        length = non_negative_int(entry[1], f"extra_keys[{i}] length")
        if length == 0:
            raise ValueError(f"extra_keys[{i}] length must be >= 1, got 0")
        _tagged(entry[2], f"extra_keys[{i}] key")
        out.append((offset, length, entry[2]))
    return tuple(out)


class BlockKeys:
    """The key context of one prompt: `root_key` (the tree root it lives under), the salt,
    and the extra-key ranges; `suffix(i)` is what block i's key carries after its tokens."""

    __slots__ = ("adapter_id", "salt", "salt_raw", "extra", "block_size", "root_key", "_suffixes")

    def __init__(self, adapter_id: int, salt: object, salt_raw: bytes | None, extra: tuple, block_size: int):
        self.adapter_id = adapter_id
        self.salt = salt  # as given (str or bytes), for events and hash schemes
        self.salt_raw = salt_raw
        self.extra = extra
        self.block_size = block_size
        self.root_key = adapter_id if salt_raw is None else (adapter_id, salt_raw)
        self._suffixes: dict[int, bytes] = {}

    def keys_of_block(self, i: int) -> tuple:
        """The extra keys covering block i (any of its positions), in the given order."""
        bs = self.block_size
        lo, hi = i * bs, (i + 1) * bs
        return tuple(key for offset, length, key in self.extra if offset < hi and offset + length > lo)

    def suffix(self, i: int) -> bytes:
        """The bytes block i's key carries after its tokens (b"" when no extra key covers it)."""
        if not self.extra:
            return b""
        got = self._suffixes.get(i)
        if got is None:
            keys = self.keys_of_block(i)
            got = b"" if not keys else EXTRA_MARK + b"".join(_tagged(k, "key") for k in keys)
            self._suffixes[i] = got
        return got


def block_keys(adapter_id: int, cache_salt: object, extra_keys: object, block_size: int) -> BlockKeys | None:
    """The checked `BlockKeys` of a prompt, or None with no salt and no extra keys."""
    raw = salt_bytes(cache_salt)
    extra = extra_key_ranges(extra_keys)
    if raw is None and not extra:
        return None
    return BlockKeys(adapter_id, cache_salt, raw, extra, block_size)


def with_ranges(keys: BlockKeys | None, adapter_id: int, ranges: tuple, block_size: int) -> BlockKeys | None:
    """`keys` (None: a prompt with no salt and no extra keys) with the checked `ranges`
    (absolute token positions) added after its own: a new BlockKeys (a fork may share the
    old one); `keys` itself when `ranges` is empty."""
    if not ranges:
        return keys
    if keys is None:
        return BlockKeys(adapter_id, None, None, ranges, block_size)
    return BlockKeys(keys.adapter_id, keys.salt, keys.salt_raw, keys.extra + ranges, keys.block_size)


def cut_at(keys: BlockKeys | None, end: int) -> BlockKeys | None:
    """`keys` with its extra-key ranges cut to positions before `end` (a range past it
    shortened, one starting at or after it dropped): a new BlockKeys when any changed."""
    if keys is None or all(offset + length <= end for offset, length, _ in keys.extra):
        return keys
    extra = tuple((offset, min(length, end - offset), key) for offset, length, key in keys.extra if offset < end)
    return BlockKeys(keys.adapter_id, keys.salt, keys.salt_raw, extra, keys.block_size)


def root_adapter(root_key: object) -> int:
    """The adapter id of a tree root key (`adapter_id` or `(adapter_id, salt)`)."""
    return root_key if type(root_key) is int else root_key[0]  # type: ignore[index]


def salted_root_hash(adapter_id: int, salt_raw: bytes) -> int:
    """The 64-bit hash of a salted root (default hash scheme): blake2b-64 like `root_hash`,
    over the root's prefix, the adapter and the tagged salt."""
    import hashlib

    digest = hashlib.blake2b(b"pagedkv-prefix-root" + adapter_id.to_bytes(8, "little") + b"salt" + salt_raw,
                             digest_size=8)
    return int.from_bytes(digest.digest(), "little")



def decode_tagged(data: bytes) -> list:
    """The keys `_tagged` wrote one after another in `data`, back as str, bytes or int."""
    out, at = [], 0
    while at < len(data):
        tag, n = data[at : at + 1], int.from_bytes(data[at + 1 : at + 5], "little")
        raw = data[at + 5 : at + 5 + n]
        out.append(raw.decode("utf-8") if tag == b"s" else bytes(raw) if tag == b"b" else int(raw))
        at += 5 + n
    return out


def node_extra_keys(node, block_size: int) -> tuple | None:
    """The extra keys of a tree node as vLLM places them: the keys covering its block, in
    the given order, then the cache salt when it is a salted prompt's first block; None
    when there are none."""
    keys = decode_tagged(node.key[8 * block_size + len(EXTRA_MARK) :]) if len(node.key) > 8 * block_size else []
    parent = node.parent
    if parent is not None and parent.block == -1 and parent.key:  # a salted root keeps its salt as its key
        keys += decode_tagged(parent.key)
    return tuple(keys) if keys else None
