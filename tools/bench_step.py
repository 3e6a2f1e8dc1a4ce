"""Step section of tools/bench.py (`--section step`): the host time of an engine's decode
step on CudaBackend, the Python a step pays before the GPU does anything.

Measured without a GPU over the libcuda stub (tests/stub_libcuda, kernels on the CPU
harness), in a subprocess, since only host time is timed: each figure is the wall time of
enqueueing the calls, with the queue drained (kernels run on the CPU) outside the timing.
With `--gpu` on a machine with CUDA the same body runs on the real driver instead.

Printed side by side:
- the stub's own cost of one `cuLaunchKernel` through cuda-bindings (prepared arguments): the
  floor no Python path goes below;
- one layer's `cache.write_tokens` and `cache.read_tokens` with device rows and slots
  (DeviceArray), as an engine calls them per layer;
- a 32-layer decode step of per-layer calls (a write and a read per layer);
- the same step as one write and one read for every layer (`plan_layer_writes` /
  `plan_layer_reads`, when the checkout has them);
- BASELINE: the figures of main at 58d2f8c (before issue 19), measured on this 2-core CPU VM
  the same way, kept here so every run prints its ratio against them.

Ceilings (issue 19): one layer call <= 15 us, a 32-layer step <= 40 us (outside a graph).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from floors import ceiling

LAYERS, HEADS, HEAD_DIM, BLOCK, TOKENS = 32, 8, 128, 16, 8
LAYER_CEILING_US = 15.0
STEP_CEILING_US = 40.0
BASELINE_US = {"write_layer": 101.6, "read_layer": 92.9, "step_per_layer_calls": 6912.3}
"""main at 58d2f8c over the stub on the 2-core CI VM (tools/bench.py --section step, the
median of three runs; see the issue 19 note): write_tokens and read_tokens of one layer, and
a 32-layer step of per-layer calls (runs read 101.6/124.0/70.2, 92.9/117.8/69.1 and
6912/7639/4350 us: the VM is shared and noisy). Replaced only by a new measurement of that commit."""

REPO = Path(__file__).resolve().parent.parent

BODY = r'''
import ctypes, json, time
import numpy as np
from pagedkv import DeviceArray, KvCacheConfig, PagedKvCache
from pagedkv.driver import CudaBackend
from pagedkv.driver._bindings import driver

LAYERS, HEADS, HEAD_DIM, BLOCK, TOKENS, REPS = {LAYERS}, {HEADS}, {HEAD_DIM}, {BLOCK}, {TOKENS}, {REPS}

def per_call_us(fn, calls, drain):
    """Median over rounds of the wall time per call of `calls` enqueues (drained untimed)."""
    rounds = []
    for _ in range(REPS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        drain()
    return sorted(rounds)[len(rounds) // 2]

out = {{}}
with CudaBackend() as gpu:
    stream = gpu.create_stream()
    drain = lambda: gpu.synchronize(stream)
    # the stub's own launch: one prepared cuLaunchKernel of the fill kernel with 0 blocks
    fill = gpu._launchers["pagedkv_fill_blocks"]
    fill.args.num_rows, fill.args.num_blocks = 0, 0
    addr = ctypes.addressof(fill.pointers)
    raw = lambda: driver.cuLaunchKernel(fill.function, 1, 1, 1, fill.threads, 1, 1, 0, stream, addr, 0)
    out["raw_launch"] = per_call_us(raw, 200, drain)
    config = KvCacheConfig(block_size=BLOCK, num_kv_heads=HEADS, head_dim=HEAD_DIM, num_layers=LAYERS, dtype="bf16")
    cache = PagedKvCache(config, 64, gpu)
    cache.alloc_blocks(8)
    row_bytes = TOKENS * HEADS * HEAD_DIM * 2
    bufs = [gpu.alloc(row_bytes) for _ in range(2 * LAYERS + 2)]
    gpu.memset(bufs[0], 0, row_bytes * 1) if hasattr(gpu, "memset") else None
    rows = [DeviceArray(b, (TOKENS, HEADS, HEAD_DIM), "bfloat16") for b in bufs]
    ks, vs, out_k, out_v = rows[:LAYERS], rows[LAYERS:2 * LAYERS], rows[-2], rows[-1]
    for r in rows:
        gpu.copy_h2d(np.zeros(row_bytes, np.uint8), r.ptr)
    slot_ptr = gpu.alloc(8 * TOKENS)
    gpu.copy_h2d(np.arange(TOKENS, dtype=np.int64), slot_ptr)
    slots = DeviceArray(slot_ptr, (TOKENS,), "int64")
    write = lambda: cache.write_tokens(0, slots, ks[0], vs[0], gpu, stream)
    read = lambda: cache.read_tokens(0, slots, gpu, out_k=out_k, out_v=out_v, stream=stream)
    write(); read(); drain()
    out["write_layer"] = per_call_us(write, 64, drain)
    out["read_layer"] = per_call_us(read, 64, drain)
    def step():
        for layer in range(LAYERS):
            cache.write_tokens(layer, slots, ks[layer], vs[layer], gpu, stream)
            cache.read_tokens(layer, slots, gpu, out_k=out_k, out_v=out_v, stream=stream)
    out["step_per_layer_calls"] = per_call_us(step, 2, drain)
    if hasattr(cache, "plan_layer_reads"):
        layers = list(range(LAYERS))
        wplan = cache.plan_layer_writes(layers, ks, vs, gpu)
        rplan = cache.plan_layer_reads(layers, [out_k] * LAYERS, [out_v] * LAYERS, gpu)
        def planned():
            wplan.write(slots, stream)
            rplan.read(slots, stream)
        planned(); drain()
        out["step_planned"] = per_call_us(planned, 32, drain)
        wplan.close(); rplan.close()
    drain()
    for b in bufs:
        gpu.free(b)
    gpu.free(slot_ptr)
    cache.release(gpu)
    gpu.destroy_stream(stream)
print("STEP " + json.dumps(out))
'''


def _stub_env(tmp: Path) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from kernel_harness.stub import make_stub_env

    return make_stub_env(tmp / "stub", tmp / "kernel_cache")


def measure(on_gpu: bool, reps: int) -> dict:
    """The figures (microseconds) of BODY, run on the real driver (`on_gpu`) or over the stub."""
    body = BODY.format(LAYERS=LAYERS, HEADS=HEADS, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK, TOKENS=TOKENS, REPS=reps)
    with tempfile.TemporaryDirectory(prefix="pagedkv-step-") as tmp:
        env = dict(os.environ) if on_gpu else _stub_env(Path(tmp))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], env=env, capture_output=True,
                              text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"step bench failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("STEP "))
    return json.loads(line[5:])


def run(args) -> None:
    """Measure and print the step section."""
    from pagedkv.driver import is_available

    on_gpu = bool(getattr(args, "gpu", False)) and is_available()
    reps = 3 if getattr(args, "quick", False) else 7
    fig = measure(on_gpu, reps)
    where = "CUDA driver" if on_gpu else "libcuda stub (host time only; kernels drained untimed)"
    print(f"  {LAYERS} layers, {HEADS} KV heads x {HEAD_DIM}, bf16, {TOKENS} tokens a step, over the {where}")
    print(f"  {'figure':<34} {'us':>9} {'baseline us':>12} {'x baseline':>11}")
    print(f"  {'cuLaunchKernel alone (prepared)':<34} {fig['raw_launch']:9.1f} {'':>12} {'':>11}")
    rows = [("write_tokens, one layer", "write_layer"), ("read_tokens, one layer", "read_layer"),
            ("step: 32 x (write + read)", "step_per_layer_calls")]
    if "step_planned" in fig:
        rows.append(("step: one write + one read plan", "step_planned"))
    for label, key in rows:
        base = BASELINE_US.get(key, BASELINE_US["step_per_layer_calls"])
        print(f"  {label:<34} {fig[key]:9.1f} {base:12.1f} {fig[key] / base:10.3f}x")
    ceiling("write_tokens host time per layer (us / 15 us)", fig["write_layer"] / LAYER_CEILING_US, 1.0)
    ceiling("read_tokens host time per layer (us / 15 us)", fig["read_layer"] / LAYER_CEILING_US, 1.0)
    if "step_planned" in fig:
        ceiling("32-layer step host time (us / 40 us)", fig["step_planned"] / STEP_CEILING_US, 1.0)
    print(f"  (the stub's launch alone is {fig['raw_launch']:.1f} us of each launch above)")
