"""HostBackend against the published conformance suite (pagedkv.testing): the three lines
a backend author writes."""

from pagedkv import HostBackend
from pagedkv.testing import conformance_tests

globals().update(conformance_tests(lambda: HostBackend(capacity_bytes=1 << 26)))
