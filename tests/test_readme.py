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


def test_the_test_command_runs_two_workers_from_the_test_extra():
    """The README: the test command runs in two pytest-xdist workers, installed by `test`."""
    import os

    pyproject = (README.parent / "pyproject.toml").read_text()  # no tomllib on Python 3.10
    assert re.search(r'^addopts = "-n 2 --dist loadgroup"$', pyproject, flags=re.M)
    assert re.search(r'^test = \[.*"pytest-xdist>=3".*\]$', pyproject, flags=re.M)
    assert "two worker processes" in README.read_text()
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        pytest.skip("this run was started with -n 0 (or -o addopts=): not in an xdist worker")
    assert os.environ["PYTEST_XDIST_WORKER_COUNT"] == "2"


def _command_line_section() -> str:
    text = README.read_text()
    return text[text.index("## Command line"):text.index("## Tests")]


def test_readme_command_line_examples_do_what_it_says(monkeypatch, capsys):
    from pagedkv import HostBackend
    from pagedkv.cli import demo, main

    monkeypatch.setattr(demo, "best_backend", lambda: (HostBackend(capacity_bytes=4 << 30), "HostBackend"))

    section = _command_line_section()
    (plan,) = re.findall(r"`pagedkv (plan [^`]*)`", section)
    assert main(plan.split()) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[:4] == ["bf16", "16", "16", "131,072.0"]
    assert main(["--log-level", "debug", "plan", "--layers", "1", "--kv-heads", "1", "--head-dim", "16",
                 "--memory", "1MiB", "--dtype", "bf16"]) == 0
    capsys.readouterr()
    for bad in (["plan", "--layers", "0", "--kv-heads", "8", "--head-dim", "128", "--memory", "1GiB"],
                ["plan", "--layers", "2", "--kv-heads", "8", "--head-dim", "100", "--dtype", "nvfp4", "--memory", "1GiB"],
                ["demo", "--layers", "1000"]):
        assert main(bad) == 2, bad
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1


def test_the_architecture_table_names_every_folder_and_only_real_paths():
    text = README.read_text()
    table = text[text.index("## Architecture"):]
    table = table[: table.index("\n\n", table.index("| path |"))]
    rows = "\n".join(line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `"))
    named = re.findall(r"`((?:pagedkv|tools|tests)/[^`]*)`", rows)
    assert "pagedkv/core/" in named and "pagedkv/sequences/" in named
    missing = [p for p in named if not (README.parent / p).exists()]
    assert missing == []
    package = README.parent / "pagedkv"
    parts = [f"pagedkv/{m.name}" for m in package.glob("*.py") if m.name not in ("__init__.py", "__main__.py")]
    parts += [f"pagedkv/{d.name}/" for d in package.iterdir() if d.is_dir() and d.name != "__pycache__"]
    assert sorted(p for p in parts if p not in named) == []
