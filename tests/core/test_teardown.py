"""Teardown: reverse order, past failures, one error naming each failure."""

import pytest
from structlog.testing import capture_logs

from pagedkv import HostBackend, KvCacheConfig, ModelResource, PagedKvCache, Teardown, TeardownError


class Resource:
    """A ModelResource that records its release into a shared journal, optionally failing."""

    def __init__(self, name, journal, error=None):
        self.name, self.journal, self.error = name, journal, error

    def label(self):
        return self.name

    def release(self, gpu):
        self.journal.append((self.name, gpu))
        if self.error is not None:
            raise self.error


def test_releases_in_reverse_order():
    journal = []
    t = Teardown()
    for name in ("weights", "kv", "scratch"):
        t.push(Resource(name, journal))
    assert len(t) == 3
    t.release_all("gpu0")
    assert journal == [("scratch", "gpu0"), ("kv", "gpu0"), ("weights", "gpu0")]
    assert len(t) == 0
    t.release_all("gpu0")  # nothing left to release
    assert len(journal) == 3


def test_continues_past_failures_and_reports_each():
    journal = []
    t = Teardown()
    t.push(Resource("a", journal))
    t.push(Resource("b", journal, RuntimeError("device lost")))
    t.push(Resource("c", journal))
    t.push(Resource("d", journal, ValueError("bad pointer 0x10")))
    with capture_logs() as logs:
        with pytest.raises(TeardownError) as info:
            t.release_all(None)
    assert [name for name, _ in journal] == ["d", "c", "b", "a"]
    assert str(info.value) == "2 resource(s) failed to release: d: bad pointer 0x10; b: device lost"
    assert [(label, type(err)) for label, err in info.value.failures] == [("d", ValueError), ("b", RuntimeError)]
    assert [(e["event"], e["resource"]) for e in logs] == [("resource_release_failed", "d"), ("resource_release_failed", "b")]
    assert len(t) == 2  # the two that failed stay registered for a retry


def test_a_failed_release_stays_registered_and_a_retry_releases_just_it():
    journal = []
    t = Teardown()
    t.push(Resource("a", journal))
    flaky = Resource("b", journal, RuntimeError("busy"))
    t.push(flaky)
    t.push(Resource("c", journal, OSError("gone")))
    with pytest.raises(TeardownError):
        t.release_all(None)
    assert len(t) == 2
    flaky.error = None
    with pytest.raises(TeardownError, match=r"^1 resource\(s\) failed to release: c: gone$"):
        t.release_all(None)  # reverse order again: c, then b
    assert [name for name, _ in journal] == ["c", "b", "a", "c", "b"]
    assert len(t) == 1
    t._resources[0].error = None
    t.release_all(None)
    assert len(t) == 0 and [name for name, _ in journal][-1] == "c"


def test_one_failure_message():
    t = Teardown()
    t.push(Resource("only", [], OSError("gone")))
    with pytest.raises(TeardownError, match=r"^1 resource\(s\) failed to release: only: gone$"):
        t.release_all(None)


def test_broken_label_does_not_hide_the_error():
    class NoLabel(Resource):
        def label(self):
            raise RuntimeError("no label")

    r = NoLabel("x", [], RuntimeError("release failed"))
    t = Teardown()
    t.push(r)
    with pytest.raises(TeardownError, match=r"1 resource\(s\) failed to release: .*NoLabel.*: release failed"):
        t.release_all(None)


def test_push_refuses_non_resources():
    t = Teardown()
    with pytest.raises(TypeError, match="not a ModelResource"):
        t.push(object())
    assert len(t) == 0


def test_cache_in_a_teardown():
    gpu = HostBackend(1 << 20)
    journal = []
    cache = PagedKvCache(KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=2, dtype="bf16"), 4, gpu)
    assert isinstance(cache, ModelResource)
    t = Teardown()
    t.push(cache)
    t.push(Resource("after", journal, RuntimeError("boom")))
    with pytest.raises(TeardownError, match=r"^1 resource\(s\) failed to release: after: boom$"):
        t.release_all(gpu)
    assert gpu.live_allocations() == 0  # the cache was still released
    cache.release(gpu)  # idempotent
