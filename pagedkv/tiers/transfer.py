"""KvTransfer: KV blocks written from one engine's cache into another's over NIXL.

Each side wraps its own `PagedKvCache` in a `KvTransfer`, which registers every pool with a
NIXL agent (VRAM on a CUDA backend, DRAM on a host one). The sides swap `metadata()` out of
band (a socket, a file, the engine's control plane); `connect` checks that the peer's layout
is the same before any byte moves; `send` then writes every layer's K and V of some local
blocks into the peer's blocks, in one NIXL request, and the peer sees the `notify` message
in `notifications()` once the bytes have landed.

Worked example: a 2-layer cache whose K and V strides are 8192 bytes; `send(peer, [4, 5, 9],
[0, 1, 7])` merges the pairs into the runs (4->0, 2 blocks) and (9->7, 1 block), and writes
2 layers x 2 sides x 2 runs = 8 descriptors: layer 0 K `local_k0 + 4 * 8192, 16384 bytes ->
peer_k0 + 0 * 8192`, and so on.

The receiving blocks belong to the receiver: its owner allocates them (any ids) and tells
the sender which ones, out of band; nothing else about them is assumed. NIXL is imported
only when a KvTransfer is built (`import pagedkv.transfer` needs no NIXL); install it with
`pip install --no-deps nixl-cu13==1.5.1` (the wheel declares torch, which its Python API
does not import).
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from ..backends.capabilities import backend_supports, device_kind
from ..cache.hybrid_cache import HybridKvCache, StateGroup
from ..cache.paged_cache import PagedKvCache
from ..core.log import get_logger
from ..core.validate import positive_int, seconds
from ..errors import KvCacheError
from . import transfer_metadata
from . import head_plan
from . import leases as pull_leases
from .pull_mode import PullMode, blocks_of as _blocks
from .transfer_grants import GrantMode, GrantTable, GrantViolation, notify_prefix, parse_ticket
from .head_plan import block_runs  # noqa: F401 - re-exported: this module's API before head_plan
from .transfer_errors import (  # noqa: F401 - re-exported: the transfer API's errors
    LayoutMismatch,
    LeaseExpired,
    NixlUnavailable,
    TransferError,
    TransferTimeout,
    UnknownPeer,
)
from .transfer_metadata import METADATA_MAGIC, BadPeerMetadata  # noqa: F401 - re-exported
from .transfer_layout import (  # noqa: F401 - re-exported
    FORMATS_VERSION,
    LAYOUT_VERSION,
    fingerprint,
    is_state_layout,
    layout_differences,
    layout_lies,
    layout_of,
    pool_geometries,
    state_layout_of,
)

_log = get_logger("transfer")

INSTALL_HINT = "pip install --no-deps nixl-cu13==1.5.1"
"""How to install NIXL for KvTransfer (its wheel declares torch, which its Python API never imports)."""

DEFAULT_MAX_PEERS = 16
"""How many peers' NIXL connections a KvTransfer keeps loaded at once, by default. NIXL leaks
a file descriptor per load and remove of a remote agent (upstream), so a disconnected peer's
connection is kept and reused when it connects again; past the bound the least recently
used disconnected one is removed, and a connect with every loaded peer connected is refused."""

_LIVE_NAMES: set[str] = set()
"""The names of this process's open KvTransfer agents: a second agent of one name is refused."""


class PeerRefused(TransferError, PermissionError):
    """`connect` refused a peer that the allow-list does not name or whose metadata lacks the
    shared token's tag; nothing was loaded."""


_NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


