"""HybridKvTransfer: a hybrid cache's blocks and state slots written into another engine's
hybrid cache over NIXL, one `KvTransfer` per group.

Group g's agent is named `"<name>#g<g>"` and registers that group's pools: an attention
group's K and V pools (its own layout, checked as `KvTransfer.connect` checks it, TP and
block-layout mapping included), a state group's slot pools (rows that move whole: the peer
must hold the same state tensors). `metadata()` bundles every group's; `connect` loads a
peer's, which must have the same groups in the same order, all or nothing.

`send(peer, {g: src}, {g: dst}, notify)` checks every group's pairs (KvTransfer's checks)
before any group posts, then posts one NIXL request per group named in it. The peer's
`notifications()` gives `(peer, notify)` once every group of that send has landed: each
request carries a frame (`FRAME_MAGIC`, the send's number, its group count, then `notify`)
and the receiver counts the frames of each send. There is no pull mode (leases) here.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterable, Mapping

from ..cache.hybrid_cache import HybridKvCache
from ..errors import KvCacheError
from .transfer import KvTransfer, TransferHandle
from .transfer_errors import TransferTimeout, UnknownPeer

METADATA_MAGIC = b"pagedkv-hybrid-kvtransfer\x00"
"""The first bytes of every `HybridKvTransfer.metadata()` blob."""

FRAME_MAGIC = b"pagedkv-hybrid-send\x00"
"""The first bytes of the notify message each group's request of a hybrid send carries."""


def _agent_name(name: str, g: int) -> str:
    return f"{name}#g{g}"


class HybridTransferHandle:
    """One hybrid `send` in flight: a `TransferHandle` per group it names."""

    def __init__(self, handles: dict[int, TransferHandle]):
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


