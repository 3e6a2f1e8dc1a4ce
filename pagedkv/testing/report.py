"""The result of a conformance run: one RuleResult per rule and the report over them."""

from __future__ import annotations

from dataclasses import dataclass

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass(frozen=True)
class RuleResult:
    """How one rule went: `status` is "passed", "failed" or "skipped"; `reason` says why
    it failed or was skipped ("" when it passed)."""

    name: str
    status: str
    reason: str = ""

    @property
    def passed(self) -> bool:
        """True when the rule passed."""
        return self.status == PASSED


@dataclass(frozen=True)
class ConformanceReport:
    """Every rule's result, in run order, for the backend named `backend`. `ok` is True
    when no rule failed (skipped rules are not failures)."""

    backend: str
    results: tuple[RuleResult, ...]

    @property
    def ok(self) -> bool:
        """True when no rule failed."""
        return not self.failed

    @property
    def failed(self) -> list[RuleResult]:
        """The failed rules."""
        return [r for r in self.results if r.status == FAILED]

    @property
    def skipped(self) -> list[RuleResult]:
        """The skipped rules."""
        return [r for r in self.results if r.status == SKIPPED]

    def __getitem__(self, name: str) -> RuleResult:
        """The result of the rule `name`; KeyError naming it when there is none."""
        for result in self.results:
            if result.name == name:
                return result
        raise KeyError(f"no conformance rule named {name!r}")

    def summary(self) -> str:
        """One line per rule (status, name, reason) and a total line."""
        lines = [f"{r.status.upper():7} {r.name}" + (f": {r.reason}" if r.reason else "") for r in self.results]
        passed = sum(r.passed for r in self.results)
        lines.append(
            f"{self.backend}: {passed} passed, {len(self.failed)} failed, {len(self.skipped)} skipped"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
