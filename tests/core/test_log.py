"""Where pagedkv's events go: nowhere on stdout unless asked; warnings and errors on stderr by
default; everything through the application's structlog configuration when it has one."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

from pagedkv.core import log

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"

WORK = """
import numpy as np
from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, RefCountError
gpu = HostBackend(1 << 24)
config = KvCacheConfig(block_size=16, num_kv_heads=1, head_dim=16, num_layers=1, dtype="fp8")
cache = PagedKvCache(config, 4, gpu)                       # info: kv_cache_allocated
blocks = cache.alloc_blocks(2)
slots = np.array([blocks[0] * 16, blocks[1] * 16 + 1], dtype=np.int64)
rows = np.ones((2, 1, 16), np.float32)
cache.write_tokens(0, slots, rows, rows, gpu, 0)           # debug: kv_tokens_written
cache.debug_kv_checksum_per_layer(blocks, 1, gpu, 0, tag="t")  # info: kv_checksum x4 (K, V per region)
cache.free_blocks(blocks)
try:
    cache.dec_ref(blocks[0])                               # error: kv_dec_ref_at_zero
except RefCountError:
    pass
cache.release(gpu)
print("DONE")
"""


def _run(code: str, *flags: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_without_configuration_only_warnings_and_errors_reach_stderr_and_nothing_stdout():
    proc = _run(WORK)
    assert proc.stdout == "DONE\n"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "[error" in lines[0] and "kv_dec_ref_at_zero" in lines[0] and "block=0" in lines[0]


def _readme_enable_line() -> str:
    (line,) = [m for m in re.findall(r"`([^`]*log\.enable\([^`]*\))`", README.read_text())]
    return line


def test_the_readme_line_enables_debug_and_info_on_stderr():
    line = _readme_enable_line()
    assert line == 'import pagedkv.log; pagedkv.log.enable("debug")'
    proc = _run(line + "\n" + WORK)
    assert proc.stdout == "DONE\n"
    events = [re.search(r"\[(\w+)\s*\] (\w+)", l).groups() for l in proc.stderr.splitlines()]
    assert events == [
        ("info", "kv_cache_allocated"), ("debug", "kv_tokens_written"),
        *[("info", "kv_checksum")] * 4, ("error", "kv_dec_ref_at_zero"),
    ]
    assert "layer=0" in proc.stderr and "tokens=2" in proc.stderr  # fields, not formatted strings


def test_enable_refuses_an_unknown_level():
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        log.enable("loud")


PROBE = """
import json
import structlog
from pagedkv import HostBackend, KvCacheConfig, PagedKvCache  # imported before configuring

seen = []
def keep(logger, method, event):
    seen.append({k: event[k] for k in ("event", "component", "blocks")})
    raise structlog.DropEvent

structlog.configure(processors=[keep])
gpu = HostBackend(1 << 20)
PagedKvCache(KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16"), 3, gpu)
print("RESULT " + json.dumps(seen))
"""


def test_configuration_after_import_is_honoured():
    proc = _run(PROBE)
    assert proc.stdout.splitlines() == ["RESULT " + json.dumps([{"event": "kv_cache_allocated", "component": "cache", "blocks": 3}])]
    assert proc.stderr == ""


APPLICATION = """
import structlog
seen = []
def keep(logger, method, event):
    seen.append((method, event["event"], isinstance(event["component"], str)))
    raise structlog.DropEvent
structlog.configure(processors=[keep])
""" + WORK + """
print(seen)
"""


def test_an_application_configuration_gets_every_event_debug_included():
    proc = _run(APPLICATION)
    assert proc.stderr == ""
    assert proc.stdout.splitlines() == ["DONE", str([
        ("info", "kv_cache_allocated", True), ("debug", "kv_tokens_written", True),
        *[("info", "kv_checksum", True)] * 4, ("error", "kv_dec_ref_at_zero", True),
    ])]


def test_the_command_line_logs_to_stderr():
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "--log-level", "debug", "demo", "--layers", "2",
                           "--blocks", "16"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "kv_cache_allocated" not in proc.stdout and "kv_tokens_written" not in proc.stdout
    assert "[info     ] kv_cache_allocated" in proc.stderr and "[debug    ] kv_tokens_written" in proc.stderr
    quiet = subprocess.run([sys.executable, "-m", "pagedkv", "demo", "--layers", "2", "--blocks", "16"],
                           capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and quiet.stderr == ""
