"""HostBackend against the published conformance suite (pagedkv.testing), the three lines
a backend author writes (plus the rules not passed yet, tests/conformance_pending.py)."""

from conformance_pending import PENDING
from pagedkv import HostBackend
from pagedkv.testing import conformance_tests

globals().update(conformance_tests(lambda: HostBackend(capacity_bytes=1 << 26), skip=PENDING))
