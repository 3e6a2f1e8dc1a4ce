#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: the cuda-marked tests, then every GPU
# benchmark section with its floors (issue 19's among them), the decode step's host time on
# the real driver, the traffic model's table beside them (what the CPU predicted), and, when
# Nsight Compute is installed, its sector and occupancy counters of the KV kernels. Installs nothing from the network: wheels the machine lacks
# (structlog, hypothesis) are taken from ./.whl when that directory exists; pytest-xdist is
# not needed (-o addopts="" runs the tests in one process). The repository
# root goes on PYTHONPATH, so no install of pagedkv itself is needed. Exit status is
# non-zero when a test fails or a benchmark floor is missed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
SITE="${PAGEDKV_GPU_SITE:-/tmp/site}"

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" .whl/*.whl
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export PAGEDKV_KERNEL_CACHE="${PAGEDKV_KERNEL_CACHE:-/tmp/pagedkv-kernel-cache}"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
if ! "$PYTHON" -c "import sys, pagedkv.driver as d; sys.exit(0 if d.is_available() else 1)"; then
    echo "gpu_check: no usable NVIDIA GPU here (pagedkv.driver.is_available() is False)" >&2
    exit 2
fi

status=0
echo "== pytest -m cuda =="
timeout 240 "$PYTHON" -m pytest -q -o addopts="" -m cuda -p no:cacheprovider -rs tests || status=$?
echo "== tools/bench.py --gpu =="
# floors: batched fill >= 50x the per-layer memset loop at 256 blocks; fill >= 80%, copy and
# checksum >= 75% of the DRAM bandwidth one large cuMemcpyDtoD measures (read + write counted);
# the kv section's KV write/checksum floors and the tier section's swap >= 80% of a pinned copy
strict=()
if grep -q -- '--strict' tools/bench.py; then strict=(--strict); fi  # bench.py with tools/floors.py
timeout 300 "$PYTHON" tools/bench.py --gpu "${strict[@]}" || status=$?
echo "== tools/bench.py --gpu --section step (host time of a decode step, real driver) =="
timeout 120 "$PYTHON" tools/bench.py --gpu --section step "${strict[@]}" || status=$?
echo "== tools/bench.py --section model (the CPU traffic model: compare with the figures above) =="
timeout 600 "$PYTHON" tools/bench.py --section model --quick || true
if command -v ncu > /dev/null; then
    echo "== ncu: sector efficiency, bytes in flight and occupancy of the KV and checksum kernels =="
    timeout 300 ncu --kernel-name regex:'pagedkv_(kv|reduce)' --launch-count 24 \
        --metrics l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        "$PYTHON" tools/bench.py --gpu --section kv --quick || true
fi
exit "$status"
