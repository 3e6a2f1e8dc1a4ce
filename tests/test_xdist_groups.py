"""`--dist loadgroup` (pyproject's addopts) keeps an xdist_group's tests in one worker: the
scheduler groups on the `@name` suffix of their node ids (conftest.py writes it where
pytest-xdist's own write no longer reaches pytest 9.2's node ids)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("xdist_group_check")


def test_a_grouped_test_carries_its_group_to_the_scheduler(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not an xdist worker under --dist loadgroup")
    assert request.node.nodeid == "tests/test_xdist_groups.py::" \
        "test_a_grouped_test_carries_its_group_to_the_scheduler@xdist_group_check"


@pytest.mark.xdist_group("second")
def test_two_groups_join_into_one_sorted(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not an xdist worker under --dist loadgroup")
    assert request.node.nodeid.endswith("::test_two_groups_join_into_one_sorted@second_xdist_group_check")
