"""HybridKvTransfer: a hybrid cache's blocks and state slots written into another engine's
hybrid cache over NIXL, one `KvTransfer` per group.

Group g's agent is named `"<name>#g<g>"` and registers that group's pools: an attention
group's K and V pools (its own layout, checked as `KvTransfer.connect` checks it, TP and
block-layout mapping included: an attention group moves between TP sizes and NHD/HND split
or gathered by head), a state group's slot pools (rows that move whole: the peer must hold
the same state tensors). `metadata()` bundles every group's with the grouping
(pagedkv.tiers.hybrid_grouping: kinds, layers, windows, block sizes, state tensors);
`connect` loads a peer's, which must group its layers the same way, all or nothing.

Across TP sizes a state group's slots are replicated: pagedkv does not know a state
tensor's head dimension, so it never splits one. Every rank holds the whole state (same
shapes and dtypes, or `connect` refuses naming the row and field), and a receiving rank
takes it from one sending rank only (`head_plan.replica_sender`: the rank holding its first
head); `groups_to(peer)` / `groups_from(peer)` say which groups move between two ranks.
An engine that shards its recurrent state by head must use per-rank state shapes at equal
TP sizes (then rank r sends to rank r).

`send(peer, {g: src}, {g: dst}, notify)` checks every group's pairs (KvTransfer's checks)
before any group posts, then posts one NIXL request per group named in it. The peer's
`notifications()` gives `(peer, notify)` once every group of that send has landed: each
request carries a frame (`FRAME_MAGIC`, the sender's instance nonce, the send's number, its
group count, then `notify`; pagedkv.tiers.hybrid_wire) and the receiver collects the groups
seen per (peer, nonce, number): a repeated frame counts once, a restarted sender (a new
nonce) never completes an old send, and a peer's partial sends are dropped at `disconnect`.
Pull mode (`export` / `pull`, pagedkv.tiers.hybrid_pull) and grants (`grant` /
`send(..., grant=)`, pagedkv.tiers.hybrid_grants) work over every group at once; `allow`,
`token`, `max_peers` and `require_grants` are KvTransfer's, applied to every group's agent
(an allowed peer name covers its `#g<g>` agents).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Iterable, Mapping

from ..cache.hybrid_cache import HybridKvCache
from ..core.log import get_logger
from ..errors import KvCacheError
from . import transfer_metadata
from .hybrid_grants import HybridGrantMode
from .hybrid_grouping import grouping_differences, grouping_of
from .hybrid_pull import HybridPullMode, agent_name as _agent_name
from .hybrid_wire import FRAME_MAGIC, frame, parse_frame  # noqa: F401 - FRAME_MAGIC re-exported
from .transfer import DEFAULT_MAX_PEERS, KvTransfer, LayoutMismatch, TransferHandle, poll_notifications
from .transfer_errors import UnknownPeer
from .transfer_grants import GrantViolation
from .transfer_metadata import BadPeerMetadata

_log = get_logger("transfer")

MAX_GROUPS = 64
"""A hybrid metadata blob bundles at most this many groups' blobs."""

POSTED_WAIT_S = 30.0
"""How long a failed `send` waits for the groups it had already posted before it raises."""

METADATA_MAGIC = b"pagedkv-hybrid-kvtransfer\x00"
"""The first bytes of every `HybridKvTransfer.metadata()` blob."""


