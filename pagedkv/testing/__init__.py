"""pagedkv.testing: the conformance suite for GpuBackend implementations.

`backend_conformance(factory)` runs every rule on fresh backends from `factory` and
returns a `ConformanceReport` (`report.ok`, each rule passed, failed with the reason, or
skipped); `conformance_tests(factory)` gives the same rules as pytest test functions:

    from pagedkv.testing import conformance_tests
    from my_engine import MyBackend
    globals().update(conformance_tests(MyBackend))

`RULES` lists them (name, contract, capabilities needed): the protocol rules, then the
cache's behaviour over the backend. Importing this package does not import pytest.

May import: `pagedkv.events`, `pagedkv.sequences`, `pagedkv.tiers`, `pagedkv.cache`, `pagedkv.groups`, `pagedkv.kv`,
`pagedkv.interop`, `pagedkv.driver`, `pagedkv.backends`, `pagedkv.codecs`, `pagedkv.core`,
`pagedkv.errors`.
"""

from .pytest_entry import conformance_tests
from .registry import RULES, ConformanceFailure, Rule
from .report import ConformanceReport, RuleResult
from .runner import backend_conformance

__all__ = ["RULES", "ConformanceFailure", "ConformanceReport", "Rule", "RuleResult", "backend_conformance", "conformance_tests"]
