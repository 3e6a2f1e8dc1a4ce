"""The README's example and commands stay true."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_example_runs():
    (example,) = _blocks("python")
    namespace: dict = {}
    exec(compile(example, str(README), "exec"), namespace)
    cache, gpu = namespace["cache"], namespace["gpu"]
    assert cache.num_blocks() == 0  # released
    assert gpu.live_allocations() == 0


def test_readme_test_command_is_what_ci_runs():
    commands = [b.strip() for b in _blocks("")]
    assert commands[1] == ".venv/bin/python -m pytest -q"
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci


def test_every_path_in_the_layout_table_exists():
    text = README.read_text()
    table = text[text.index("## Layout"):]
    rows = "\n".join(line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `"))
    named = re.findall(r"`((?:pagedkv|tools)/[^`]*)`", rows)
    assert "pagedkv/allocator.py" in named and "pagedkv/kv_rows.py" in named
    missing = [p for p in named if not (README.parent / p).exists()]
    assert missing == []