class HybridTransferHandle:
    """One hybrid `send` (or `pull`) in flight: a `TransferHandle` (`PullHandle`) per group
    it names; `done` / `wait` raise the first group's error (TransferError, LeaseExpired)."""

    def __init__(self, handles: dict[int, Any]):
        self.handles = handles
        """{group: TransferHandle}."""

    @property
    def nbytes(self) -> int:
        """Bytes the send moves over every group."""
        return sum(h.nbytes for h in self.handles.values())

    def done(self) -> bool:
        """True once every group's request is complete (never blocks)."""
        return all(h.done() for h in self.handles.values())

    def wait(self, timeout: float | None = None) -> None:
        """Block until every group's bytes are written at the peer (TransferTimeout past
        `timeout` seconds over all of them)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in self.handles.values():
            handle.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))


class HybridKvTransfer(HybridPullMode, HybridGrantMode):
    """A KvTransfer per group of `cache` (a `HybridKvCache`) on `gpu`, agents named after
    `name`; see the module docstring. All or nothing: a failed agent closes those made.
    `clock` dates pull leases (every group's), `require_grants=True` makes every write into
    every group need a grant (`grant`)."""

    def __init__(self, cache: HybridKvCache, gpu: Any, name: str, backends: Iterable[str] = ("UCX",),
                 clock: Callable[[], float] = time.time, *, allow: Iterable[str] | None = None,
                 token: bytes | None = None, max_peers: int = DEFAULT_MAX_PEERS, require_grants: bool = False):
        if not isinstance(cache, HybridKvCache):
            raise TypeError(f"cache must be a HybridKvCache (a config with layer_groups), got {type(cache).__name__}; "
                            f"use KvTransfer for a one-group cache")
        if not isinstance(name, str) or not name or "\x00" in name or "#" in name:
            raise ValueError(f"name must be a non-empty str without NUL or '#', got {name!r}")
        self.name = name
        """This engine's name, as peers see it (its agents add `#g<group>`)."""
        self._cache = cache
        self._parts: list[KvTransfer] = []
        self._peers: dict[str, None] = {}
        self._sends = 0
        self._nonce = os.urandom(8)  # tells this instance's sends from an earlier one's of the same name
        self._arrived: dict[tuple[str, bytes, int], list] = {}  # (peer, nonce, number) -> [groups seen, of, notify]
        self._ready: list[tuple[str, bytes]] = []  # complete messages held back by a grant violation
        self._grouping = grouping_of(cache)
        if allow is not None and (isinstance(allow, (str, bytes)) or not hasattr(allow, "__iter__")):
            raise TypeError(f"allow must be a collection of peer names, got {allow!r:.60}")
        allowed = None if allow is None else list(allow)
        try:
            backends = list(backends)
            for g in range(cache.num_groups()):
                part_allow = None if allowed is None else [_agent_name(a, g) if isinstance(a, str) else a for a in allowed]
                self._parts.append(KvTransfer(cache.group(g), gpu, _agent_name(name, g), backends, clock,
                                              allow=part_allow, token=token, max_peers=max_peers,
                                              require_grants=require_grants))
        except BaseException:
            self._close_parts()
            raise

    def group(self, g: int) -> KvTransfer:
        """Group `g`'s KvTransfer."""
        return self._parts[self._cache.layout().check_group(g)]

    # -- setup ----------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """Every group's `KvTransfer.metadata()` and the grouping, bundled, for a peer's `connect`."""
        blobs = [part.metadata() for part in self._parts]
        head = json.dumps({"name": self.name, "sizes": [len(b) for b in blobs], "groups": self._grouping,
                           "tp_size": self._cache.config().tp_size}).encode()
        return METADATA_MAGIC + len(head).to_bytes(8, "little") + head + b"".join(blobs)

    def connect(self, peer_metadata: bytes) -> str:
        """Connect every group to the peer's same group and return the peer's name. The
        peer must group its layers the same way (LayoutMismatch naming every `group g field`
        that differs, before any group connects: kind, layers, window, block size, state
        tensors); each group's layout is then checked by its KvTransfer (LayoutMismatch
        naming the group's differences; TP placement and NHD/HND may differ). All or nothing."""
        name, blobs, grouping, tp_size = self._parse(peer_metadata)
        if name in self._peers:
            raise ValueError(f"peer {name!r} is already connected (disconnect it first)")
        if len(blobs) != len(self._parts):
            raise KvCacheError(f"peer {name!r} has {len(blobs)} groups, this cache {len(self._parts)}")
        diffs = grouping_differences(self._grouping, grouping, (self._cache.config().tp_size, tp_size))
        if diffs:
            raise LayoutMismatch(f"peer {name!r} groups its layers otherwise: " + "; ".join(diffs))
        done: list[tuple[KvTransfer, str]] = []
        try:
            for g, (part, blob) in enumerate(zip(self._parts, blobs)):
                try:
                    got = part.connect(blob)
                except Exception as err:
                    raise type(err)(f"group {g}: {err}") from err
                done.append((part, got))  # disconnected by the name it connected, whatever that is
                if got != _agent_name(name, g):
                    raise ValueError(f"peer {name!r} group {g} metadata names agent {got!r}")
        except BaseException:
            for part, got in done:
                try:
                    part.disconnect(got)
                except Exception as err:  # noqa: BLE001 - the connect's own error is the one raised
                    _log.warning("hybrid_transfer_rollback_failed", peer=got, error=str(err))
            raise
        self._peers[name] = None
        return name

    def _parse(self, blob: object) -> tuple[str, list[bytes], object, object]:
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"peer_metadata must be bytes from HybridKvTransfer.metadata(), got {type(blob).__name__}")
        blob = bytes(blob)
        at = len(METADATA_MAGIC)
        if not blob.startswith(METADATA_MAGIC) or len(blob) < at + 8:
            raise BadPeerMetadata(f"peer_metadata is not HybridKvTransfer metadata (starts {blob[:24]!r})")
        size = int.from_bytes(blob[at : at + 8], "little")
        if size > transfer_metadata.MAX_JSON_BYTES or at + 8 + size > len(blob):
            raise BadPeerMetadata(f"peer_metadata declares a {size}-byte header, over the bound of "
                                  f"{transfer_metadata.MAX_JSON_BYTES} or past the blob's {len(blob)} bytes")
        text = blob[at + 8 : at + 8 + size]
        if transfer_metadata.json_depth(text) > 6:
            raise BadPeerMetadata("peer_metadata's header nests deeper than {name, sizes, groups: [{state: [[[shape], dtype]]}]}")
        try:
            head = json.loads(text)
        except ValueError as err:
            raise BadPeerMetadata(f"peer_metadata has a broken header: {err}") from None
        if type(head) is not dict:
            raise BadPeerMetadata(f"peer_metadata's header must be an object, got {type(head).__name__}")
        name = transfer_metadata.str_field(head.get("name"), "name")
        sizes = head.get("sizes")
        if (type(sizes) is not list or not 1 <= len(sizes) <= MAX_GROUPS
                or any(type(n) is not int or n < 0 for n in sizes)):
            raise BadPeerMetadata(f"peer_metadata field sizes must be a list of 1 to {MAX_GROUPS} ints >= 0, "
                                  f"got {sizes!r:.80}")
        if name == self.name:
            raise ValueError(f"peer metadata names this engine itself ({name!r})")
        at += 8 + size
        if sum(sizes) != len(blob) - at:
            raise BadPeerMetadata(f"peer_metadata of {name!r} is truncated: its groups need {sum(sizes)} bytes, "
                                  f"{len(blob) - at} follow")
        blobs = []
        for n in sizes:
            blobs.append(blob[at : at + n])
            at += n
        return name, blobs, head.get("groups"), head.get("tp_size")

    def peers(self) -> list[str]:
        """The names of the connected peers."""
        return list(self._peers)

    def disconnect(self, peer: str) -> None:
        """Forget a connected peer in every group (UnknownPeer otherwise)."""
        self._peer(peer)
        for g, part in enumerate(self._parts):
            part.disconnect(_agent_name(peer, g))
        del self._peers[peer]
        for key in [k for k in self._arrived if k[0] == peer]:  # its partial sends never complete now
            del self._arrived[key]

    def _peer(self, peer: object) -> str:
        if not isinstance(peer, str) or peer not in self._peers:
            known = ", ".join(map(repr, self._peers)) or "none"
            raise UnknownPeer(f"unknown peer {peer!r} (connected: {known}); connect(peer_metadata) first")
        return peer

    # -- transfers ------------------------------------------------------------------------

    def groups_to(self, peer: str) -> list[int]:
        """The groups a `send` to `peer` can move: every group whose heads (slots) this rank
        holds for the peer's rank (a state group across TP sizes: only from the one rank
        that sends its replicated slots)."""
        self._peer(peer)
        return [g for g, part in enumerate(self._parts)
                if any(plan[4].shape[0] for plan in part._peer(_agent_name(peer, g)).send_plans)]

    def groups_from(self, peer: str) -> list[int]:
        """The groups a `pull` from `peer` can read (as `groups_to`, the other way)."""
        self._peer(peer)
        return [g for g, part in enumerate(self._parts)
                if any(plan[4].shape[0] for plan in part._peer(_agent_name(peer, g)).pull_plans)]

    def _groups_of(self, ids: object, what: str) -> list[int]:
        """The sorted groups of a {group: ids} mapping; TypeError / IndexError / ValueError."""
        if not isinstance(ids, Mapping):
            raise TypeError(f"{what} must be a mapping {{group: [block or slot ids]}}, got {type(ids).__name__}")
        groups = sorted({self._cache.layout().check_group(g) for g in ids})
        if not groups:
            raise ValueError(f"{what} names no group: nothing to move")
        return groups

    def _next_frame(self, count: int, notify: bytes) -> bytes:
        number = self._sends
        self._sends += 1
        return frame(self._nonce, number, count, bytes(notify))

    def _handle(self, handles: dict) -> HybridTransferHandle:
        return HybridTransferHandle(handles)

    def _settle(self, handles: dict, peer: str) -> None:
        """Wait (bounded) for the groups already posted of a send or pull that failed."""
        for posted_g, posted in handles.items():  # bounded: a dead peer must not hide the error
            try:
                posted.wait(POSTED_WAIT_S)
            except Exception as other:  # noqa: BLE001 - the post's own error is the one raised
                _log.warning("hybrid_transfer_posted_group_failed", peer=peer, group=posted_g,
                             error=f"{type(other).__name__}: {other}")

    def send(self, peer: str, src: Mapping[int, Any], dst: Mapping[int, Any], notify: bytes = b"",
             grant: bytes | None = None) -> HybridTransferHandle:
        """Write blocks (slots) `src[g]` of every group named into the peer's `dst[g]`, one
        NIXL request per group; the peer's `notifications()` gives `(this name, notify)` once
        all of them have landed. Every group's checks (KvTransfer.send's, a pair of ranks
        with nothing to move in a group included: see `groups_to`) run before any group
        posts. `grant` is the peer's `grant` ticket: refused before anything is sent when it
        is another receiver's or sender's, covers other groups than the send, or a
        destination is outside its group's part (naming the group and the block). Work the
        caller enqueued on the sources must be complete. A TransferError posting a later
        group (NIXL refused it) comes after the groups already posted have completed: their
        bytes are written, and the peer never completes that message."""
        self._peer(peer)
        if not isinstance(src, Mapping) or not isinstance(dst, Mapping):
            raise TypeError("src and dst must be mappings {group: [block or slot ids]}")
        groups = sorted({self._cache.layout().check_group(g) for g in src})
        if groups != sorted({self._cache.layout().check_group(g) for g in dst}):
            raise ValueError(f"src names groups {sorted(src)} but dst names {sorted(dst)}")
        if not groups:
            raise ValueError("the send names no group: nothing to send")
        if not isinstance(notify, (bytes, bytearray)):
            raise TypeError(f"notify must be bytes, got {type(notify).__name__}")
        grants = self._grant_parts(peer, groups, grant)
        for g in groups:
            try:
                self._parts[g].checked_send(_agent_name(peer, g), src[g], dst[g], grant=grants[g])
            except Exception as err:
                raise type(err)(f"group {g}: {err}") from err
        message = self._next_frame(len(groups), notify)
        handles: dict[int, TransferHandle] = {}
        for g in groups:  # a failure after the first post is a TransferError: the others are waited on first
            try:
                handles[g] = self._parts[g].send(_agent_name(peer, g), src[g], dst[g], message, grant=grants[g])
            except BaseException:
                self._settle(handles, peer)
                raise
        return HybridTransferHandle(handles)

    def notifications(self) -> list[tuple[str, bytes]]:
        """Every (peer name, notify) whose send (or pull) completed in all its groups since
        the last call; messages that are not a hybrid frame come through as (agent,
        message). Every group's expired leases are released. A group's GrantViolation is
        raised after every group was read, naming each; the complete messages stay queued
        for the next call."""
        out, self._ready = self._ready, []
        violations = []
        for g, part in enumerate(self._parts):
            try:
                got = part.notifications()
            except GrantViolation as err:
                violations.append(f"group {g}: {err}")
                try:
                    got = part.notifications()  # its other messages, queued by the violating call
                except GrantViolation as again:  # more arrived meanwhile: the rest stay queued there
                    violations.append(f"group {g}: {again}")
                    got = []
            for agent, message in got:
                parsed = parse_frame(message, len(self._parts))
                if parsed is None or not agent.endswith(f"#g{g}"):
                    out.append((agent, message))  # not a hybrid send's frame (or not one for this group)
                    continue
                nonce, number, count, user = parsed
                key = (agent[: -len(f"#g{g}")], nonce, number)
                seen = self._arrived.setdefault(key, [set(), count, user])
                seen[0].add(g)  # a repeated frame of a group counts once
                if len(seen[0]) == seen[1]:
                    del self._arrived[key]
                    out.append((key[0], seen[2]))
        if violations:
            self._ready = out
            raise GrantViolation("; ".join(violations))
        return out

    def wait_notifications(self, timeout: float) -> list[tuple[str, bytes]]:
        """`notifications()` once at least one is complete; TransferTimeout past `timeout`
        seconds (a finite number >= 0: ValueError for NaN or an infinity)."""
        return poll_notifications(self.notifications, timeout, f"{self.name!r}: no complete notification")

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Close every group's KvTransfer (each attempted, the first error raised)."""
        self._close_parts()

    def _close_parts(self) -> None:
        first = None
        for part in self._parts:
            try:
                part.close()
            except Exception as err:  # noqa: BLE001 - every agent attempted
                first = first or err
        if first is not None:
            raise first

    def __enter__(self) -> "HybridKvTransfer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
