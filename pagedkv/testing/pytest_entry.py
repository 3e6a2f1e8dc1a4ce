"""conformance_tests: the conformance rules as pytest test functions for a backend author's
own test file. pytest is imported only when a test runs and must skip."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from .registry import Rule
from .report import FAILED, SKIPPED
from .runner import run_on_fresh_backend, select_rules


def conformance_tests(
    factory: Callable[[], Any],
    *,
    close: Callable[[Any], None] | None = None,
    skip: Mapping[str, str] | None = None,
    only: Iterable[str] | None = None,
    prefix: str = "test_conformance_",
) -> dict[str, Callable[[], None]]:
    """One test function per rule, named `prefix + rule name`, to merge into a test
    module's globals:

        from pagedkv.testing import conformance_tests
        from my_engine import MyBackend
        globals().update(conformance_tests(lambda: MyBackend(device=0)))

    Each test runs its rule on a fresh backend from `factory` (then `close(backend)`),
    fails with the rule's reason, and skips (with the reason) when the backend lacks a
    capability the rule needs or `skip` names the rule."""
    skip = dict(skip or {})
    return {prefix + r.name: _make_test(r, factory, close, skip.get(r.name)) for r in select_rules(skip, only)}


def _make_test(rule: Rule, factory: Callable[[], Any], close: Callable[[Any], None] | None,
               skip_reason: str | None) -> Callable[[], None]:
    def test() -> None:
        import pytest

        if skip_reason is not None:
            pytest.skip(skip_reason)
        result, _ = run_on_fresh_backend(rule, factory, close)
        if result.status == SKIPPED:
            pytest.skip(result.reason)
        if result.status == FAILED:
            pytest.fail(f"{rule.name}: {result.reason}", pytrace=False)

    test.__name__ = test.__qualname__ = f"test_conformance_{rule.name}"
    test.__doc__ = rule.doc
    return test
