"""docs/EVENTS.md's router example runs as written."""

from __future__ import annotations

import pathlib
import re

import pytest


def test_the_router_example_runs():
    pytest.importorskip("zmq", reason="pyzmq is not installed (the events extra)")
    pytest.importorskip("msgpack", reason="msgpack is not installed (the events extra)")
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "EVENTS.md").read_text()
    (example,) = re.findall(r"```py\n(.*?)```", doc, flags=re.S)
    namespace: dict = {}
    exec(compile(example, "docs/EVENTS.md", "exec"), namespace)
    assert namespace["gpu"].live_allocations() == 0
    assert len(namespace["known"]) >= 3
