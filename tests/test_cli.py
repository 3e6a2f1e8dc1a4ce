"""The command line: `pagedkv plan` figures and `pagedkv demo` checks."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import structlog

from pagedkv import HostBackend, KvCacheDtype
from pagedkv import demo as demo_module
from pagedkv.cli import main
from pagedkv.plan import parse_bytes, parse_dims, parse_dtypes


@pytest.fixture(autouse=True)
def _reset_structlog():
    """`main` configures structlog's level filter; undo it so other tests see the defaults."""
    yield
    structlog.reset_defaults()


def _rows(out: str) -> dict[str, list[str]]:
    lines = out.strip().splitlines()
    return {line.split()[0]: line.split()[1:] for line in lines[2:]}


def test_plan_table_figures(capsys):
    assert main(["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                 "--block-size", "16", "--memory", "40GiB"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert list(rows) == [str(d) for d in KvCacheDtype]
    # bf16: 32 layers * 2 sides * 8 heads * 128 * 2 bytes = 131072 bytes per token
    assert rows["bf16"] == ["16", "16", "131,072.0", "20,480", "327,680", "1.00x"]
    # turbo3: 3/8 + 1/16 bytes per element -> 28672 bytes per token; 40 GiB / (16 * 28672) blocks
    assert rows["turbo3"] == ["3.5", "3.5", "28,672.0", "93,622", "1,497,952", "4.57x"]
    assert rows["bf16k_turbo4v"][:3] == ["16", "4.5", "83,968.0"]


def test_plan_selected_dtypes_and_layers(capsys):
    assert main(["plan", "--layers", "2", "--kv-heads", "4", "--head-dim", "64", "--memory", "1MiB",
                 "--dtype", "fp8,turbo4k3v", "--dtype", "fp8", "--layer-dtypes", "bf16",
                 "--layer-dims", "2x128"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert list(rows) == ["fp8", "turbo4k_turbo3v"]
    # layer 0 is bf16 2x128 (2*2*256*16 = 16384 B/block), layer 1 fp8 4x64: 2*256*16 = 8192
    assert rows["fp8"][2:5] == [f"{(16384 + 8192) / 16:,.1f}", "42", "672"]


def test_plan_invalid_format_row_says_why(capsys):
    assert main(["plan", "--layers", "1", "--kv-heads", "1", "--head-dim", "3",
                 "--block-size", "3", "--memory", "1GiB", "--dtype", "bf16,nvfp4"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["bf16"][2] == "12.0"  # 2 sides * 3 elements * 2 bytes
    assert rows["nvfp4"][2] == "n/a" and "not a multiple of 16" in " ".join(rows["nvfp4"])


@pytest.mark.parametrize("bad", [["--memory", "12XB"], ["--memory", "1GiB", "--dtype", "fp16"],
                                 ["--memory", "1GiB", "--layer-dims", "8by128"]])
def test_plan_bad_input_exits_2(capsys, bad):
    assert main(["plan", "--layers", "2", "--kv-heads", "8", "--head-dim", "128", *bad]) == 2
    out = capsys.readouterr().out
    assert out.startswith("pagedkv plan: ") and bad[-1] in out


def test_plan_without_memory_and_gpu_asks_for_it(capsys):
    assert main(["plan", "--layers", "2", "--kv-heads", "8", "--head-dim", "128"]) == 2
    assert "give --memory" in capsys.readouterr().out


def test_parsers():
    assert parse_bytes("40GiB") == 40 * 2**30
    assert parse_bytes("1.5TB") == 1_500_000_000_000
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("2G") == 2 * 2**30
    assert parse_bytes("1000") == 1000
    assert parse_dims("8x128, 4x256") == ((8, 128), (4, 256))
    assert parse_dtypes(["bf16,turbo4k3v", "bf16"]) == [KvCacheDtype.BF16, KvCacheDtype.TURBO4K_TURBO3V]
    assert parse_dtypes(None) == list(KvCacheDtype)
    for bad in ("", "GiB", "-1GiB", "1 parsec"):
        with pytest.raises(ValueError, match="not a memory size"):
            parse_bytes(bad)


def test_demo_passes_on_host(capsys):
    assert main(["demo", "--layers", "2", "--blocks", "16"]) == 0
    out = capsys.readouterr().out
    assert "on HostBackend" in out
    assert "[FAIL]" not in out
    assert out.rstrip().splitlines()[-1].startswith("demo: 10 passed, 0 failed")


class _BitFlippingBackend(HostBackend):
    """A HostBackend whose device-to-host copies flip one bit: the demo must notice."""

    def copy_d2h(self, src, dst):
        super().copy_d2h(src, dst)
        np.frombuffer(memoryview(dst).cast("B"), dtype=np.uint8)[0] ^= 1


def test_demo_fails_when_the_backend_corrupts(monkeypatch, capsys):
    monkeypatch.setattr(demo_module, "best_backend", lambda: (_BitFlippingBackend(1 << 30), "flipper"))
    assert main(["demo", "--layers", "2", "--blocks", "16"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] write and read back" in out
    assert "[FAIL] poison and free" in out


def test_python_m_pagedkv_runs():
    result = subprocess.run([sys.executable, "-m", "pagedkv", "plan", "--layers", "1", "--kv-heads", "1",
                             "--head-dim", "16", "--memory", "1MiB", "--dtype", "bf16"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "bf16" in result.stdout.splitlines()[2]


def test_parse_bytes_is_exact_and_refuses_less_than_a_byte():
    assert parse_bytes("40.3GiB") == 403 * 2**30 // 10
    assert parse_bytes("0.5KiB") == 512
    for bad in ("0", "0.1B", "0.0001KB"):
        with pytest.raises(ValueError, match="less than one byte"):
            parse_bytes(bad)
