"""The conformance rules' registry and the checks a rule uses to fail with a reason.

A rule is a function of one fresh backend that returns when the backend honours one
point of the protocol and raises `ConformanceFailure` (with the reason) when it does not.
`RULES` holds them in the order they run: the protocol rules first, then the cache rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import PagedKvError


class ConformanceFailure(PagedKvError):
    """A backend broke a conformance rule; the message says how."""


class RuleNotApplicable(PagedKvError):
    """Raised by a rule that does not apply to this backend; the message says why."""


@dataclass(frozen=True)
class Rule:
    """One conformance rule: `name` (unique), `check(gpu)`, the contract point it tests
    (`doc`, the check's docstring), the capabilities it needs (skipped without them) and
    its group ("protocol" or "cache")."""

    name: str
    check: Callable[[Any], None]
    doc: str
    requires: tuple[str, ...]
    group: str


RULES: list[Rule] = []
"""Every rule, in run order."""


def rule(group: str, requires: tuple[str, ...] = ()) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    """Register the decorated function as the rule named after it (without a `rule_` prefix)."""

    def register(check: Callable[[Any], None]) -> Callable[[Any], None]:
        name = check.__name__.removeprefix("rule_")
        if any(r.name == name for r in RULES):
            raise ValueError(f"conformance rule {name!r} is registered twice")
        doc = " ".join((check.__doc__ or "").split())
        RULES.append(Rule(name, check, doc, tuple(requires), group))
        return check

    return register


def expect(condition: bool, reason: str) -> None:
    """Raise ConformanceFailure(reason) unless `condition` holds."""
    if not condition:
        raise ConformanceFailure(reason)


def expect_bytes(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Byte-for-byte equality, or ConformanceFailure naming the first differing offset."""
    got, want = np.asarray(got, np.uint8).reshape(-1), np.asarray(want, np.uint8).reshape(-1)
    expect(got.size == want.size, f"{what}: {got.size} bytes, expected {want.size}")
    diff = np.flatnonzero(got != want)
    if diff.size:
        at = int(diff[0])
        raise ConformanceFailure(
            f"{what}: {diff.size} byte(s) differ, first at offset {at}: got {int(got[at]):#04x}, expected {int(want[at]):#04x}"
        )


def expect_raises(kinds: type | tuple[type, ...], call: Callable[[], Any], what: str, names: str | None = None) -> BaseException:
    """Run `call`; it must raise one of `kinds` (and the message must contain `names`, when
    given). Returns the exception; ConformanceFailure otherwise."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    wanted = " or ".join(k.__name__ for k in kinds)
    try:
        call()
    except kinds as err:
        if names is not None and names.lower() not in str(err).lower():
            raise ConformanceFailure(f"{what}: raised {type(err).__name__}({err}) without naming {names!r}") from None
        return err
    except Exception as err:  # noqa: BLE001 - a wrong exception type is the finding
        raise ConformanceFailure(f"{what}: raised {type(err).__name__}({err}), expected {wanted}") from None
    raise ConformanceFailure(f"{what}: returned, expected {wanted}")


def read(gpu: Any, ptr: Any, nbytes: int) -> np.ndarray:
    """`nbytes` bytes at `ptr`, through `copy_d2h` into a fresh uint8 array."""
    out = np.empty(nbytes, np.uint8)
    gpu.copy_d2h(ptr, out)
    return out