def load_nixl() -> Any:
    """NIXL's `_api` module (`nixl`, else `nixl_cu13`, else `nixl_cu12`); NixlUnavailable
    saying how to install it when none imports. NIXL's own Python logger is set to WARNING
    unless NIXL_LOG_LEVEL asks for another level (it prints INFO lines on stdout otherwise)."""
    errors = []
    for name in _NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as err:
            errors.append(f"{name}: {err}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return module
    raise NixlUnavailable(
        f"KvTransfer needs NIXL's Python API; install it with `{INSTALL_HINT}` "
        f"(tried {'; '.join(errors)})"
    )


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


def poll_notifications(fetch: Callable[[], list], timeout: object, what: str) -> list:
    """`fetch()` polled (backing off from 10 us to 1 ms) until it returns a non-empty list;
    TransferTimeout "`what` arrived within `timeout` s" past `timeout` seconds (a finite
    number >= 0: ValueError for NaN, an infinity or a bool)."""
    timeout = seconds(timeout, "timeout")
    deadline, pause = time.monotonic() + timeout, 1e-5
    while True:
        got = fetch()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise TransferTimeout(f"{what} arrived within {timeout} s")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


class TransferHandle:
    """One `send` in flight. `wait(timeout)` blocks until its bytes are written at the peer;
    `done()` polls. Once complete (or failed) the NIXL request is released."""

    def __init__(self, owner: "KvTransfer", request: Any, peer: str, blocks: int, nbytes: int, descriptors: int):
        self._owner = owner
        self._request = request
        self.peer = peer
        """The peer the blocks go to."""
        self.blocks = blocks
        """How many blocks this transfer writes."""
        self.nbytes = nbytes
        """How many bytes this transfer writes (every layer, both sides)."""
        self.descriptors = descriptors
        """How many NIXL descriptors the request has: one per pool per run of consecutive pairs."""
        self._state = "PROC"
        self._reason = "NIXL state ERR"

    def done(self) -> bool:
        """True once every byte is written at the peer; TransferError if the transfer failed."""
        if self._state == "PROC":
            try:
                self._state = self._owner._poll(self._request)
            except TransferError:
                raise
            except Exception as err:  # noqa: BLE001 - NIXL raises its own classes for a lost peer
                self._state, self._reason = "ERR", f"{type(err).__name__}: {err}"
            if self._state != "PROC":
                self._finish()
        if self._state == "ERR":
            raise TransferError(
                f"transfer of {self.blocks} blocks ({self.nbytes} bytes) to peer {self.peer!r} failed: {self._reason}"
            )
        return self._state == "DONE"

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer is complete. TransferTimeout, naming the peer, the
        blocks and the timeout, when it is not complete after `timeout` seconds (None waits
        for ever); the transfer stays in flight and `wait` may be called again. TransferError
        if it failed."""
        timeout = seconds(timeout, "timeout", allow_none=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 1e-5
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                raise TransferTimeout(
                    f"transfer of {self.blocks} blocks ({self.nbytes} bytes) to peer {self.peer!r} "
                    f"not complete after {timeout} s (still in flight; wait again or close)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _finish(self) -> None:
        self._owner._release_request(self._request)
        self._request = None


class KvTransfer(PullMode, GrantMode):
    """A NIXL agent named `name` with every pool of `cache` (a PagedKvCache on `gpu`)
    registered: VRAM of `gpu.device_ordinal` on a "device:cuda" backend, DRAM on a
    "device:cpu" one (through `gpu.view` when it states "host_view", as HostBackend does:
    its pointers are not host addresses). Elastic caches are refused (their memory is mapped
    later). `backends` are the NIXL backend plugins the agent creates (UCX by default).
    Construction is all or nothing. Use one from one thread; `close()` (or a `with` block)
    deregisters (and releases open leases), and must come before the cache is released.
    `clock` (wall-clock seconds, `time.time`) dates pull leases (pagedkv.tiers.leases).

    Trust: whoever holds this agent's `metadata()` can write any block of this cache and
    read any registered pool (NIXL registers whole pools, and a write or read needs only the
    target's metadata): hand it only to peers trusted with the whole cache. `allow` (agent
    names) and `token` (bytes shared out of band) restrict whom `connect` accepts, so this
    agent never sends to or pulls from a peer it did not mean: with either, a peer must be
    named or carry the token's tag (`PeerRefused` otherwise, before anything is loaded). `require_grants=True` makes every write to this cache need a
    grant (`grant`). At most `max_peers` peers' connections are kept loaded (DEFAULT_MAX_PEERS).
    The cache cannot be released while its KvTransfer is open. One open agent per name in a
    process (ValueError for a second)."""

    def __init__(self, cache: PagedKvCache, gpu: Any, name: str, backends: Iterable[str] = ("UCX",),
                 clock: Callable[[], float] = time.time, *, allow: Iterable[str] | None = None,
                 token: bytes | None = None, max_peers: int = DEFAULT_MAX_PEERS, require_grants: bool = False):
        if isinstance(cache, HybridKvCache):
            raise KvCacheError("KvTransfer moves one group's pools: for a cache with layer_groups use "
                               "HybridKvTransfer(cache, gpu, name) (pagedkv.tiers.hybrid_transfer)")
        if not isinstance(cache, (PagedKvCache, StateGroup)):
            raise TypeError(f"cache must be a PagedKvCache, got {type(cache).__name__} (or a hybrid cache's state group)")
        self._state = isinstance(cache, StateGroup)
        if not isinstance(name, str) or not name or "\x00" in name or len(name) > transfer_metadata.MAX_NAME:
            raise ValueError(f"name must be a non-empty str without NUL of at most "
                             f"{transfer_metadata.MAX_NAME} characters, got {name!r:.80}")
        if name in _LIVE_NAMES:
            raise ValueError(f"a KvTransfer named {name!r} is already open in this process: agent names must be unique")
        if isinstance(backends, (str, bytes)) or not hasattr(backends, "__iter__"):
            raise TypeError(f"backends must be a list of NIXL backend names, got {backends!r:.60}")
        backends = list(backends)
        if not backends or any(type(b) is not str or not b for b in backends):
            raise ValueError(f"backends must be a non-empty list of NIXL backend names, got {backends!r:.60}")
        if allow is not None:
            if isinstance(allow, (str, bytes)) or not hasattr(allow, "__iter__"):
                raise TypeError(f"allow must be a collection of agent names, got {allow!r:.60}")
            allow = frozenset(allow)
            if any(type(a) is not str or not a for a in allow):
                raise ValueError(f"allow must hold agent names (non-empty str), got {sorted(map(repr, allow))[:4]}")
        if token is not None and (not isinstance(token, (bytes, bytearray)) or len(token) < 16):
            raise ValueError("token must be bytes of at least 16 (a shared secret), got "
                             f"{type(token).__name__}{'' if not isinstance(token, (bytes, bytearray)) else f' of {len(token)}'}")
        max_peers = positive_int(max_peers, "max_peers")
        if type(require_grants) is not bool:
            raise TypeError(f"require_grants must be a bool, got {require_grants!r:.40}")
        pools = cache.pools()
        try:
            pools.check_backend(gpu)
        except KvCacheError:
            raise KvCacheError(
                f"KvTransfer with {type(gpu).__name__} {gpu!r:.60}: the cache was built on another backend"
            ) from None
        if not pools.is_live():
            raise KvCacheError("KvTransfer over a released cache")
        if not self._state and pools.elastic() is not None:
            raise ValueError("KvTransfer needs a cache allocated whole (elastic=False): elastic pools map memory later")
        self._mem_type, self._device_id, self._views = self._memory_kind(gpu)
        nixl = load_nixl()
        self.name = name
        """This agent's name, as peers see it."""
        self._cache = cache
        self._gpu = gpu
        self._num_blocks = cache.num_blocks()
        self._layout = state_layout_of(cache) if self._state else layout_of(cache)
        self._pools = self._describe_pools(cache, gpu)
        self._peers: dict[str, _Peer] = {}
        self._loaded: dict[str, str] = {}  # peer name -> digest of the NIXL part loaded for it, LRU first
        self._allow, self._token = allow, None if token is None else bytes(token)
        self._max_peers, self._require_grants = max_peers, require_grants
        self._grants = GrantTable()
        self._requests: dict[int, Any] = {}
        self._inbox: list[tuple[str, bytes]] = []
        self._closed = False
        self._registered = None
        self._lease_registered = None
        self._leases = pull_leases.LeaseTable(clock)
        self._agent = nixl.nixl_agent(name, nixl.nixl_agent_config(backends=[]))
        try:
            available = list(getattr(self._agent, "plugin_list", None) or self._agent.get_plugin_list())
            unknown = [b for b in backends if b not in available]
            if unknown:
                raise TransferError(f"unknown NIXL backend {', '.join(map(repr, unknown))} "
                                    f"(this NIXL has: {', '.join(sorted(available))})")
            for backend in backends:
                self._agent.create_backend(backend, {})
            regions = [(p.address, self._num_blocks * p.stride, self._device_id, "") for p in self._pools]
            self._registered = self._agent.register_memory(regions, self._mem_type)
            words = [(self._leases.address(), self._leases.words.nbytes, 0, "")]
            self._lease_registered = self._agent.register_memory(words, "DRAM")
        except BaseException:
            if self._registered is not None:
                self._agent.deregister_memory(self._registered)
            self._agent = None
            self._closed = True
            raise
        _LIVE_NAMES.add(name)
        cache.hold(self, f"KvTransfer {name!r}")
        _log.debug("kv_transfer_ready", name=name, mem=self._mem_type, pools=len(self._pools),
                   fingerprint=fingerprint(self._layout))

    # -- setup ------------------------------------------------------------------------

    def _memory_kind(self, gpu: Any) -> tuple[str, int, list]:
        kind = device_kind(gpu)
        if kind == "cuda":
            return "VRAM", int(getattr(gpu, "device_ordinal", 0)), []
        if kind == "cpu":
            return "DRAM", 0, []
        raise TypeError(
            f"KvTransfer needs a backend whose memory NIXL can register (\"device:cuda\" or "
            f"\"device:cpu\"); {type(gpu).__name__} states {kind!r}"
        )

    def _describe_pools(self, cache: Any, gpu: Any) -> list[_Pool]:
        pools = cache.pools()
        host_view = self._mem_type == "DRAM" and backend_supports(gpu, "host_view")
        out = []
        for layer, sides in self._pool_rows(cache):
            for side, ptr, stride in sides:
                address = int(ptr)
                if host_view:
                    view = gpu.view(ptr, self._num_blocks * stride)
                    self._views.append(view)  # keeps the bytes alive while registered
                    address = view.ctypes.data
                out.append(_Pool(layer, side, address, stride))
        return out

    def _pool_rows(self, cache: Any) -> list:
        """[(layer, [(side, base, stride), ...])]: K then V per layer; for a state group,
        one "S<tensor>" row per state tensor of each layer."""
        pools = cache.pools()
        if self._state:
            return [(layer, [(f"S{t}", pools.pool_ptr(layer, t), pools.stride(t)) for t in range(pools.num_tensors())])
                    for layer in cache.layers]
        out = []
        for layer in range(cache.config().num_layers):
            sides = [("K", pools.k_pool(layer), pools.k_stride(layer))]
            if not cache.config().v_aliases_k:
                sides.append(("V", pools.v_pool(layer), pools.v_stride(layer)))
            out.append((layer, sides))
        return out

    def metadata(self) -> bytes:
        """What a peer's `connect` needs, handed over out of band: NIXL's agent metadata
        (connection details and registered memory) and pagedkv's layout description."""
        self._check_open()
        info = {
            "name": self.name,
            "num_blocks": self._num_blocks,
            "mem_type": self._mem_type,
            "device_id": self._device_id,
            "layout": self._layout,
            "pools": [[p.layer, p.side, p.address, p.stride] for p in self._pools],
            "leases": self._leases.address(),
        }
        if self._require_grants:
            info["grants"] = True
        return transfer_metadata.encode(info, bytes(self._agent.get_agent_metadata()), self._token)

    def fingerprint(self) -> str:
        """The short hash of this cache's layout description (see `layout_of`)."""
        return fingerprint(self._layout)

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

    # -- transfers --------------------------------------------------------------------

    def checked_send(self, peer: str, src_blocks: Any, dst_blocks: Any, notify: bytes = b"",
                     grant: bytes | None = None) -> tuple:
        """(peer, src, dst, notify as sent) of a `send` after every one of its checks, nothing
        sent: for a caller that must refuse a send of several agents before any of them posts."""
        self._check_open()
        info = self._peer(peer)
        src = _blocks(src_blocks, self._num_blocks, "src_blocks", "this cache")
        dst = _blocks(dst_blocks, info.num_blocks, "dst_blocks", f"peer {info.name!r}")
        if len(src) != len(dst):
            raise ValueError(f"src_blocks has {len(src)} blocks but dst_blocks has {len(dst)}")
        if not src:
            raise ValueError("src_blocks is empty: nothing to send")
        if len(set(dst)) != len(dst):
            seen: set[int] = set()
            repeated = next(b for b in dst if b in seen or seen.add(b))  # type: ignore[func-returns-value]
            raise ValueError(f"destination block {repeated} appears twice in dst_blocks")
        free = next((b for b in src if self._cache.ref_count(b) == 0), None)
        if free is not None:
            raise ValueError(f"source block {free} is free (send only blocks the cache holds)")
        if not isinstance(notify, (bytes, bytearray)):
            raise TypeError(f"notify must be bytes, got {type(notify).__name__}")
        if grant is not None:
            body = parse_ticket(grant)
            if body["receiver"] != info.name or body["peer"] != self.name:
                raise ValueError(f"the grant is {body['receiver']!r}'s for {body['peer']!r}, not peer "
                                 f"{info.name!r}'s for {self.name!r}")
            allowed = set(body["blocks"])
            outside = next((b for b in dst if b not in allowed), None)
            if outside is not None:
                raise ValueError(f"destination block {outside} is not in peer {info.name!r}'s grant "
                                 f"{body['grant']} (blocks {body['blocks'][:8]}{'...' if len(allowed) > 8 else ''})")
            notify = notify_prefix(body["grant"]) + bytes(notify)
        elif info.info.get("grants") is True:
            raise ValueError(f"peer {info.name!r} requires a grant for every send: pass grant=<its grant ticket>")
        self._check_moves(info, info.send_plans)
        return info, src, dst, notify

    def send(self, peer: str, src_blocks: Any, dst_blocks: Any, notify: bytes = b"", grant: bytes | None = None) -> TransferHandle:
        """Write every layer's K and V of `src_blocks` (this cache's, each allocated) into
        the peer's `dst_blocks` (the i-th into the i-th), in one NIXL request whose
        descriptor list has one entry per layer, side and run of consecutive pairs; `notify`
        reaches the peer's `notifications()` once the bytes have landed. Returns the handle
        to wait on. Checked before anything is sent: UnknownPeer, a block out of range on
        either side (IndexError naming it and the side's size), a free source block, lists of
        different or zero length, a repeated destination (ValueError naming it), a notify
        that is not bytes. Work the caller enqueued on the source blocks must be complete.

        `grant` is the receiver's ticket (`grant`) for these destination blocks: refused,
        before anything is sent, when it is another receiver's or for another sender, or when
        a destination block is not in it (ValueError naming the block); its id travels with
        the notification, which the receiver checks. A receiver made with require_grants=True
        (its metadata says so) refuses a send without one here."""
        info, src, dst, notify = self.checked_send(peer, src_blocks, dst_blocks, notify, grant)
        local, remote = self._descriptors(info, info.send_plans, src, dst)
        nixl_local = self._agent.get_xfer_descs(local, self._mem_type)
        nixl_remote = self._agent.get_xfer_descs(remote, info.mem_type)
        try:
            request = self._agent.initialize_xfer("WRITE", nixl_local, nixl_remote, info.name, bytes(notify))
        except Exception as err:
            raise TransferError(f"preparing {len(src)} blocks for peer {info.name!r} failed: {type(err).__name__}: {err}") from err
        self._requests[id(request)] = request
        try:
            state = self._agent.transfer(request)
        except Exception as err:
            self._release_request(request)
            raise TransferError(f"posting {len(src)} blocks to peer {info.name!r} failed: {type(err).__name__}: {err}") from err
        handle = TransferHandle(self, request, info.name, len(src), int(local[:, 1].sum()), len(local))
        if state == "ERR":
            self._release_request(request)
            raise TransferError(f"posting {len(src)} blocks to peer {info.name!r} failed (NIXL state ERR)")
        if state == "DONE":
            handle._state = "DONE"
            handle._finish()
        _log.debug("kv_transfer_sent", name=self.name, peer=info.name, blocks=len(src),
                   descriptors=len(local), bytes=handle.nbytes, state=state)
        return handle

    def _descriptors(self, peer: _Peer, plans: tuple, local_blocks: list[int],
                     remote_blocks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) Nx3 uint64 arrays of (address, bytes, device): per pool pair and
        block pair, the byte runs of the heads both sides hold (`head_plan`), consecutive
        whole blocks merged. ValueError when nothing moves (`_check_moves`)."""
        if plans is peer.send_plans:
            src_rows, dst_rows = head_plan.descriptors(list(plans), local_blocks, remote_blocks)
            local_rows, remote_rows = src_rows, dst_rows
        else:
            src_rows, dst_rows = head_plan.descriptors(list(plans), remote_blocks, local_blocks)
            local_rows, remote_rows = dst_rows, src_rows
        if local_rows.shape[0] == 0:
            self._check_moves(peer, plans)
        local = np.empty((local_rows.shape[0], 3), dtype=np.uint64)
        remote = np.empty_like(local)
        local[:, :2], remote[:, :2] = local_rows, remote_rows
        local[:, 2], remote[:, 2] = self._device_id, peer.device_id
        return local, remote

    def _check_moves(self, peer: _Peer, plans: tuple) -> None:
        """ValueError when `plans` (a peer's send or pull plans) move nothing: the two
        caches share no head (naming both ranks' layer 0 head ranges), or, for a state group,
        this pair of ranks is not the one whose replicated slots move (naming the rank that
        sends them)."""
        if any(plan[4].shape[0] for plan in plans):
            return
        sending = plans is peer.send_plans
        mine, theirs = (self._layout["tp_rank"], self._layout["tp_size"]), (peer.tp_rank, peer.tp_size)
        if self._state:
            to, frm = (theirs, mine) if sending else (mine, theirs)
            raise ValueError(
                f"state slots are replicated across TP ranks and TP rank {to[0]} of {to[1]} takes them from TP rank "
                f"{head_plan.replica_sender(to[0], frm[1], to[1])} of {frm[1]}, not rank {frm[0]} "
                f"({'this cache' if sending else f'peer {peer.name!r}'}): nothing to move")
        here, there = self._layout["layers"][0], peer.info["layout"]["layers"][0]
        raise ValueError(
            f"peer {peer.name!r} (TP rank {peer.tp_rank} of {peer.tp_size}, layer 0 heads "
            f"[{there['head_start']}, {there['head_start'] + there['num_kv_heads']})) shares no head with this "
            f"cache (TP rank {mine[0]} of {mine[1]}, layer 0 heads "
            f"[{here['head_start']}, {here['head_start'] + here['num_kv_heads']})): nothing to move"
        )

    def _poll(self, request: Any) -> str:
        self._check_open()
        return self._agent.check_xfer_state(request)

    def _release_request(self, request: Any) -> None:
        if self._requests.pop(id(request), None) is None:
            return
        try:
            self._agent.release_xfer_handle(request)
        except Exception as err:  # noqa: BLE001 - a release that fails must not hide the result
            _log.warning("kv_transfer_release_failed", name=self.name, error=f"{type(err).__name__}: {err}")

    # -- notifications ----------------------------------------------------------------

    def notifications(self) -> list[tuple[str, bytes]]:
        """Every (peer name, message) that arrived since the last call, oldest first per peer.
        A puller's completion of a lease is handled here (the lease's blocks are freed, no
        message is returned), and expired leases are released (`expire_leases`)."""
        self._check_open()
        violations = []
        for peer, messages in self._agent.get_new_notifs().items():
            peer = peer.decode() if isinstance(peer, bytes) else str(peer)
            for message in map(bytes, messages):
                if message.startswith(pull_leases.DONE_MAGIC):
                    self._lease_done(peer, message[len(pull_leases.DONE_MAGIC):])
                    continue
                user, why = self._granted(peer, message, self._require_grants)
                if why is None:
                    self._inbox.append((peer, user))
                else:
                    violations.append(why)
                    _log.warning("kv_transfer_grant_violation", name=self.name, peer=peer, why=why)
        self.expire_leases()
        if violations:
            raise GrantViolation("; ".join(violations) + " (the other notifications stay queued)")
        out, self._inbox = self._inbox, []
        return out

    def wait_notifications(self, timeout: float) -> list[tuple[str, bytes]]:
        """`notifications()` once at least one has arrived; TransferTimeout naming the
        timeout when none arrives within `timeout` seconds (a finite number >= 0: ValueError
        for NaN or an infinity)."""
        return poll_notifications(self.notifications, timeout, f"{self.name!r}: no notification")

    # -- lifetime ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"KvTransfer {self.name!r} is closed")

    def closed(self) -> bool:
        """True after `close()` (or a failed construction)."""
        return self._closed

    def close(self) -> None:
        """Release in-flight requests (NIXL cancels what it can), forget every peer and
        deregister the pools. Idempotent; every step is attempted and the first error raised."""
        if self._closed:
            return
        self._closed = True
        first: BaseException | None = None
        steps = [lambda r=r: self._agent.release_xfer_handle(r) for r in self._requests.values()]
        steps += [lambda p=p: self._agent.remove_remote_agent(p) for p in self._loaded]
        steps.append(self._close_grants)
        steps += [lambda i=i: self._release_lease(i, "closed") for i in self._leases.open_ids()]
        if self._registered is not None:
            steps.append(lambda: self._agent.deregister_memory(self._registered))
        if self._lease_registered is not None:
            steps.append(lambda: self._agent.deregister_memory(self._lease_registered))
        for step in steps:
            try:
                step()
            except Exception as err:  # noqa: BLE001 - every step must be attempted
                first = first or err
                _log.error("kv_transfer_close_failed", name=self.name, error=f"{type(err).__name__}: {err}")
        self._requests.clear()
        self._peers.clear()
        self._loaded.clear()
        self._registered = self._lease_registered = None
        self._agent = None
        self._views = []
        _LIVE_NAMES.discard(self.name)
        self._cache.let_go(self)
        if first is not None:
            raise first

    def __enter__(self) -> "KvTransfer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
