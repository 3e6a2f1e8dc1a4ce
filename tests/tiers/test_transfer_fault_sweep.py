"""The transfer scenario of the fault sweep: two HostBackend caches behind two KvTransfers
(UCX on loopback, one process) connect, grant, send under the grant, wait, take the
notification, disconnect and close. The backend's calls (tests/fault_injection.py's
FaultyHost, early and late) are swept by the tier and elastic scenarios; here NIXL's agent calls: each
occurrence of each call fails once, early, the call raising having done nothing). Then,
faults off: closing and releasing everything leaves nothing live on the backend, no
agent name taken, both caches' counts consistent, and a fresh pair of agents with the
same names moves the blocks byte for byte (nothing spoilt). Seeded by construction.

Not on the stub: CudaBackend's VRAM cannot be registered with a real NIXL over the libcuda
stub (its pointers are not device memory), so this sweep is HostBackend's only."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from fault_injection import FaultPlan, InjectedFault, _new_backend
from pagedkv import KvCacheConfig, PagedKvCache
from pagedkv.errors import PagedKvError
from pagedkv.tiers import transfer as transfer_module
from pagedkv.tiers.transfer import KvTransfer, NixlUnavailable, load_nixl

try:
    NIXL = load_nixl()
    NIXL_REASON = None
except NixlUnavailable as err:
    NIXL, NIXL_REASON = None, f"NIXL is not installed: {err}"

pytestmark = pytest.mark.skipif(NIXL_REASON is not None, reason=NIXL_REASON or "")

CONFIG = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=2, dtype="bf16")
AGENT_CALLS = ("register_memory", "deregister_memory", "create_backend", "get_agent_metadata", "add_remote_agent",
               "remove_remote_agent", "get_xfer_descs", "initialize_xfer", "transfer", "check_xfer_state",
               "release_xfer_handle", "get_new_notifs")
WAIT = 20.0


class FaultyAgent:
    """A NIXL agent whose calls of AGENT_CALLS fail where `plan` says: `plan.method` names
    one (as "nixl.<call>"), `plan.skip` how many of its calls pass first (the polling calls'
    counts depend on timing, so positions are per call name, not global)."""

    def __init__(self, real, plan: FaultPlan):
        self._real, self._plan = real, plan

    def __getattr__(self, name):
        attribute = getattr(self._real, name)
        if name not in AGENT_CALLS:
            return attribute

        def call(*args, **kwargs):
            plan = self._plan
            if plan.armed and plan.method == f"nixl.{name}":
                if plan.skip:
                    plan.skip -= 1
                else:
                    plan.method, plan.fired = None, f"nixl.{name}"
                    raise InjectedFault(f"injected failure of nixl.{name}")
            if plan.armed:
                COUNTS[name] = COUNTS.get(name, 0) + 1
            return attribute(*args, **kwargs)

        return call


COUNTS: dict[str, int] = {}


class FaultyNixl:
    """NIXL's module, making FaultyAgents."""

    def __init__(self, plan: FaultPlan):
        self._plan = plan

    def __getattr__(self, name):
        return getattr(NIXL, name)

    def nixl_agent(self, name, config):
        return FaultyAgent(NIXL.nixl_agent(name, config), self._plan)


class World:
    def __init__(self, plan: FaultPlan):
        self.plan = plan
        self.gpu = _new_backend(plan)
        self.caches: list[PagedKvCache] = []
        self.transfers: list[KvTransfer] = []


def scenario(w: World) -> None:
    gpu = w.gpu
    a = PagedKvCache(CONFIG, 8, gpu)
    w.caches.append(a)
    b = PagedKvCache(CONFIG, 8, gpu)
    w.caches.append(b)
    ta = KvTransfer(a, gpu, "sweep-a")
    w.transfers.append(ta)
    tb = KvTransfer(b, gpu, "sweep-b", require_grants=True)
    w.transfers.append(tb)
    src = a.alloc_blocks(3)
    a.fill_blocks(src, 0x33, gpu, 0)
    dst = b.alloc_blocks(3)
    ticket = tb.grant("sweep-a", dst)
    peer = ta.connect(tb.metadata())
    ta.send(peer, src, dst, b"n", grant=ticket).wait(WAIT)
    assert tb.wait_notifications(WAIT) == [("sweep-a", b"n")]
    assert (b.read_block(1, dst[2], gpu)[1] == 0x33).all()
    ta.disconnect(peer)
    for transfer in (ta, tb):
        transfer.close()
    for cache in (a, b):
        cache.release(gpu)


def recover(w: World) -> dict:
    """Faults off: close every transfer, check and release every cache; what is live."""
    w.plan.armed = False
    for transfer in w.transfers:
        transfer.close()  # idempotent; a close that failed has released what it could
    for cache in w.caches:
        if not cache.allocator().released():
            cache.allocator().check_invariants(None if not cache.allocator().num_blocks() else {
                blk: cache.ref_count(blk) for blk in range(cache.num_blocks()) if cache.ref_count(blk)})
        cache.release(w.gpu)
    return {"allocations": w.gpu.live_allocations(), "bytes": w.gpu.live_bytes(),
            "events": w.gpu.live_events(), "names": sorted(n for n in transfer_module._LIVE_NAMES if n.startswith("sweep"))}


def run(method: str, skip: int, monkeypatch) -> tuple[str | None, dict]:
    plan = FaultPlan(armed=True)
    plan.method, plan.skip = f"nixl.{method}", skip
    monkeypatch.setattr(transfer_module, "load_nixl", lambda: FaultyNixl(plan))
    world = World(plan)
    try:
        scenario(world)
    except (InjectedFault, PagedKvError, AssertionError) as err:
        if isinstance(err, AssertionError) and plan.fired is None:
            raise
    return plan.fired, recover(world)


POLLED = ("check_xfer_state", "get_new_notifs")
CLEAN = {"allocations": 0, "bytes": 0, "events": 0, "names": []}


@pytest.fixture(scope="module")
def counts():
    """How many times the scenario calls each agent method when nothing fails."""
    patch = pytest.MonkeyPatch()
    COUNTS.clear()
    plan = FaultPlan(armed=True)
    patch.setattr(transfer_module, "load_nixl", lambda: FaultyNixl(plan))
    world = World(plan)
    scenario(world)
    patch.undo()
    assert recover(world) == CLEAN
    return dict(COUNTS)


@pytest.mark.parametrize("method", AGENT_CALLS)
def test_every_failing_agent_call_of_a_transfer_is_survived_with_nothing_leaked(method, counts, monkeypatch):
    monkeypatch.setenv("UCX_LOG_LEVEL", "fatal")  # a failed connect's lines (UCX prints them on stdout)
    n = counts.get(method, 0)
    assert n >= 1, (method, counts)
    positions = range(1) if method in POLLED else range(n)  # a polling call's count depends on timing
    problems = []
    with capture_logs():
        for skip in positions:
            fired, live = run(method, skip, monkeypatch)
            if fired != f"nixl.{method}" or live != CLEAN:
                problems.append((skip, fired, live))
    assert problems == []
    # nothing spoilt: fresh agents of the same names move the blocks
    monkeypatch.setattr(transfer_module, "load_nixl", load_nixl)
    clean = World(FaultPlan(armed=False))
    scenario(clean)
    assert recover(clean) == CLEAN
