"""State slots on CudaBackend over the libcuda stub, the kernels executing on the CPU
harness: slot pools, state_ptr, copy_state (one launch for many sequences), fork's device
copy, METRALE_KV_POISON fills, exact state checksums (bfloat16 reduced on the device) and
DLPack / CAI state views, every slot byte-compared with the same steps on HostBackend."""

from __future__ import annotations

from kernel_harness.stub import run_on_stub

SCENARIO = '''
import math, os
os.environ["METRALE_KV_POISON"] = "1"
from pagedkv.core.env import reload_flags
reload_flags()
import ml_dtypes
from structlog.testing import capture_logs
from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.driver import CudaBackend
from pagedkv.interop import dlpack

BF16 = np.dtype(ml_dtypes.bfloat16)
STATE = (((4, 8), BF16), ((3,), np.dtype("float32")))
CONFIG = KvCacheConfig(4, 1, 16, 3, "bf16", layer_groups=(
    LayerGroup("full", (0,)), LayerGroup("state", (1, 2), state=STATE)))

def launched_since(start):
    return [launch(i)[0].name.decode() for i in range(start, STUB.stub_launch_count())]

def step(record, what, fn, cuda):
    start = STUB.stub_launch_count()
    fn()
    if cuda:
        record[what] = launched_since(start)

def scenario(gpu, cuda):
    cache = PagedKvCache(CONFIG, [16, None], gpu, num_state_slots=8)
    table = SequenceTable(cache, PrefixCache(cache), gpu)
    group, s, rng, launches = cache.group(1), gpu.default_stream(), np.random.default_rng(5), {}
    step(launches, "add", lambda: table.add("a", list(range(9))), cuda)  # live zeroed, checkpoint poisoned
    live, = np.asarray(table.state_slots(["a"])).tolist()
    ckpt, = np.asarray(table.checkpoint_slots(["a"])).tolist()
    for layer in (1, 2):
        for t, (shape, dtype) in enumerate(STATE):
            cache.write_state(layer, live, (rng.standard_normal(shape) * 4).astype(dtype), gpu, tensor=t)
    step(launches, "fork", lambda: table.fork("a", "b"), cuda)
    twin, = np.asarray(table.state_slots(["b"])).tolist()
    x, y, z = group.alloc_blocks(3)
    step(launches, "copy_state", lambda: cache.copy_state([live, twin, live], [x, y, z], gpu, s), cuda)
    for t, (shape, dtype) in enumerate(STATE):
        cache.write_state(2, y, np.full(shape, -1.25, dtype), gpu, tensor=t)
    step(launches, "free", lambda: table.free("b"), cuda)  # its live slot: poisoned
    step(launches, "poison", lambda: group.poison_slots([z], gpu, s), cuda)
    gpu.synchronize(s)
    touched = sorted({live, ckpt, twin, x, y, z})
    state = {(layer, slot, t): cache.read_state(layer, slot, gpu, tensor=t).tobytes()
             for layer in (1, 2) for slot in touched for t in range(len(STATE))}
    start = STUB.stub_launch_count()
    with capture_logs() as logs:
        cache.debug_state_checksum_per_layer([live, x, y], gpu, s, "probe")
        cache.debug_state_per_slot(2, [z, live, twin], gpu, s, "slots")
    if cuda:
        launches["checksums"] = launched_since(start)
    events = [repr(sorted(e.items())) for e in logs]
    info = dict(live=live, ckpt=ckpt, twin=twin, x=x, y=y, z=z, cache=cache)
    return state, events, launches, info

host_state, host_events, _, host_info = scenario(HostBackend(), False)
with CudaBackend() as gpu:
    state, events, launches, info = scenario(gpu, True)
    assert state.keys() == host_state.keys()
    for key in state:
        assert state[key] == host_state[key], key
    assert events == host_events, (events, host_events)
    assert len(events) == 4 + 3
    assert "nan" in events[-1] and "nan" not in events[0]  # the poisoned slot, a written one
    live, x, z, twin, ckpt = info["live"], info["x"], info["z"], info["twin"], info["ckpt"]
    # what the slots hold: copies of the live state, poison, the zero initial state
    assert state[1, x, 0] == state[1, live, 0] and state[2, z, 1] == b"\\xff" * 12
    assert state[1, twin, 0] == b"\\xff" * 64 and state[2, ckpt, 0] == b"\\xff" * 64
    assert launches["fork"] == ["pagedkv_copy_blocks"], launches
    assert launches["copy_state"] == ["pagedkv_copy_blocks"], launches  # three sequences, one launch
    assert launches["free"] == ["pagedkv_fill_blocks"] and launches["poison"] == ["pagedkv_fill_blocks"], launches
    assert launches["checksums"].count("pagedkv_reduce_bf16_partial") == 2 + 3, launches  # bf16 on the device

    cache = info["cache"]
    pools = cache.state_pools()
    for layer in (1, 2):
        for t in range(2):
            assert int(cache.state_ptr(layer, 5, t)) == int(cache.state_ptr(layer, 0, t)) + 5 * pools.stride(t)
    get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
    get_ptr = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_GetPointer", ctypes.pythonapi))
    capsule = cache.state_view(2, gpu).__dlpack__(max_version=(1, 1), stream=-1)
    assert get_name(capsule) == b"dltensor_versioned"
    t = dlpack.DLManagedTensorVersioned.from_address(get_ptr(capsule, b"dltensor_versioned")).dl_tensor
    assert (t.device.device_type, t.device.device_id) == (2, 0) and t.data == int(cache.state_ptr(2, 0, 0))
    assert (t.dtype.code, t.dtype.bits) == (4, 16)
    assert [t.shape[i] for i in range(t.ndim)] == [8, 4, 8] and [t.strides[i] for i in range(t.ndim)] == [32, 8, 1]
    cai = cache.state_view(1, gpu, tensor=1).__cuda_array_interface__
    assert cai["typestr"] == "<f4" and cai["shape"] == (8, 3) and cai["strides"] == (16, 4)
    assert cai["data"] == (int(cache.state_ptr(1, 0, 1)), False)
    del capsule
    cache.release(gpu)
print("CHECK state on stub ok")
'''


def test_state_slots_on_the_device_match_host_backend_byte_for_byte(stub_env):
    out = run_on_stub(stub_env, SCENARIO)
    assert "CHECK state on stub ok" in out
