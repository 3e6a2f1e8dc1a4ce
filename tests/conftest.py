"""Shared fixtures: the backend under test, parametrised over every backend present."""

from __future__ import annotations

import os

import pytest
import structlog
from hypothesis import HealthCheck, settings

from pagedkv import HostBackend
from pagedkv.core.env import reload_flags

settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

HOST_CAPACITY = 1 << 30


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Make `--dist loadgroup` group again: pytest-xdist marks a test of an xdist_group by
    suffixing its node id with `@name` (the scheduler groups on that suffix), but it writes
    the suffix to `item._nodeid`, which pytest 9.2's structured node ids no longer read
    (pytest-xdist issue #1386), so every test was scheduled on its own: a group's
    module-scoped fixture was built in both workers, and one waited on the other's lock.
    Runs after xdist's hook, only in an xdist worker under loadgroup, and only where the
    suffix is missing (a fixed xdist, or an older pytest, already wrote it)."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if not names:
            continue
        suffix = "@" + "_".join(names)
        node_id = getattr(item, "_id", None)
        if item.nodeid.endswith(suffix) or node_id is None or not hasattr(type(node_id), "parse"):
            continue
        item._id = type(node_id).parse(item.nodeid + suffix)


@pytest.fixture(scope="session")
def cuda_session():
    """One CudaBackend for the whole session (one primary-context retain, kernels loaded
    once), or pytest.skip with the reason there is none."""
    try:
        from pagedkv import driver
    except ImportError as err:  # pragma: no cover - the package always ships it
        pytest.skip(f"pagedkv.driver not importable: {err}")
    if not driver.is_available():
        pytest.skip("no CUDA driver or GPU on this machine")
    backend = driver.CudaBackend()
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def stub_env(tmp_path_factory):
    """Environment for a subprocess that loads the libcuda stub with the kernel harness
    libraries of pagedkv/nvrtc_src (built once per session; see tests/kernel_harness)."""
    from kernel_harness.stub import make_stub_env

    return make_stub_env(tmp_path_factory.mktemp("stub_libcuda"))


@pytest.fixture(params=["host", "torch_arena", pytest.param("cuda", marks=pytest.mark.cuda)])
def gpu(request):
    """The backend under test: HostBackend always, TorchArenaBackend where torch is
    installed, CudaBackend where a GPU is present."""
    if request.param == "host":
        return HostBackend(capacity_bytes=HOST_CAPACITY)
    if request.param == "torch_arena":
        pytest.importorskip("torch", reason="torch is not installed (the interop extra)")
        from pagedkv.backends.torch_arena import TorchArenaBackend

        import torch

        # fresh memory of one fixed, non-zero pattern: what a test sees never depends on
        # which test ran before it (torch.empty would hand back earlier tests' bytes)
        return TorchArenaBackend(capacity_bytes=HOST_CAPACITY,
                                 allocate=lambda n: torch.full((n,), 0xA5, dtype=torch.uint8))
    return request.getfixturevalue("cuda_session")


@pytest.fixture
def host():
    """A HostBackend alone, for tests about the host backend itself."""
    return HostBackend(capacity_bytes=HOST_CAPACITY)


@pytest.fixture
def env_flags(monkeypatch):
    """Set METRALE_* variables for one test: `env_flags(METRALE_KV_TRACE="1")`; restores after."""

    def set_flags(**values: str):
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        return reload_flags()

    yield set_flags
    monkeypatch.undo()
    reload_flags()


class HeldSet:
    """The smallest real `BlockReclaimer`: it holds the blocks in `held` (the test puts them
    there with their reference), evicts nothing, and counts what the allocator tells it."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.sole: list[int] = []
        self.delivered = 0

    def reclaim(self, n: int) -> bool:
        return False

    def on_sole_reference(self, block: int) -> None:
        self.sole.append(block)

    def is_cached(self, block: int) -> bool:
        return block in self.held

    def deliver_events(self) -> None:
        self.delivered += 1


@pytest.fixture
def held_set():
    """A fresh `HeldSet` reclaimer (attach it with `cache.attach_prefix_cache`)."""
    return HeldSet()


@pytest.fixture(autouse=True)
def _structlog_configuration_per_test():
    """Each test starts from the structlog configuration the session had: structlog's
    capture_logs (and any test that configures structlog) leaves it "configured", which
    would route pagedkv's events to stdout in every later test of the same process."""
    was_configured, saved = structlog.is_configured(), structlog.get_config()
    yield
    if was_configured:
        structlog.configure(**saved)
    else:
        structlog.reset_defaults()

