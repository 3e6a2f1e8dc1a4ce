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

This module holds the class, its construction (NIXL loaded, the pools registered), its
metadata and `close`; the rest is mixed in: the peers with `connect` (`transfer_peers`),
the send path with `TransferHandle` (`transfer_send`), the notifications
(`transfer_notify`), the pull half (`pull_mode`) and the write grants (`transfer_grants`).
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from typing import Any, Callable, Iterable

from ..backends.capabilities import backend_supports, device_kind
from ..cache.hybrid_cache import HybridKvCache, StateGroup
from ..cache.paged_cache import PagedKvCache
from ..core.log import get_logger
from ..core.validate import positive_int
from ..errors import KvCacheError
from . import transfer_metadata
from . import leases as pull_leases
from .pull_mode import PullMode
from .transfer_grants import GrantMode, GrantTable, GrantViolation  # noqa: F401 - GrantViolation re-exported
from .transfer_notify import Notifications, poll_notifications  # noqa: F401 - poll_notifications re-exported
from .transfer_peers import PeerConnections, _Peer, _Pool
from .transfer_send import SendMode, TransferHandle  # noqa: F401 - TransferHandle re-exported
from .head_plan import block_runs  # noqa: F401 - re-exported: this module's API before head_plan
from .transfer_errors import (  # noqa: F401 - re-exported: the transfer API's errors
    LayoutMismatch,
    LeaseExpired,
    NixlUnavailable,
    PeerRefused,
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


class KvTransfer(PeerConnections, SendMode, Notifications, PullMode, GrantMode):
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
