"""The prefix cache's radix tree of whole blocks, one root per adapter, and its walk.

Each node holds one block of `block_size` tokens; its children are keyed by their exact
tokens (int64 little-endian bytes, `hashing.int64_bytes`), and it carries the chained hash
of its chain (`hashing`). The tree knows where a node's KV is only as data: `block` is the
device block (-1 for a root; None once the node left the device) and `lower` an opaque id
the tiering part keeps for a node that lives in a lower tier. Recency (`last_used`) belongs
to the eviction policy. Nothing here takes references or emits events.

Invariants (checked by `check`): every node holds exactly `block_size` tokens under its own
key in its parent; `n_dev` counts the children on the device; a node's hash is
`chain_hash(parent hash, tokens)` (computed on first use), a root's `root_hash(adapter_id)`; `by_block` indexes
exactly the nodes on the device.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..core.validate import non_negative_int
from ..errors import KvCacheError, RefCountError
from .block_keys import EXTRA_MARK, BlockKeys, root_adapter, salted_root_hash
from .hashing import HASH_START, chain_digest, int64_bytes, root_hash


ADAPTER_ID_LIMIT = 2**64
"""Adapter ids are below this: a root's hash, the disk index and the event wire hold one in 64 bits."""


def adapter_id_checked(adapter_id: object) -> int:
    """`adapter_id` if it is an int in [0, 2**64) (0 = base model), else ValueError naming it."""
    number = non_negative_int(adapter_id, "adapter_id")
    if number >= ADAPTER_ID_LIMIT:
        raise ValueError(f"adapter_id must be below 2**64 (it is hashed and stored in 64 bits), got {adapter_id!r}")
    return number


class Node:
    """One cached block of the tree (or a root, `block == -1`)."""

    __slots__ = ("key", "block", "_hash", "parent", "children", "last_used", "adapter_id", "lower", "n_dev", "retain",
                 "digest")

    def __init__(self, key: bytes, block: int, hash_: int | None, parent: "Node | None", adapter_id: int):
        self.key = key  # the block's tokens as int64 little-endian bytes (exact, not a hash)
        self.block = block  # the device block; -1 for a root; None once it left the device
        self.lower = None  # the tiering part's id for a node living in a lower tier
        self.n_dev = 0  # children on the device
        self._hash = hash_  # None until first asked for (`hash`): a root always has its own
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.last_used = 0
        self.adapter_id = adapter_id
        self.retain = None  # the retention hint (`retention.Retention`), or None
        self.digest = None  # the hash under another hash scheme (`vllm_hash`), computed on first use

    @property
    def hash(self) -> int:
        """The chained content hash, `chain_hash(parent.hash, tokens)`: computed on first
        use (an event, `block_hash`, the disk tier) and kept, the same value either way."""
        value = self._hash
        return _chain_hash_of(self) if value is None else value

    @hash.setter
    def hash(self, value: int) -> None:
        self._hash = value


def _chain_hash_of(node: Node) -> int:
    """Compute and keep the hashes from the nearest ancestor that has one down to `node`."""
    chain = []
    while node._hash is None:
        chain.append(node)
        node = node.parent  # type: ignore[assignment] - a root always has its hash
    digest = node._hash.to_bytes(8, "little")
    from_bytes = int.from_bytes
    for pending in reversed(chain):
        digest = chain_digest(digest, pending.key)
        pending._hash = from_bytes(digest, "little")
    return chain[0]._hash


