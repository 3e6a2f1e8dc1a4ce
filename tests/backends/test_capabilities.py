"""Capability discovery: what `supports` answers, and pagedkv features refusing a
capability the backend lacks by name instead of failing deep inside."""

from __future__ import annotations

import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache
from pagedkv.backends.capabilities import (
    CAPABILITIES,
    BackendFeatureMissing,
    backend_supports,
    device_kind,
    require,
)


class ProtocolOnly(HostBackend):
    """The required protocol and nothing more: no `supports`."""

    supports = None


class SaysCuda(HostBackend):
    """States a CUDA device but no stream waits."""

    device_ordinal = 0

    def supports(self, name):
        return name in ("device:cuda", "batched_copy")


def test_host_backend_states_its_capabilities():
    host = HostBackend(1 << 20)
    assert {n for n in CAPABILITIES if host.supports(n)} == {"batched_copy", "host_view", "vmm", "host_tier", "device:cpu"}
    assert device_kind(host) == "cpu"
    with pytest.raises(ValueError, match="unknown backend capability 'pinnned'; known: pinned, batched_copy"):
        host.supports("pinnned")


def test_cuda_backend_states_its_capabilities_without_a_device():
    from pagedkv.driver import CudaBackend

    assert CudaBackend.SUPPORTED == {"pinned", "batched_copy", "stream_wait", "host_tier", "graphs", "device:cuda"}
    assert CudaBackend.supports(object.__new__(CudaBackend), "host_view") is False


def test_no_supports_means_only_the_required_protocol():
    gpu = ProtocolOnly(1 << 20)
    assert [backend_supports(gpu, n) for n in CAPABILITIES] == [False] * len(CAPABILITIES)
    assert device_kind(gpu) is None
    with pytest.raises(ValueError, match="unknown backend capability 'gpu'"):
        backend_supports(gpu, "gpu")


def test_supports_must_answer_a_bool():
    class Vague(HostBackend):
        def supports(self, name):
            return "yes"

    with pytest.raises(TypeError, match=r"Vague.supports\('pinned'\) returned 'yes', not a bool"):
        backend_supports(Vague(1 << 20), "pinned")


def test_require_names_the_feature_the_capability_and_the_backend():
    with pytest.raises(BackendFeatureMissing, match=r"staging uploads needs a backend that supports 'pinned' "
                       r"\(alloc_pinned.*\); ProtocolOnly does not"):
        require(ProtocolOnly(1 << 20), "pinned", "staging uploads")
    require(HostBackend(1 << 20), "host_view", "a host view")


def _cache(gpu):
    config = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    return PagedKvCache(config, 2, gpu)


def test_pool_view_on_a_backend_without_a_device_kind_is_refused_by_name():
    gpu = ProtocolOnly(1 << 20)
    cache = _cache(gpu)
    with pytest.raises(BackendFeatureMissing, match="states its device kind.*ProtocolOnly states none"):
        cache.k_view(0, gpu)
    cache.release(gpu)


def test_dlpack_to_a_cuda_stream_without_stream_wait_is_refused_by_name():
    gpu = SaysCuda(1 << 20)
    cache = _cache(gpu)
    view = cache.k_view(0, gpu)
    assert view.__dlpack_device__() == (2, 0)
    with pytest.raises(BackendFeatureMissing, match="consumer's stream needs a backend that supports 'stream_wait'.*SaysCuda does not"):
        view.__dlpack__(stream=7)
    with pytest.raises(BackendFeatureMissing, match="host_array.*'host_view'.*SaysCuda does not"):
        view.host_array()
    cache.release(gpu)
