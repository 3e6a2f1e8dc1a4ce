"""The peers of `KvTransfer`: `connect` (a peer's metadata checked before anything is
loaded: allow-list and token, layout, pools), its NIXL connection loaded or reused under
`max_peers`, the peer's send and pull plans (`head_plan`), `disconnect` and the peer
queries; the records of a registered pool (`_Pool`, `_Slots`) and of a connected peer
(`_Peer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.log import get_logger
from . import head_plan
from . import transfer_metadata
from .transfer_errors import LayoutMismatch, PeerRefused, TransferError, UnknownPeer
from .transfer_layout import fingerprint, is_state_layout, layout_differences, layout_lies, pool_geometries
from .transfer_metadata import BadPeerMetadata

_log = get_logger("transfer")


@dataclass(frozen=True)
class _Pool:
    """One registered pool: its layer, side, address as NIXL sees it, and block stride."""

    layer: int
    side: str
    address: int
    stride: int


@dataclass(frozen=True)
class _Slots:
    """A state slot pool as `head_plan.descriptors` sees it: only its stride (slots move whole)."""

    stride: int


@dataclass(frozen=True)
class _Peer:
    """What `connect` learned about a peer: its pools, and per pool pair the plan of a
    block sent to it (`send_plans`) and read from it (`pull_plans`): (local base, remote
    base, local geometry, remote geometry, template)."""

    name: str
    num_blocks: int
    mem_type: str
    device_id: int
    pools: tuple
    tp_rank: int
    tp_size: int
    send_plans: tuple
    pull_plans: tuple
    info: dict



class PeerConnections:
    """Mixed into `KvTransfer` (it sets `name`, `_agent`, `_layout`, `_pools`, `_state`,
    `_peers`, `_loaded`, `_allow`, `_token`, `_max_peers`, and defines `fingerprint` and
    `_check_open`)."""

    def connect(self, peer_metadata: bytes) -> str:
        """Load a peer's `metadata()` and return its name. The blob is checked first, with
        nothing loaded: BadPeerMetadata (a ValueError) naming what is wrong in a blob that is
        not well-formed KvTransfer metadata (sizes bounded before any JSON work, nesting,
        every field's type, the NIXL part's length and digest: a truncated blob is refused
        and never spoils a later connect); PeerRefused for a peer the allow-list does not
        name or without the shared token's tag; ValueError for this agent's own name or a
        name already connected; LayoutMismatch listing every difference a transfer cannot
        map (formats, dims, strides, block size, window, global heads, ...; see
        `layout_differences`) or every place the peer's description contradicts itself or
        its pools (`layout_lies`). The block layout and TP placement may differ: blocks are
        then split or gathered by head. A peer connected before reuses its NIXL connection
        when its NIXL part is unchanged; TransferError when `max_peers` connections are
        loaded and every one is connected."""
        self._check_open()
        info, nixl_md = transfer_metadata.parse(peer_metadata)
        name = info["name"]
        if self._allow is not None or self._token is not None:
            named = self._allow is not None and name in self._allow
            tagged = self._token is not None and transfer_metadata.check_token(info, self._token)
            if not (named or tagged):
                how = " or ".join(w for w, on in (("named in allow", self._allow is not None),
                                                  ("tagged with the shared token", self._token is not None)) if on)
                raise PeerRefused(f"peer {name!r} is not {how}: refused before anything was loaded")
        if name == self.name:
            raise ValueError(f"peer metadata names this agent itself ({name!r})")
        if name in self._peers:
            raise ValueError(f"peer {name!r} is already connected (disconnect it first)")
        try:
            lies = layout_lies(info["layout"])
            if lies:
                raise LayoutMismatch(f"peer {name!r} describes a layout that contradicts itself: " + "; ".join(lies))
            diffs = layout_differences(self._layout, info["layout"])
            if diffs:
                raise LayoutMismatch(
                    f"peer {name!r} has another cache layout (fingerprint {fingerprint(info['layout'])}, "
                    f"here {self.fingerprint()}): " + "; ".join(diffs)
                )
            pools = self._peer_pools(name, info)
            peer = self._make_peer(name, info, pools)
        except (LayoutMismatch, BadPeerMetadata):
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError) as err:
            raise BadPeerMetadata(f"peer {name!r} metadata is inconsistent: {type(err).__name__}: {err}") from None
        self._load(name, nixl_md, info["nixl_digest"])
        self._peers[name] = peer
        _log.debug("kv_transfer_connected", name=self.name, peer=name, peer_blocks=info["num_blocks"])
        return name

    def _load(self, name: str, nixl_md: bytes, digest: str) -> None:
        """Make NIXL know the peer `name` by this NIXL part: reuse a connection loaded with
        the same part, else remove a stale one, make room under `max_peers`, and load."""
        loaded = self._loaded.pop(name, None)
        if loaded == digest:
            self._loaded[name] = digest  # reused: most recently used now
            return
        if loaded is not None:  # the peer restarted (another NIXL part): load it afresh
            self._remove_remote(name)
        if len(self._loaded) >= self._max_peers:
            idle = next((n for n in self._loaded if n not in self._peers), None)
            if idle is None:
                raise TransferError(f"connect of peer {name!r}: {len(self._loaded)} peers are connected, the bound "
                                    f"max_peers={self._max_peers}; disconnect one first")
            del self._loaded[idle]
            self._remove_remote(idle)
        try:
            got = self._agent.add_remote_agent(nixl_md)
        except Exception as err:
            self._remove_remote(name)  # whatever NIXL kept of a failed load must not block the next
            raise TransferError(f"loading peer {name!r} failed: {type(err).__name__}: {err}") from err
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got != name:
            self._remove_remote(got)
            raise BadPeerMetadata(f"peer metadata names {name!r} but its NIXL part names {got!r}")
        self._loaded[name] = digest

    def _remove_remote(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as err:  # noqa: BLE001 - not loaded, or already gone: nothing to keep
            _log.debug("kv_transfer_remove_remote", name=self.name, peer=name, error=f"{type(err).__name__}: {err}")

    def _peer_pools(self, name: str, info: dict) -> tuple:
        """The peer's pools, which must be the (layer, side, stride) its layout describes, in order."""
        try:
            pools = tuple(_Pool(int(l), str(s), int(a), int(st)) for l, s, a, st in info["pools"])
        except (KeyError, TypeError, ValueError) as err:
            raise BadPeerMetadata(f"peer {name!r} metadata has a broken pool list: {err!r}") from None
        layout = info["layout"]
        described = []
        if is_state_layout(layout):
            described = [(row["layer"], f"S{row['tensor']}", row["stride"]) for row in layout["rows"]]
        for layer, entry in enumerate(layout.get("layers", [])):
            described.append((layer, "K", entry["k_stride"]))
            if not layout["v_aliases_k"]:
                described.append((layer, "V", entry["v_stride"]))
        if [(p.layer, p.side, p.stride) for p in pools] != described:
            raise BadPeerMetadata(f"peer {name!r} metadata lists {len(pools)} pools that do not match its layout")
        return pools

    def _make_peer(self, name: str, info: dict, pools: tuple) -> _Peer:
        """The peer with its send and pull plans (pagedkv.tiers.head_plan)."""
        layout = info["layout"]
        rank, size = int(layout.get("tp_rank", 0)), int(layout.get("tp_size", 1))
        my_rank, my_size = self._layout["tp_rank"], self._layout["tp_size"]
        sends_replicas = my_rank == head_plan.replica_sender(rank, my_size, size)
        pulls_replicas = rank == head_plan.replica_sender(my_rank, size, my_size)
        if self._state:  # slots move whole (replicated across TP: one sending rank per receiver)
            def whole(on: bool, stride: int) -> np.ndarray:
                return np.array([[0, 0, stride]], np.int64) if on else np.zeros((0, 3), np.int64)

            plans = [(here.address, there.address, _Slots(here.stride), _Slots(there.stride),
                      whole(sends_replicas, here.stride)) for here, there in zip(self._pools, pools)]
            back = [(there.address, here.address, _Slots(there.stride), _Slots(here.stride),
                     whole(pulls_replicas, here.stride)) for here, there in zip(self._pools, pools)]
            return _Peer(name, int(info["num_blocks"]), str(info["mem_type"]), int(info["device_id"]), pools,
                         rank, size, tuple(plans), tuple(back), info)
        mine, theirs = pool_geometries(self._layout), pool_geometries(layout)
        send, pull = [], []
        for here, there, m, t in zip(self._pools, pools, mine, theirs):
            out = head_plan.block_template(m, t) if (sends_replicas or not m.replicated) else np.zeros((0, 3), np.int64)
            back = head_plan.block_template(t, m) if (pulls_replicas or not m.replicated) else np.zeros((0, 3), np.int64)
            send.append((here.address, there.address, m, t, out))
            pull.append((there.address, here.address, t, m, back))
        return _Peer(name, int(info["num_blocks"]), str(info["mem_type"]), int(info["device_id"]), pools,
                     rank, size, tuple(send), tuple(pull), info)

    def peers(self) -> list[str]:
        """The names of the connected peers."""
        return list(self._peers)

    def disconnect(self, peer: str) -> None:
        """Forget a connected peer (UnknownPeer otherwise); its in-flight sends stay waitable.
        Its NIXL connection stays loaded for a later `connect` of the same peer (up to
        `max_peers` loaded; `close` removes them)."""
        self._check_open()
        self._peer(peer)
        del self._peers[peer]

    def loaded_peers(self) -> list[str]:
        """The peers whose NIXL connections are loaded (connected or kept for reuse), least
        recently used first; at most `max_peers`."""
        return list(self._loaded)

    def _peer(self, peer: object) -> _Peer:
        found = self._peers.get(peer) if isinstance(peer, str) else None
        if found is None:
            known = ", ".join(map(repr, self._peers)) or "none"
            raise UnknownPeer(f"unknown peer {peer!r} (connected: {known}); connect(peer_metadata) first")
        return found
