"""docs/BACKENDS.md stays true: its example runs, the backend example passes through the
three-line pytest entry, and the capability table is what the backends state."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

from pagedkv import HostBackend
from pagedkv.backends.capabilities import CAPABILITIES
from pagedkv.testing import conformance_tests

ROOT = pathlib.Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "BACKENDS.md"
sys.path.insert(0, str(ROOT / "docs" / "examples"))

from engine_heap_backend import EngineHeap, EngineHeapBackend  # noqa: E402

globals().update(conformance_tests(lambda: EngineHeapBackend(EngineHeap(16 << 20)), prefix="test_example_backend_"))


def test_the_guide_example_runs(monkeypatch):
    monkeypatch.chdir(ROOT)
    (example,) = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    namespace: dict = {}
    exec(compile(example, str(GUIDE), "exec"), namespace)
    assert namespace["report"].ok and namespace["report"].backend == "EngineHeapBackend"


def test_the_three_lines_in_the_guide_are_the_entry_point():
    (lines,) = re.findall(r"```\n(from pagedkv.testing.*?)```", GUIDE.read_text(), flags=re.S)
    assert lines.strip().splitlines() == [
        "from pagedkv.testing import conformance_tests",
        "from my_engine import MyBackend",
        "globals().update(conformance_tests(lambda: MyBackend(device=0)))",
    ]



def test_the_capability_tables_match_the_code():
    text = GUIDE.read_text()
    names = re.findall(r'^\| `"([a-z_:]+)"`', text, flags=re.M)
    names += re.findall(r'^\| `"device:cpu"`, `"(device:cuda)"`, `"(device:rocm)"`', text, flags=re.M)[0]
    assert sorted(set(names) | {"device:cpu"}) == sorted(CAPABILITIES)
    stated = dict(re.findall(r"^\| (HostBackend|CudaBackend|TorchArenaBackend|the example below) \| ([^|]+) \|$", text, flags=re.M))
    from pagedkv.driver import CudaBackend

    expected = {
        "HostBackend": HostBackend().SUPPORTED,
        "CudaBackend": CudaBackend.SUPPORTED,
        "the example below": {n for n in CAPABILITIES if EngineHeapBackend(EngineHeap(1 << 12)).supports(n)},
    }
    try:
        from pagedkv.backends.torch_arena import TorchArenaBackend

        expected["TorchArenaBackend"] = TorchArenaBackend.SUPPORTED
    except ImportError:
        pytest.skip("torch is not installed")
    for backend, names in expected.items():
        assert set(stated[backend].strip().split(", ")) == set(names), backend