class HybridKvTransfer:
    """A KvTransfer per group of `cache` (a `HybridKvCache`) on `gpu`, agents named after
    `name`; see the module docstring. All or nothing: a failed agent closes those made."""

    def __init__(self, cache: HybridKvCache, gpu: Any, name: str, backends: Iterable[str] = ("UCX",)):
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
        self._arrived: dict[tuple[str, int], list] = {}  # (peer, send number) -> [frames seen, of, notify]
        try:
            backends = list(backends)
            for g in range(cache.num_groups()):
                self._parts.append(KvTransfer(cache.group(g), gpu, _agent_name(name, g), backends))
        except BaseException:
            self._close_parts()
            raise

    def group(self, g: int) -> KvTransfer:
        """Group `g`'s KvTransfer."""
        return self._parts[self._cache.layout().check_group(g)]

    # -- setup ----------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """Every group's `KvTransfer.metadata()`, bundled, for a peer's `connect`."""
        blobs = [part.metadata() for part in self._parts]
        head = json.dumps({"name": self.name, "sizes": [len(b) for b in blobs]}).encode()
        return METADATA_MAGIC + len(head).to_bytes(8, "little") + head + b"".join(blobs)

    def connect(self, peer_metadata: bytes) -> str:
        """Connect every group to the peer's same group and return the peer's name. The
        peer must have as many groups; each group's layout is checked by its KvTransfer
        (LayoutMismatch naming the group's differences). All or nothing."""
        name, blobs = self._parse(peer_metadata)
        if name in self._peers:
            raise ValueError(f"peer {name!r} is already connected (disconnect it first)")
        if len(blobs) != len(self._parts):
            raise KvCacheError(f"peer {name!r} has {len(blobs)} groups, this cache {len(self._parts)}")
        done: list[KvTransfer] = []
        try:
            for g, (part, blob) in enumerate(zip(self._parts, blobs)):
                try:
                    got = part.connect(blob)
                except Exception as err:
                    raise type(err)(f"group {g}: {err}") from err
                done.append(part)
                if got != _agent_name(name, g):
                    raise ValueError(f"peer {name!r} group {g} metadata names agent {got!r}")
        except BaseException:
            for g, part in enumerate(done):
                part.disconnect(_agent_name(name, g))
            raise
        self._peers[name] = None
        return name

    def _parse(self, blob: object) -> tuple[str, list[bytes]]:
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"peer_metadata must be bytes from HybridKvTransfer.metadata(), got {type(blob).__name__}")
        blob = bytes(blob)
        at = len(METADATA_MAGIC)
        if not blob.startswith(METADATA_MAGIC) or len(blob) < at + 8:
            raise ValueError(f"peer_metadata is not HybridKvTransfer metadata (starts {blob[:24]!r})")
        size = int.from_bytes(blob[at : at + 8], "little")
        try:
            head = json.loads(blob[at + 8 : at + 8 + size])
            name, sizes = str(head["name"]), [int(n) for n in head["sizes"]]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"peer_metadata has a broken header: {err}") from None
        if name == self.name:
            raise ValueError(f"peer metadata names this engine itself ({name!r})")
        at += 8 + size
        if sum(sizes) != len(blob) - at:
            raise ValueError(f"peer_metadata of {name!r} is truncated")
        blobs = []
        for n in sizes:
            blobs.append(blob[at : at + n])
            at += n
        return name, blobs

    def peers(self) -> list[str]:
        """The names of the connected peers."""
        return list(self._peers)

    def disconnect(self, peer: str) -> None:
        """Forget a connected peer in every group (UnknownPeer otherwise)."""
        self._peer(peer)
        for g, part in enumerate(self._parts):
            part.disconnect(_agent_name(peer, g))
        del self._peers[peer]

    def _peer(self, peer: object) -> str:
        if not isinstance(peer, str) or peer not in self._peers:
            known = ", ".join(map(repr, self._peers)) or "none"
            raise UnknownPeer(f"unknown peer {peer!r} (connected: {known}); connect(peer_metadata) first")
        return peer

    # -- transfers ------------------------------------------------------------------------

    def send(self, peer: str, src: Mapping[int, Any], dst: Mapping[int, Any], notify: bytes = b"") -> HybridTransferHandle:
        """Write blocks (slots) `src[g]` of every group named into the peer's `dst[g]`, one
        NIXL request per group; the peer's `notifications()` gives `(this name, notify)` once
        all of them have landed. Every group's checks (KvTransfer.send's) run before any
        group posts. Work the caller enqueued on the sources must be complete. A TransferError
        posting a later group (NIXL refused it) comes after the groups already posted have
        completed: their bytes are written, and the peer never completes that message."""
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
        for g in groups:
            try:
                self._parts[g].checked_send(_agent_name(peer, g), src[g], dst[g])
            except Exception as err:
                raise type(err)(f"group {g}: {err}") from err
        number = self._sends
        self._sends += 1
        frame = FRAME_MAGIC + number.to_bytes(8, "little") + len(groups).to_bytes(4, "little") + bytes(notify)
        handles: dict[int, TransferHandle] = {}
        for g in groups:  # a failure after the first post is a TransferError: the others are waited on first
            try:
                handles[g] = self._parts[g].send(_agent_name(peer, g), src[g], dst[g], frame)
            except BaseException:
                for posted in handles.values():
                    posted.wait(None)
                raise
        return HybridTransferHandle(handles)

    def notifications(self) -> list[tuple[str, bytes]]:
        """Every (peer name, notify) whose send landed in all its groups since the last
        call; messages that are not a hybrid send's frame come through as (agent, message)."""
        out = []
        for part in self._parts:
            for agent, message in part.notifications():
                if not message.startswith(FRAME_MAGIC) or "#g" not in agent:
                    out.append((agent, message))
                    continue
                peer = agent.rsplit("#g", 1)[0]
                body = message[len(FRAME_MAGIC):]
                number, count = int.from_bytes(body[:8], "little"), int.from_bytes(body[8:12], "little")
                seen = self._arrived.setdefault((peer, number), [0, count, body[12:]])
                seen[0] += 1
                if seen[0] == seen[1]:
                    del self._arrived[(peer, number)]
                    out.append((peer, seen[2]))
        return out

    def wait_notifications(self, timeout: float) -> list[tuple[str, bytes]]:
        """`notifications()` once at least one is complete; TransferTimeout past `timeout` s."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        deadline, pause = time.monotonic() + timeout, 1e-5
        while True:
            got = self.notifications()
            if got:
                return got
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"{self.name!r}: no complete notification arrived within {timeout} s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

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