class RadixTree:
    """The nodes of one prefix cache: `roots` (root key -> root: an adapter id, or
    `(adapter_id, salt)` for a salted namespace, see `block_keys`) and `by_block` (device
    block -> node). A block an extra key covers is keyed by its tokens then its keys
    (`BlockKeys.suffix`); the walks take the prompt's `BlockKeys` (None: tokens only)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.key_type = np.dtype(f"V{8 * block_size}")  # a block's key: its int64 token bytes
        self.roots: dict[int, Node] = {}
        self.by_block: dict[int, Node] = {}

    def walk(self, tokens: list[int], n: int, adapter_id: object, keys: BlockKeys | None = None) -> list[Node]:
        """The cached nodes along the whole blocks of `tokens[:n]` (valid ids)."""
        if n < self.block_size or adapter_id not in self.roots:
            return []
        return self.walk_bytes(int64_bytes(tokens[: n - n % self.block_size]), adapter_id, keys)

    def walk_bytes(self, data: bytes, adapter_id: object, keys: BlockKeys | None = None) -> list[Node]:
        """The cached nodes along the whole blocks of `data` (int64 token bytes) under the
        root `adapter_id` (a root key); with `keys`, each block's key carries its suffix."""
        node = self.roots.get(adapter_id)
        path: list[Node] = []
        if node is not None and keys is not None and keys.extra:
            step = 8 * self.block_size
            for i in range(len(data) // step):
                node = node.children.get(data[i * step : (i + 1) * step] + keys.suffix(i))
                if node is None:
                    break
                path.append(node)
        elif node is not None:
            key_type = self.key_type
            for key in np.frombuffer(data, key_type, len(data) // key_type.itemsize).tolist():  # one bytes per block
                node = node.children.get(key)
                if node is None:
                    break
                path.append(node)
        return path

    def follow(self, node: Node, tokens: list[int], blocks: list[int], n_full: int,
               by_block: bool, keys: BlockKeys | None = None,
               packed: bytes | None = None, passed: list[Node] = ()) -> tuple[Node, list[Node], bytes | None, int]:
        """Walk down from `node` along the first `n_full` blocks of `tokens` (valid ids) as
        far as the tree has them. With `by_block`, the caller vouches that `blocks[i]` holds
        block i, so a cached block under the current node is followed without comparing
        its tokens. `packed`: all of `tokens` as int64 bytes, when the caller has them.
        `passed`: the nodes of the first blocks, already known (`node` the last of them):
        the walk goes on from there. Returns the last node reached, the nodes passed (in
        order, a new list), and the tokens packed as int64 bytes from block `base` on with
        `base` (`packed` and 0 when given; None and 0 when every step went through the
        index)."""
        bs = self.block_size
        step = 8 * bs
        index, passed = self.by_block, list(passed)
        data: bytes | None = packed  # else made when first needed
        base = 0
        while len(passed) < n_full:
            i = len(passed)
            child = index.get(blocks[i]) if by_block else None
            if child is None or child.parent is not node:
                if data is None:
                    base = i
                    data = int64_bytes(tokens[base * bs : n_full * bs])
                at = (i - base) * step
                key = data[at : at + step]
                child = node.children.get(key if keys is None else key + keys.suffix(i))
                if child is None:
                    break
            passed.append(child)
            node = child
        return node, passed, data, base

    def root(self, adapter_id: object) -> Node:
        """The root of a root key's blocks (an adapter id, or `(adapter_id, salt)`), made
        on first use."""
        root = self.roots.get(adapter_id)
        if root is None:
            adapter = root_adapter(adapter_id)
            salt = b"" if type(adapter_id) is int else adapter_id[1]  # type: ignore[index]
            root = self.roots[adapter_id] = Node(salt, -1, root_hash_of(adapter_id), None, adapter)
        return root

    def extend(self, parent: Node, data: bytes, first: int, blocks: list[int],
               keys: BlockKeys | None = None, key_base: int = 0) -> list[Node]:
        """New device nodes under `parent`, a chain: the i-th holds `blocks[i]` and the
        tokens of block `first + i` of `data` (int64 bytes), then the suffix `keys` gives
        the prompt's block `key_base + first + i` (`data` starting at block `key_base`).
        Returns them, parent first."""
        step = 8 * self.block_size
        index = self.by_block
        parent.n_dev += 1  # the first new child; each later one is the previous one's child
        made = []
        adapter_id = parent.adapter_id
        for offset, block in enumerate(blocks, first):
            chunk = data[offset * step : (offset + 1) * step]
            if keys is not None:
                chunk += keys.suffix(key_base + offset)
            child = Node(chunk, block, None, parent, adapter_id)  # its hash is computed when asked for
            child.n_dev = 1
            parent.children[chunk] = child
            index[block] = child
            made.append(child)
            parent = child
        parent.n_dev = 0  # the last new node has no children
        return made

    def attach(self, parent: Node, key: bytes) -> Node:
        """A new node under `parent` holding the tokens `key` (int64 bytes of one block) that
        lives off the device (`block` None, `lower` None until the tiering part sets it),
        with its chained hash; returns it. ValueError when `parent` already has that child."""
        if key in parent.children:
            raise ValueError("the parent already has a child with these tokens")
        digest = chain_digest(parent.hash.to_bytes(8, "little"), key)
        node = Node(key, None, int.from_bytes(digest, "little"), parent, parent.adapter_id)  # type: ignore[arg-type]
        parent.children[key] = node
        return node

    def remove_leaf(self, node: Node) -> None:
        """Take a device leaf out of the tree and the index (its block is None after)."""
        parent = node.parent
        del parent.children[node.key]
        parent.n_dev -= 1
        del self.by_block[node.block]
        node.block = None

    def leave_device(self, node: Node, lower: object) -> None:
        """A device leaf stays in the tree but now lives in a lower tier under `lower`."""
        node.parent.n_dev -= 1
        del self.by_block[node.block]
        node.block, node.lower = None, lower

    def enter_device(self, node: Node, block: int) -> None:
        """A node of a lower tier (whose parent is on the device) now lives in `block`."""
        node.lower, node.block = None, block
        self.by_block[block] = node
        node.parent.n_dev += 1

    def clear(self) -> None:
        """Forget every node; the device ones' `block` becomes None (a reservation still
        holding them sees they are gone) and the roots and device nodes lose their children,
        so a node something still holds (a sequence's matched prefix) keeps no other part of
        the old tree alive. The tiering part resets its nodes' `lower`."""
        for node in self.by_block.values():
            node.block = None
            node.children = {}
        for root in self.roots.values():
            root.children = {}
        self.roots.clear()
        self.by_block.clear()

    def check(self, ref_count: Callable[[int], int], check_lower: Callable[[Node], None]) -> int:
        """Raise KvCacheError (RefCountError for a count of 0) where the structure breaks an
        invariant of the module docstring; `check_lower(node)` checks each node off the
        device. Returns the number of nodes."""
        seen = 0
        bs = self.block_size
        for root_key, root in self.roots.items():
            adapter_id = root_adapter(root_key)
            if root.hash != root_hash_of(root_key) or root.block != -1:
                raise KvCacheError(f"root of adapter {adapter_id} is corrupt")
            stack = [root]
            while stack:
                parent = stack.pop()
                if parent.n_dev != sum(c.block is not None for c in parent.children.values()):
                    raise KvCacheError(f"prefix tree node of block {parent.block} miscounts its device children")
                for key, node in parent.children.items():
                    seen += 1
                    if node.parent is not parent or node.key != key or not key_fits(key, bs):
                        raise KvCacheError(f"prefix tree node for block {node.block} is misplaced")
                    if node.adapter_id != adapter_id:
                        raise KvCacheError(f"block {node.block} sits under adapter {adapter_id}'s root")
                    if node._hash is not None and node._hash != int.from_bytes(
                        chain_digest(parent.hash.to_bytes(8, "little"), key), "little"
                    ):  # (a hash not yet asked for is computed right when it is)
                        raise KvCacheError(f"block {node.block} carries a wrong hash {node.hash:#x}")
                    if node.block is None:
                        check_lower(node)
                    else:
                        if parent.block is None:
                            raise KvCacheError(f"device block {node.block} sits under a host-resident node")
                        if self.by_block.get(node.block) is not node:
                            raise KvCacheError(f"block {node.block} is in the tree but not indexed")
                        if ref_count(node.block) < 1:
                            raise RefCountError(f"cached block {node.block} has count 0")
                    stack.append(node)
        return seen


def root_hash_of(root_key: object) -> int:
    """The hash of the root of `root_key`: `root_hash(adapter_id)`, or the salted root's."""
    if type(root_key) is int:
        return root_hash(root_key)
    return salted_root_hash(*root_key)  # type: ignore[misc]


def key_fits(key: bytes, block_size: int) -> bool:
    """True for a block key: `block_size` int64 tokens, optionally followed by extra keys."""
    step = 8 * block_size
    return len(key) == step or (len(key) > step and key[step : step + len(EXTRA_MARK)] == EXTRA_MARK)


def is_keyed(node: Node, block_size: int) -> bool:
    """True when `node`'s chain carries an extra key or a salt (O(depth))."""
    while node.parent is not None:
        if len(node.key) != 8 * block_size:
            return True
        node = node.parent
    return bool(node.key)  # a salted root keeps its salt as its key
