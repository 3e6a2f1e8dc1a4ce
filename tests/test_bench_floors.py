"""tools/bench.py's floors: a missed bound prints MISSED, and --strict turns it into exit status 1."""

from __future__ import annotations

import os
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools")


@pytest.fixture
def bench(monkeypatch, tmp_path):
    """tools/bench.py with one extra section, `fake`, whose figures are given by the test."""
    monkeypatch.syspath_prepend(TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "bench_fake_section.py").write_text(
        "from floors import ceiling, floor\n"
        "FIGURES = {}\n"
        "def run(args):\n"
        "    floor('speedup', FIGURES['speedup'], 5.0)\n"
        "    ceiling('slowdown', FIGURES['slowdown'], 1.1)\n"
    )
    import bench as module
    import bench_fake_section

    monkeypatch.setitem(module.SECTIONS, "fake", ("bench_fake_section", False))
    yield module, bench_fake_section.FIGURES
    sys.modules.pop("bench_fake_section", None)


def test_floors_met_print_ok_and_exit_0_even_when_strict(bench, capsys):
    module, figures = bench
    figures.update(speedup=5.0, slowdown=1.1)
    assert module.main(["--section", "fake", "--strict"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "== fake ==",
        "  floor   speedup: 5.00x, needs >= 5x  ok",
        "  ceiling slowdown: 1.10x, needs <= 1.1x  ok",
    ]


def test_a_missed_floor_prints_missed_and_fails_only_when_strict(bench, capsys):
    module, figures = bench
    figures.update(speedup=4.99, slowdown=1.2)
    assert module.main(["--section", "fake"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == [
        "  floor   speedup: 4.99x, needs >= 5x  MISSED",
        "  ceiling slowdown: 1.20x, needs <= 1.1x  MISSED",
        "MISSED 2 floor(s): speedup; slowdown",
    ]
    assert module.main(["--section", "fake", "--strict"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "MISSED 2 floor(s): speedup; slowdown"


def test_each_run_starts_with_no_missed_floor(bench, capsys):
    module, figures = bench
    figures.update(speedup=1.0, slowdown=1.0)
    assert module.main(["--section", "fake", "--strict"]) == 1
    figures.update(speedup=6.0)
    assert module.main(["--section", "fake", "--strict"]) == 0
    import floors

    assert floors.missed() == []
