"""pagedkv's events follow the application's structlog configuration, even one made after import."""

import json
import subprocess
import sys

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
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["RESULT " + json.dumps([{"event": "kv_cache_allocated", "component": "cache", "blocks": 3}])]
