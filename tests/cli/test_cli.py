"""The command line: `pagedkv plan` figures, `pagedkv demo` checks, bad arguments, closed pipes."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import structlog

import pagedkv
from pagedkv import HostBackend, KvCacheConfig, KvCacheDtype
from pagedkv.cli import demo as demo_module
from pagedkv.cli import main
from pagedkv.cli.plan import parse_bytes, parse_dims, parse_dtypes, parse_layer_dtypes


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


def test_plan_lists_only_the_formats_that_fit_and_names_the_others(capsys):
    assert main(["plan", "--layers", "1", "--kv-heads", "1", "--head-dim", "3",
                 "--block-size", "3", "--memory", "1GiB"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = _rows("\n".join(lines[:4]))
    assert list(rows) == ["bf16", "fp8"]
    assert rows["bf16"][2] == "12.0"  # 2 sides * 3 elements * 2 bytes
    grouped = ", ".join(str(d) for d in KvCacheDtype if d.is_grouped())
    assert lines[4:] == [f"not listed: {grouped} (layer 0: its format stores 16-element groups within a head "
                         "but head_dim is 3, not a multiple of 16 (a group would straddle two heads))"]


def test_plan_head_dim_100_lists_only_the_ungrouped_formats(capsys):
    assert main(["plan", "--layers", "4", "--kv-heads", "8", "--head-dim", "100", "--memory", "1GiB"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines[2:4]] == ["bf16", "fp8"]
    grouped = [str(d) for d in KvCacheDtype if d.is_grouped()]
    assert lines[4:] == [f"not listed: {', '.join(grouped)} (layer 0: its format stores 16-element groups "
                         "within a head but head_dim is 100, not a multiple of 16 (a group would straddle two heads))"]


@pytest.mark.parametrize("bad, named", [
    (["--memory", "12XB"], "'12XB'"),
    (["--memory", "1GiB", "--dtype", "fp16"], "'fp16'"),
    (["--memory", "1GiB", "--layer-dims", "8by128"], "'8by128'"),
    (["--memory", "1GiB", "--head-dim", "100", "--dtype", "bf16,nvfp4"], "--dtype nvfp4"),
    (["--memory", "1GiB", "--head-dim", "100", "--layer-dtypes", "turbo4"], "layer 0: turbo4 stores 16-element groups"),
    (["--memory", "1GiB", "--layer-dtypes", "bf16,bf16,fp8"], "--layer-dtypes lists 3 formats but --layers is 2"),
    (["--memory", "1GiB", "--layer-dims", "8x64,8x64,8x64"], "--layer-dims lists 3 pairs but --layers is 2"),
    (["--memory", "1GiB", "--layers", "0"], "--layers: must be a positive integer, got '0'"),
    (["--memory", "1GiB", "--kv-heads", "-1"], "--kv-heads: must be a positive integer, got '-1'"),
    (["--memory", "1GiB", "--block-size", "x"], "--block-size: must be a positive integer, got 'x'"),
])
def test_plan_bad_input_is_one_line_on_stderr_and_exit_2(capsys, bad, named):
    assert main(["plan", "--layers", "2", "--kv-heads", "8", "--head-dim", "128", *bad]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("pagedkv plan: ") and named in err and err.count("\n") == 1, err


def test_plan_without_memory_and_gpu_asks_for_it(capsys):
    assert main(["plan", "--layers", "2", "--kv-heads", "8", "--head-dim", "128"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "pagedkv plan: no GPU here to measure free memory; give --memory (e.g. --memory 40GiB)\n"


PLAN_CASES = [
    # (layers, heads, head_dim, block, --layer-dtypes, --layer-dims)
    (80, 8, 128, 16, "bf16,bf16", None),
    (80, 8, 128, 16, "bf16,fp8,bf16,bf16", None),
    (6, 4, 64, 32, "turbo3,turbo3,turbo3,turbo3,turbo3,turbo3", None),
    (5, 8, 128, 16, "fp8,fp8,nvfp4", "4x256,4x256"),
    (3, 2, 256, 8, None, "8x128,8x128,8x128"),
]


@pytest.mark.parametrize("layers, heads, head_dim, block, layer_dtypes, layer_dims", PLAN_CASES)
def test_every_plan_row_is_the_configs_bytes(capsys, layers, heads, head_dim, block, layer_dtypes, layer_dims):
    memory = 40 * 2**30
    argv = ["plan", "--layers", str(layers), "--kv-heads", str(heads), "--head-dim", str(head_dim),
            "--block-size", str(block), "--memory", "40GiB"]
    argv += ["--layer-dtypes", layer_dtypes] if layer_dtypes else []
    argv += ["--layer-dims", layer_dims] if layer_dims else []
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert list(rows) == [str(d) for d in KvCacheDtype]
    dims = tuple(tuple(int(x) for x in pair.split("x")) for pair in layer_dims.split(",")) if layer_dims else ()
    for name, row in rows.items():
        config = KvCacheConfig(block_size=block, num_kv_heads=heads, head_dim=head_dim, num_layers=layers,
                               dtype=name, layer_dtypes=tuple(layer_dtypes.split(",")) if layer_dtypes else (),
                               layer_dims=dims)
        per_block = config.block_bytes_kv_all_layers()
        assert row[2:5] == [f"{per_block / block:,.1f}", f"{memory // per_block:,}", f"{memory // per_block * block:,}"], name


def test_plan_keeps_repeated_layer_formats_and_shows_them(capsys):
    assert main(["plan", "--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--memory", "40GiB",
                 "--dtype", "turbo4", "--layer-dtypes", "bf16,bf16"]) == 0
    out = capsys.readouterr().out
    # 2 bf16 layers (2 * 8 * 128 * 2 * 2 = 8192 B/token) + 78 turbo4 layers (2 * 1024 * 4.5 / 8 = 1152 each)
    assert _rows(out)["turbo4"][2] == "98,048.0"
    assert out.splitlines()[0].endswith("; layer formats 0-1 bf16, 2-79 the row's")


def test_parsers():
    assert parse_bytes("40GiB") == 40 * 2**30
    assert parse_bytes("1.5TB") == 1_500_000_000_000
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("2G") == 2 * 2**30
    assert parse_bytes("1000") == 1000
    assert parse_dims("8x128, 4x256") == ((8, 128), (4, 256))
    assert parse_dtypes(["bf16,turbo4k3v", "bf16"]) == [KvCacheDtype.BF16, KvCacheDtype.TURBO4K_TURBO3V]
    assert parse_dtypes(None) == list(KvCacheDtype)
    assert parse_layer_dtypes("bf16, bf16,fp8k3v") == (KvCacheDtype.BF16, KvCacheDtype.BF16, KvCacheDtype.FP8K_TURBO3V)
    with pytest.raises(ValueError, match="empty format name in 'bf16,,fp8'"):
        parse_layer_dtypes("bf16,,fp8")
    for bad in ("", "GiB", "-1GiB", "1 parsec"):
        with pytest.raises(ValueError, match="not a memory size"):
            parse_bytes(bad)


def test_demo_passes_on_host(capsys):
    assert main(["demo", "--layers", "2", "--blocks", "16"]) == 0
    out = capsys.readouterr().out
    assert "on HostBackend" in out
    assert "[FAIL]" not in out
    assert out.rstrip().splitlines()[-1].startswith("demo: 11 passed, 0 failed")


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


@pytest.mark.parametrize("bad, named", [
    (["--layers", "0"], "--layers: must be a positive integer, got '0'"),
    (["--blocks", "-5"], "--blocks: must be a positive integer, got '-5'"),
    (["--layers", "1000"], "--layers 1000 --blocks 128 need 7.81 GiB for the demo cache but the backend has 4.00 GiB free"),
])
def test_demo_bad_arguments_are_one_line_on_stderr_and_exit_2(monkeypatch, capsys, bad, named):
    host = HostBackend(capacity_bytes=4 << 30)
    monkeypatch.setattr(demo_module, "best_backend", lambda: (host, "HostBackend"))
    assert main(["demo", *bad]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("pagedkv demo: ") and named in err and err.count("\n") == 1, err
    assert host.live_allocations() == 0


def test_demo_skips_the_checks_that_need_a_failed_one(capsys):
    assert main(["demo", "--layers", "2", "--blocks", "1"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "  [FAIL] allocate and share: KvCacheExhausted: asked for 4 block(s) but 1 of 1 are free"
    assert lines[3:6] == [
        "  [skip] write and read back: needs 'allocate and share', which did not pass",
        "  [skip] checksum diagnostics: needs 'write and read back', which did not pass",
        "  [skip] poison and free: needs 'allocate and share', which did not pass",
    ]
    assert sum("[FAIL]" in line for line in lines) == 1 and not any("KeyError" in line for line in lines)
    assert lines[-1].startswith("demo: 7 passed, 1 failed, 3 skipped")


def test_demo_into_a_closed_pipe_ends_quietly():
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line: every write meets a closed pipe
    try:
        proc = subprocess.run([sys.executable, "-m", "pagedkv", "demo", "--layers", "2", "--blocks", "16"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.stderr == ""
    assert proc.returncode == 0


def test_demo_runs_with_assertions_off():
    proc = subprocess.run([sys.executable, "-O", "-m", "pagedkv", "demo", "--layers", "2", "--blocks", "16"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("demo: 11 passed, 0 failed")


def test_no_assert_statement_in_the_package():
    root = pathlib.Path(pagedkv.__file__).parent
    found = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Assert)
    ]
    assert found == []


def test_help_exits_0_and_no_subcommand_exits_2(capsys):
    assert main(["plan", "--help"]) == 0
    assert "--layer-dtypes" in capsys.readouterr().out
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("pagedkv: ") and err.count("\n") == 1


def test_main_leaves_structlog_as_it_found_it(capsys):
    structlog.reset_defaults()
    assert main(["plan", "--layers", "1", "--kv-heads", "1", "--head-dim", "16", "--memory", "1MiB"]) == 0
    assert not structlog.is_configured()
    structlog.configure(processors=[structlog.processors.JSONRenderer()])
    assert main(["plan", "--layers", "1", "--kv-heads", "1", "--head-dim", "16", "--memory", "1MiB"]) == 0
    assert structlog.is_configured()
    assert isinstance(structlog.get_config()["processors"][0], structlog.processors.JSONRenderer)


class _OptimisticBackend(HostBackend):
    """A HostBackend that reports more free memory than it has: the allocation itself fails."""

    def mem_info(self):
        return 1 << 40, 1 << 40


def test_demo_cache_that_fails_to_allocate_is_a_usage_error_and_frees_what_it_took(monkeypatch, capsys):
    host = _OptimisticBackend(capacity_bytes=8 << 20)
    monkeypatch.setattr(demo_module, "best_backend", lambda: (host, "HostBackend"))
    assert main(["demo", "--layers", "4", "--blocks", "64"]) == 2  # 4 x 64 x 2 sides x 32 KiB = 16 MiB
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("pagedkv demo: --layers 4 --blocks 64: HostBackend out of memory") and err.count("\n") == 1, err
    assert host.live_allocations() == 0


def test_demo_reports_a_later_cache_that_does_not_fit_as_a_failed_check(monkeypatch, capsys):
    host = HostBackend(capacity_bytes=8 << 20)  # the main cache (4 x 32 x 2 x 32 KiB) takes all of it
    monkeypatch.setattr(demo_module, "best_backend", lambda: (host, "HostBackend"))
    assert main(["demo", "--layers", "4", "--blocks", "32"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "  [FAIL] prefix reuse: DeviceOutOfMemory: HostBackend out of memory: asked 524288 bytes (0.00 GiB), " \
           "0 bytes (0.00 GiB) free of 8388608" in lines
    assert "  [skip] fork and copy-on-write: needs 'prefix reuse', which did not pass" in lines
    assert "  [ok]   nothing leaked: HostBackend reports 0 live allocations" in lines
    assert host.live_allocations() == 0


def test_quality_prints_each_format_as_it_is_measured_and_a_bad_size_is_refused(capsys, monkeypatch):
    from pagedkv.cli import quality as quality_module
    from pagedkv.kv.quality import quality_rows as real_rows

    seen = []

    def rows(*args, **kwargs):
        for row in real_rows(*args, **kwargs):
            seen.append(capsys.readouterr().out.count("\n"))  # lines already out before this row is given
            yield row

    monkeypatch.setattr(quality_module, "quality_rows", rows)
    assert main(["quality", "--tokens", "16", "--heads", "1", "--head-dim", "16"]) == 0
    assert seen[0] == 3 and seen[1:] == [1] * (len(seen) - 1)  # description and head, then one row at a time
    assert main(["quality", "--tokens", "1"]) == 2
    assert main(["quality", "--tokens", "10000001"]) == 2
    assert main(["quality", "--heads", "8193", "--head-dim", "128"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("pagedkv quality: argument --tokens: must be an integer from 2 to 10,000,000")
    assert err[1].startswith("pagedkv quality: argument --tokens: must be an integer from 2 to 10,000,000")
    assert ", got '10000001'" in err[1]
    assert err[2] == ("pagedkv quality: --heads 8193 x --head-dim 128 is 1,048,704 values a token, over the "
                      "1,048,576 of one chunk of work")


def test_an_output_that_cannot_be_written_is_one_line_on_stderr_and_status_1():
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "plan", "--layers", "2", "--kv-heads", "1",
                           "--head-dim", "16", "--memory", "1GiB"], stdout=open("/dev/full", "w"),
                          stderr=subprocess.PIPE, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (1, "pagedkv plan: cannot write the output: No space left on device\n")


QUALITY_SMALL = ["quality", "--tokens", "10", "--heads", "1", "--head-dim", "16"]


def _quality_progress_lines():
    from pagedkv import KvCacheDtype

    names = ["reference"] + [str(f) for f in KvCacheDtype]
    return [[f"pagedkv quality: {name} ({step}/17): {done}/10 tokens" for done in (4, 8, 10)]
            for step, name in enumerate(names, 1)]


def test_quality_progress_goes_to_stderr_one_line_per_chunk_with_progress(capsys, monkeypatch):
    import pagedkv.kv.quality as quality

    monkeypatch.setattr(quality, "CHUNK_ELEMENTS", 64)  # chunks of 4 tokens: 4, 8, 10 done per pass
    assert main(QUALITY_SMALL) == 0
    plain = capsys.readouterr()
    assert plain.err == ""  # not a terminal and no --progress: nothing on stderr
    assert main([*QUALITY_SMALL, "--progress"]) == 0
    out, err = capsys.readouterr()
    assert out == plain.out  # stdout is the table alone
    assert err.splitlines() == [line for lines in _quality_progress_lines() for line in lines]


def test_quality_progress_on_a_terminal_is_one_line_rewritten_and_erased_before_each_row(capsys, monkeypatch):
    import io

    import pagedkv.kv.quality as quality

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(quality, "CHUNK_ELEMENTS", 64)
    assert main(QUALITY_SMALL) == 0
    plain = capsys.readouterr().out
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(QUALITY_SMALL) == 0
    erase = "\r\x1b[K"
    reference, *formats = _quality_progress_lines()
    want = "".join(erase + line for line in reference) + "".join(
        "".join(erase + line for line in lines) + erase for lines in formats)
    assert terminal.getvalue() == want
    assert capsys.readouterr().out == plain


def test_quality_tier_progress_names_each_pairing(capsys, monkeypatch):
    import pagedkv.kv.quality as quality

    monkeypatch.setattr(quality, "CHUNK_ELEMENTS", 160)  # one chunk of 10 tokens a pass
    assert main([*QUALITY_SMALL, "--tier", "--progress"]) == 0
    out, err = capsys.readouterr()
    err = err.splitlines()
    pairings = [line.split()[:2] for line in out.splitlines()[4:]]
    steps = len(pairings) + 2
    assert err[0] == f"pagedkv quality: bf16 reference (1/{steps}): 10/10 tokens"
    assert err[1] == f"pagedkv quality: bf16 -> {pairings[0][1]} (2/{steps}): 10/10 tokens"
    assert len(err) == steps and err[-1].endswith(f"({steps}/{steps}): 10/10 tokens")
