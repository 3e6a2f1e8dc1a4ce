"""Releasing model resources (the KV cache is one) in reverse order, past failures."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, TypeVar, runtime_checkable

from ..errors import TeardownError
from .log import get_logger

_log = get_logger("teardown")

T = TypeVar("T")


def free_each(
    items: Iterable[T], free: Callable[[T], Any], log: Any, event: str, field: str | None = None
) -> tuple[list[T], BaseException | None]:
    """Call `free(item)` for every item, past failures: returns the items whose free raised
    (in order, so the caller keeps them recorded for a retry) and the first error (None
    when all succeeded). Each failure is logged on the caller's logger `log` as error event
    `event` with `error` and, when `field` is given, `field=repr(item)`. The caller decides
    whether to raise."""
    kept: list[T] = []
    first: BaseException | None = None
    for item in items:
        try:
            free(item)
        except Exception as err:  # noqa: BLE001 - every item must be attempted
            kept.append(item)
            first = first or err
            fields = {field: repr(item)} if field is not None else {}
            log.error(event, **fields, error=str(err))
    return kept, first


@runtime_checkable
class ModelResource(Protocol):
    """Something holding device memory: a label for messages and an idempotent release."""

    def label(self) -> str:
        """A short name for messages."""
        ...

    def release(self, gpu) -> None:
        """Free what the resource holds; a second call does nothing."""
        ...


class Teardown:
    """An ordered stack of resources, released last-registered first."""

    def __init__(self) -> None:
        self._resources: list[ModelResource] = []

    def push(self, resource: ModelResource) -> None:
        """Register `resource` to be released by `release_all`."""
        if not isinstance(resource, ModelResource):
            raise TypeError(f"{resource!r} is not a ModelResource (needs label() and release(gpu))")
        self._resources.append(resource)

    def __len__(self) -> int:
        return len(self._resources)

    def release_all(self, gpu) -> None:
        """Release every resource in reverse order, continuing past failures; then, if any
        failed, raise TeardownError: `N resource(s) failed to release: label: error; ...`.
        A resource whose release failed stays registered (in its order), so a second call
        retries just those; the ones released are forgotten."""
        failures: list[tuple[str, BaseException]] = []
        resources, self._resources = self._resources, []
        kept: list[ModelResource] = []
        for resource in reversed(resources):
            try:
                resource.release(gpu)
            except Exception as err:  # noqa: BLE001 - keep releasing the rest
                label = _safe_label(resource)
                _log.error("resource_release_failed", resource=label, error=str(err))
                failures.append((label, err))
                kept.append(resource)
        kept.reverse()
        self._resources = kept + self._resources  # before any pushed while releasing
        if failures:
            raise TeardownError(failures)


def _safe_label(resource: ModelResource) -> str:
    try:
        return resource.label()
    except Exception:  # noqa: BLE001 - a broken label must not hide the release error
        return repr(resource)
