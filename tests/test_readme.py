"""The README's example and commands stay true."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_example_runs():
    example = _blocks("python")[0]
    namespace: dict = {}
    exec(compile(example, str(README), "exec"), namespace)
    cache, gpu = namespace["cache"], namespace["gpu"]
    assert cache.num_blocks() == 0  # released
    assert gpu.live_allocations() == 0


def test_readme_torch_example_runs():
    pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[interop]'")
    (example,) = _blocks("python")[1:]
    namespace: dict = {}
    exec(compile(example, str(README), "exec"), namespace)
    assert namespace["cache"].num_blocks() == 0 and namespace["gpu"].live_allocations() == 0


def test_readme_test_command_is_what_ci_runs():
    commands = [b.strip() for b in _blocks("")]
    assert commands[1] == ".venv/bin/python -m pytest -q"
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci
