"""backend_conformance: run every conformance rule over fresh backends from a factory."""

from __future__ import annotations

import traceback
from typing import Any, Callable, Iterable, Mapping

from ..backends.capabilities import backend_supports
from . import protocol_rules  # noqa: F401 - importing registers the rules, protocol first
from . import tier_rules  # noqa: F401,I001 - its protocol rules, then its cache rule
from . import cache_rules  # noqa: F401,I001
from . import hybrid_rules  # noqa: F401,I001 - after the cache rules
from .registry import RULES, ConformanceFailure, Rule, RuleNotApplicable
from .report import FAILED, PASSED, SKIPPED, ConformanceReport, RuleResult


LEAK_RUNS = 5
"""Runs of a rule, at most, before free bytes that keep dropping count as a leak."""


def select_rules(skip: Mapping[str, str] | None = None, only: Iterable[str] | None = None) -> list[Rule]:
    """The rules to run: all, or those named in `only`; ValueError naming an unknown rule
    in `skip` or `only`, or for an empty `only` (it would check nothing)."""
    known = {r.name for r in RULES}
    if isinstance(only, (str, bytes)):
        raise TypeError(f"only must be a list of rule names, got {only!r:.60}")
    wanted = None if only is None else list(only)
    if wanted == []:
        raise ValueError("only=[] selects no conformance rule: a run of nothing would report ok (give None for all)")
    for name in list(skip or {}) + (wanted or []):
        if name not in known:
            raise ValueError(f"unknown conformance rule {name!r}; known: {', '.join(sorted(known))}")
    return [r for r in RULES if wanted is None or r.name in wanted]


def run_rule(rule: Rule, gpu: Any) -> RuleResult:
    """Run one rule on the backend `gpu`: skipped when it lacks a capability the rule
    needs; failed with the reason when the rule raises, or when the backend's free bytes
    drop over the rule and keep dropping over `LEAK_RUNS` reruns (a leak, not buffers
    the backend keeps and reuses); passed otherwise."""
    try:
        missing = [name for name in rule.requires if not backend_supports(gpu, name)]
        if missing:
            return RuleResult(rule.name, SKIPPED, f"the backend does not support {', '.join(map(repr, missing))}")
        free_before = gpu.mem_info()[0]
        rule.check(gpu)
    except RuleNotApplicable as why:
        return RuleResult(rule.name, SKIPPED, str(why))
    except ConformanceFailure as failure:
        return RuleResult(rule.name, FAILED, str(failure))
    except Exception as err:  # noqa: BLE001 - any exception from the backend is a finding
        return RuleResult(rule.name, FAILED, _reason(err))
    free = [free_before, gpu.mem_info()[0]]
    # a backend may keep buffers of its own (a staging ring, kernels): reruns tell those,
    # which stop growing, from a leak, which takes memory on every run
    while free[-1] < free[-2] and len(free) <= LEAK_RUNS:
        try:
            rule.check(gpu)
        except Exception as err:  # noqa: BLE001
            return RuleResult(rule.name, FAILED, f"run {len(free)} on the same backend " + _reason(err))
        free.append(gpu.mem_info()[0])
    if free[-1] < free[-2]:
        return RuleResult(
            rule.name, FAILED,
            f"free bytes {' -> '.join(map(str, free))} over {len(free) - 1} runs: memory not given back",
        )
    return RuleResult(rule.name, PASSED)


def _reason(err: BaseException) -> str:
    """What went wrong: the first failure, when a cleanup step raised while it was on its way."""
    where = traceback.extract_tb(err.__traceback__)[-1]
    raised = f"raised {type(err).__name__}: {err} (in {where.name}, line {where.lineno})"
    first = err.__context__
    while first is not None and not isinstance(first, ConformanceFailure):
        first = first.__context__
    return raised if first is None else f"{first} (then the cleanup {raised})"


def run_on_fresh_backend(rule: Rule, factory: Callable[[], Any], close: Callable[[Any], None] | None) -> tuple[RuleResult, str]:
    """`run_rule` on a backend from `factory`, then `close(backend)` when given; a factory
    or close that raises fails the rule. Returns the result and the backend's type name."""
    try:
        gpu = factory()
    except Exception as err:  # noqa: BLE001
        return RuleResult(rule.name, FAILED, f"the factory raised {type(err).__name__}: {err}"), "?"
    try:
        result = run_rule(rule, gpu)
    finally:
        if close is not None:
            try:
                close(gpu)
            except Exception as err:  # noqa: BLE001
                result = RuleResult(rule.name, FAILED, f"close(backend) raised {type(err).__name__}: {err}")
    return result, type(gpu).__name__


def backend_conformance(
    factory: Callable[[], Any],
    *,
    close: Callable[[Any], None] | None = None,
    skip: Mapping[str, str] | None = None,
    only: Iterable[str] | None = None,
) -> ConformanceReport:
    """Run every conformance rule (or those named in `only`) on fresh backends from
    `factory` (a callable returning a backend; it may return the same one each time when
    making one is costly, since every rule frees what it allocates) and return the
    report: each rule passed, failed with the reason, or skipped (the backend lacks a
    capability it needs, or `skip` names it with the reason). `close(backend)` runs after
    each rule when given. Prints nothing."""
    skip = dict(skip or {})
    results, name = [], "?"
    for r in select_rules(skip, only):
        if r.name in skip:
            results.append(RuleResult(r.name, SKIPPED, skip[r.name]))
            continue
        result, backend_name = run_on_fresh_backend(r, factory, close)
        results.append(result)
        name = backend_name if name == "?" else name
    return ConformanceReport(name, tuple(results))
