"""What `HybridPrefixCache` reports: its events (`GroupBlockStored`, `GroupBlockRemoved`, as
vLLM's KV events carry them) and the hashes in them (the chained 64-bit hash of a trie node,
or vLLM's digest at a group's block size with the extra keys where vLLM places them), built
and queued by the `HybridEvents` mixin.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Sequence

from ..core.guard import guarded
from .vllm_hash import block_digest

if TYPE_CHECKING:
    from .hybrid_store import _Node


SPEC_KINDS = {"full": "full_attention", "sliding": "sliding_window", "state": "mamba"}
"""A group kind as vLLM's KV events name it (`kv_cache_spec_kind`)."""


@dataclass(frozen=True)
class GroupBlockStored:
    """An entry newly cached: `block_id` (a block, or a state slot) of `group`, ending at token
    `position` of the chain whose unit hash there is `block_hash`.

    What a router needs besides (vLLM's `BlockStored` fields; the wire format sends it as
    one): `token_ids`, the `block_size` tokens the entry ends (an attention group's block;
    a state group's last unit, `[position - unit, position)`), `parent_block_hash`, the
    unit hash where those tokens start (None at the chain's start), `medium`, the group's
    `kv_cache_spec_kind` ("full_attention", "sliding_window", "mamba") and a sliding
    group's window in tokens, `seq`, the event's number in its prefix cache, and
    `extra_keys`, the entry's extra keys where vLLM places them (its units' keys, then the
    cache salt on a prompt's first block; None when none)."""

    group: int
    block_id: int
    position: int
    block_hash: int | bytes
    adapter_id: int
    kind: str = "stored"
    token_ids: tuple = ()
    parent_block_hash: int | None = None
    block_size: int = 0
    medium: str = "GPU"
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    seq: int = field(default=0, compare=False)
    extra_keys: tuple | None = None

    @property
    def group_idx(self) -> int:
        """`group` (the name vLLM's events give it)."""
        return self.group


@dataclass(frozen=True)
class GroupBlockRemoved:
    """An entry evicted (or dropped by `clear`): `block_id` of `group` is free again; `seq`
    is the event's number in its prefix cache."""

    group: int
    block_id: int
    block_hash: int | bytes
    kind: str = "removed"
    medium: str = "GPU"
    seq: int = field(default=0, compare=False)

    @property
    def group_idx(self) -> int:
        """`group` (the name vLLM's events give it)."""
        return self.group



class HybridEvents:
    """Mixed into `HybridPrefixCache` (it sets `_events`, `_vroot`, `_hash_scheme`, `_groups`,
    `_layout`, `_unit`, `_where`): the events' building, queueing and delivery, and the hashes
    they report."""

    def deliver_events(self) -> None:
        """Deliver queued events now."""
        if self._events.consumer is None:
            self._events.pending.clear()
            return
        self._events.deliver()

    _deliver = deliver_events

    def _emit(self, event) -> None:
        if self._events.consumer is not None:
            self._events.emit(event)

    def hash_scheme(self) -> str:
        """The scheme `block_hash` and events use ("pagedkv-blake2b-64" or "vllm-sha256-cbor")."""
        return self._hash_scheme

    def _hash_at(self, g: int, node: _Node):
        """The hash events report for group g's entry on `node`: the node's chained 64-bit
        hash, or vLLM's digest at the group's block size."""
        if self._vroot is None:
            return node.hash
        group = self._groups[g]
        return self._digest(node, self._layout.block_size(g) if group.is_attention() else self._unit)

    def _digest(self, node: _Node, span: int) -> bytes:
        """vLLM's digest of the block of `span` tokens ending at `node` (a multiple of the
        unit), chained over the blocks of that size before it; kept on the nodes."""
        r, u = span // self._unit, self._unit
        chain = []
        while node.depth and (node.digests is None or span not in node.digests):
            chain.append(node)
            for _ in range(r):
                node = node.parent
        parent = self._vroot if not node.depth else node.digests[span]
        for end in reversed(chain):
            units, n = [], end
            for _ in range(r):
                units.append(n)
                n = n.parent
            units.reverse()
            tokens = [int.from_bytes(x.key[i:i + 8], "little") for x in units for i in range(0, 8 * u, 8)]
            if end.digests is None:
                end.digests = {}
            end.digests[span] = parent = block_digest(parent, tokens, self._extra_of(end, span))
        return parent

    def _extra_of(self, end: _Node, span: int) -> tuple | None:
        """The extra keys of the block of `span` tokens ending at `end` as vLLM places them:
        its units' keys in position order, each once, then the salt on a salted prompt's
        first block; None when there are none."""
        units, n = [], end
        for _ in range(span // self._unit):
            units.append(n)
            n = n.parent
        extra = tuple(dict.fromkeys(k for x in reversed(units) for k in x.extra))
        if n.parent is None and n.extra:  # the prompt's first block of a salted root: the salt last
            extra += n.extra
        return extra or None

    @guarded
    def block_hash(self, group: int, entry: int) -> int | bytes:
        """The hash of cached entry `entry` of `group` (its events' `block_hash`): the 64-bit
        chained hash, or under "vllm-sha256-cbor" the 32-byte digest. KeyError when not cached."""
        g = self._layout.check_group(group)
        node = self._where[g].get(entry)
        if node is None:
            raise KeyError(f"entry {entry!r} of group {g} is not cached")
        return self._hash_at(g, node)

    def _stored_event(self, g: int, entry: int, pos: int, path: list, tokens: Sequence[int],
                      adapter_id: int) -> GroupBlockStored:
        """The event of group g's entry `entry` ending at `pos` on `path` (the chain's nodes)."""
        group, u = self._groups[g], self._unit
        span = self._layout.block_size(g) if group.is_attention() else u
        start = pos - span
        return GroupBlockStored(
            g, entry, pos, self._hash_at(g, path[pos // u - 1]), adapter_id,
            token_ids=tuple(int(t) for t in tokens[start:pos]),
            parent_block_hash=self._hash_at(g, path[start // u - 1]) if start > 0 else None,
            block_size=span,
            kv_cache_spec_kind=SPEC_KINDS[group.kind],
            kv_cache_spec_sliding_window=group.window if group.kind == "sliding" else None,
            extra_keys=self._extra_of(path[pos // u - 1], span),
        )

    def _removed_event(self, g: int, entry: int, node: _Node, medium: str = "GPU") -> GroupBlockRemoved:
        """The event of group g's entry `entry` (a device or host id) on `node` leaving `medium`."""
        return GroupBlockRemoved(g, entry, self._hash_at(g, node), medium=medium)

    def _node_stored_event(self, g: int, entry: int, node: _Node, medium: str) -> GroupBlockStored:
        """The stored event of group g's entry `entry` on `node`, now held in `medium`."""
        path, n = [], node
        while n.parent is not None:
            path.append(n)
            n = n.parent
        path.reverse()
        data = b"".join(x.key[: 8 * self._unit] for x in path)
        tokens = [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8)]
        event = self._stored_event(g, entry, node.depth * self._unit, path, tokens, node.adapter_id)
        return replace(event, medium=medium)
