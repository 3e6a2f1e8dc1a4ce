"""The store path of `PrefixCache`: `insert` and its unguarded body `_insert_checked` (what
`reuse.PrefixReuse.offer` calls inside the table's guard): follow the cached part of a chain,
adopt its host and disk-only nodes into the caller's blocks, extend the tree with the new
blocks, and emit their `BlockStored` events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..core.guard import guarded
from ..core.validate import block_list, token_ids_and_bytes
from ..errors import RefCountError
from .block_keys import BlockKeys, block_keys
from .events import stored
from .hashing import int64_bytes
from .tree import adapter_id_checked

if TYPE_CHECKING:
    from .tree import Node


class PrefixInsert:
    """Mixed into `PrefixCache` (it sets `_block_size`, `_cache`, `_tree`, `_by_block`,
    `_policy`, `_events`, `_check_open`, `_check_tier`, `_deliver`)."""

    @guarded
    def insert(self, tokens: Sequence[int], blocks: Sequence[int], adapter_id: int = 0,
               cache_salt: str | bytes | None = None, extra_keys=None) -> int:
        """Register the caller's full blocks of `tokens` (`blocks[i]` holds tokens
        `i*block_size ..`; a final partial block is not cached). Chunks already cached keep
        their block; new ones take one reference of the cache's own on the caller's block.
        Returns how many blocks were newly cached. Checked before anything changes;
        KvCacheError on a closed cache. `cache_salt` and `extra_keys` as for `match`."""
        self._check_open("insert")
        adapter_id = adapter_id_checked(adapter_id)
        keys = block_keys(adapter_id, cache_salt, extra_keys, self._block_size)
        tokens, packed = token_ids_and_bytes(tokens, "tokens", copy=False)  # checked and packed once; not kept
        blocks = block_list(blocks, self._cache.num_blocks(), "blocks")  # names a bad entry
        bs = self._block_size
        n_full = len(tokens) // bs
        if not n_full <= len(blocks) <= -(-len(tokens) // bs):
            raise ValueError(f"{len(tokens)} tokens fill {n_full} block(s) of {bs}, but {len(blocks)} blocks were given")
        return self._insert_checked(tokens, blocks, n_full, adapter_id, False, keys, packed)

    def _insert_checked(self, tokens: list[int], blocks: list[int], n_full: int, adapter_id: int, by_block: bool,
                        keys: BlockKeys | None = None, packed: bytes | None = None, hint: list[Node] = ()) -> int:
        """Insert the first `n_full` blocks of valid arguments (the guard held by the caller).
        With `by_block`, the caller vouches that `blocks[i]` holds chunk i, so a block
        already cached under the current node is followed without comparing its tokens,
        and `hint` may name the nodes of `blocks[:len(hint)]` as a walk found them (a
        sequence's matched prefix): taken without a walk while the last of them still
        holds its block (a device node's ancestors are device nodes with their blocks,
        and a block the caller holds is never evicted), else ignored.
        `packed`: the tokens' int64 bytes when the caller has them (else packed here, the
        new part only)."""
        tiering = self._check_tier()
        bs, tree = self._block_size, self._tree
        root_key = adapter_id if keys is None else keys.root_key
        root = tree.roots.get(root_key)
        node, path, data, base = root, [], packed, 0
        if root is not None:
            k = len(hint)
            if by_block and 0 < k <= n_full and self._by_block.get(blocks[k - 1]) is hint[k - 1]:
                node, path, data, base = tree.follow(hint[-1], tokens, blocks, n_full, by_block, keys, packed, hint)
            else:
                node, path, data, base = tree.follow(root, tokens, blocks, n_full, by_block, keys, packed)
        first_new = len(path)
        path, adopt, adopt_disk = tiering.split(path) if tiering is not None else (path, [], [])
        adopt += adopt_disk  # host and disk-only nodes on the way: adopted into the caller's blocks
        index = self._by_block
        new_blocks = blocks[first_new - len(adopt) : n_full]
        if len(set(new_blocks)) != len(new_blocks):
            raise ValueError(f"insert given a block twice: {new_blocks}")
        if not index.keys().isdisjoint(new_blocks):
            block = next(b for b in new_blocks if b in index)
            raise ValueError(f"block {block} is already cached for other tokens")
        try:
            self._cache.inc_refs(new_blocks)  # checks every block is held before any count changes
        except RefCountError as err:
            raise RefCountError(f"insert of a free block: the caller must hold every block it inserts ({err})") from None
        if root is None:
            root = node = tree.root(root_key)
        if adopt:
            tiering.to_device(adopt, new_blocks[: len(adopt)])
            path += adopt
        if path:
            self._policy.touch_chain(path)
        events = self._events
        if adopt and events.consumer is not None:
            events.emit(stored(adopt, tokens[(first_new - len(adopt)) * bs : first_new * bs], new_blocks[: len(adopt)], bs,
                               digest=events.digest))
        new_blocks = new_blocks[len(adopt):]
        if not new_blocks:
            return len(adopt)
        if data is None:
            base = first_new
            data = int64_bytes(tokens[base * bs : n_full * bs])  # one array for the run, not one per block
        made = tree.extend(node, data, first_new - base, new_blocks, keys, base)
        self._policy.touch(made)
        if events.consumer is not None:
            events.emit(stored(made, tokens[first_new * bs : n_full * bs], new_blocks, bs, digest=events.digest))
        return len(adopt) + len(new_blocks)
