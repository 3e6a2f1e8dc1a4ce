"""NVRTC compilation of the kernels, the on-disk kernel cache, and the driver package's
behaviour on a machine without CUDA. Needs NVRTC (the cu13/cu12 extra), never a GPU."""

from __future__ import annotations

import glob

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")

import pagedkv.driver as driver_pkg  # noqa: E402
from pagedkv.driver import nvrtc  # noqa: E402
from pagedkv.driver.backend import KERNELS  # noqa: E402
from kernel_harness.shared_cache import compiled, kernel_cache_dir  # noqa: E402

ARCHS = ["sm_80", "sm_90", "sm_100"]
HAS_GPU_NODE = bool(glob.glob("/dev/nvidia[0-9]*"))


def test_every_kernel_source_is_listed_by_the_backend():
    assert sorted(p.name for p in nvrtc.kernel_sources()) == sorted(KERNELS)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", sorted(KERNELS))
def test_kernel_compiles_to_cubin(filename, arch):
    """Compiled once per machine for the whole suite (kernel_harness/shared_cache.py): the
    CUBIN holds every kernel, ptxas reported on each, and the driver's cache serves it."""
    fresh = compiled(nvrtc.SOURCE_DIR / filename, arch)
    assert fresh.cubin[:4] == b"\x7fELF" and fresh.cubin[4] == 2  # a 64-bit ELF: CUBIN, not PTX
    for name, *_ in KERNELS[filename]:
        assert name.encode() + b"\0" in fresh.cubin, f"{name} missing from {filename} for {arch}"
        assert f"Compiling entry function '{name}' for '{arch}'" in fresh.log
    kernel = nvrtc.compile_cached(nvrtc.SOURCE_DIR / filename, arch, cache_dir=kernel_cache_dir())
    assert kernel.from_cache and kernel.cubin == fresh.cubin
    assert kernel.arch == arch and kernel.filename == filename


def test_broken_source_raises_with_the_log_and_file_name(tmp_path):
    broken = tmp_path / "broken_kernel.cu"
    broken.write_text('extern "C" __global__ void k(int* out) { out[0] = undeclared_thing; }\n')
    with pytest.raises(nvrtc.NvrtcCompileError) as info:
        nvrtc.compile_cached(broken, "sm_90", cache_dir=tmp_path / "cache")
    err = info.value
    assert err.filename == "broken_kernel.cu"
    assert "undeclared_thing" in err.log and "error" in err.log
    assert str(err).startswith("nvrtcCompileProgram failed: NVRTC_ERROR_COMPILATION (compilation failed) for broken_kernel.cu (sm_90):")
    assert "undeclared_thing" in str(err)
    assert not list((tmp_path / "cache").glob("*.cubin")), "a failed compile stores nothing"


def test_cache_hits_on_the_second_compile(tmp_path):
    source = nvrtc.SOURCE_DIR / "fill_blocks.cu"
    first = nvrtc.compile_cached(source, "sm_90", cache_dir=tmp_path)
    second = nvrtc.compile_cached(source, "sm_90", cache_dir=tmp_path)
    assert (first.from_cache, second.from_cache) == (False, True)
    assert second.cubin == first.cubin
    other_arch = nvrtc.compile_cached(source, "sm_80", cache_dir=tmp_path)
    assert not other_arch.from_cache, "the architecture is part of the key"
    other_opts = nvrtc.compile_cached(source, "sm_90", cache_dir=tmp_path, options=("--std=c++17",))
    assert not other_opts.from_cache, "the options are part of the key"
    assert len(list(tmp_path.glob("*.cubin"))) == 3


def test_changed_source_misses_the_cache(tmp_path):
    source = tmp_path / "k.cu"
    source.write_text('extern "C" __global__ void k(int* out) { out[0] = 1; }\n')
    assert not nvrtc.compile_cached(source, "sm_90", cache_dir=tmp_path / "c").from_cache
    source.write_text('extern "C" __global__ void k(int* out) { out[0] = 2; }\n')
    assert not nvrtc.compile_cached(source, "sm_90", cache_dir=tmp_path / "c").from_cache


@pytest.mark.parametrize("damage", ["flip_a_byte", "truncate", "empty", "garbage"])
def test_corrupt_cache_entry_is_recompiled_and_repaired(tmp_path, damage):
    source = nvrtc.SOURCE_DIR / "copy_blocks.cu"
    good = nvrtc.compile_cached(source, "sm_90", cache_dir=tmp_path)
    (entry,) = tmp_path.glob("*.cubin")
    raw = bytearray(entry.read_bytes())
    if damage == "flip_a_byte":
        raw[len(raw) // 2] ^= 0xFF
    elif damage == "truncate":
        raw = raw[: len(raw) // 3]
    elif damage == "empty":
        raw = bytearray()
    else:
        raw = bytearray(b"not a cubin at all")
    entry.write_bytes(bytes(raw))
    again = nvrtc.compile_cached(source, "sm_90", cache_dir=tmp_path)
    assert not again.from_cache and again.cubin == good.cubin
    repaired = nvrtc.compile_cached(source, "sm_90", cache_dir=tmp_path)
    assert repaired.from_cache and repaired.cubin == good.cubin


def test_unwritable_cache_falls_back_to_compiling(tmp_path):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("a file where the cache directory should be")
    source = nvrtc.SOURCE_DIR / "fill_blocks.cu"
    first = nvrtc.compile_cached(source, "sm_90", cache_dir=blocker / "kernels")
    second = nvrtc.compile_cached(source, "sm_90", cache_dir=blocker / "kernels")
    assert first.cubin[:4] == b"\x7fELF" and second.cubin == first.cubin
    assert (first.from_cache, second.from_cache) == (False, False)


def test_cache_directory_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", str(tmp_path / "from_env"))
    assert nvrtc.default_cache_dir() == tmp_path / "from_env"
    nvrtc.compile_cached(nvrtc.SOURCE_DIR / "fill_blocks.cu", "sm_90")
    assert len(list((tmp_path / "from_env").glob("*.cubin"))) == 1
    monkeypatch.delenv("PAGEDKV_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert nvrtc.default_cache_dir() == tmp_path / "xdg" / "pagedkv" / "kernels"


def test_arch_option_refuses_an_architecture_nvrtc_lacks():
    """An unsupported architecture is a CudaUnavailable naming it, not an invented status 0."""
    from pagedkv.driver.errors import UnsupportedArchitecture
    from pagedkv.errors import PagedKvError

    assert nvrtc.arch_option(9, 0) == "sm_90"
    with pytest.raises(UnsupportedArchitecture, match=r"sm_37 is not among this NVRTC's targets") as info:
        nvrtc.arch_option(3, 7)
    assert isinstance(info.value, driver_pkg.CudaUnavailable) and isinstance(info.value, PagedKvError)
    assert not isinstance(info.value, driver_pkg.CudaError)
    assert info.value.arch == 37 and 90 in info.value.supported


def test_nvrtc_output_buffers_are_writable_and_private(monkeypatch, tmp_path):
    """NVRTC writes the CUBIN and the log into the buffer it is given: that must be a fresh
    writable buffer, never `b" " * 1` (CPython's one shared one-byte object)."""
    from cuda.bindings import nvrtc as bindings

    seen = []

    def fake_fill(real, size_call):
        def fill(prog, buf):
            view = memoryview(buf)
            seen.append((size_call, view.readonly))
            assert not view.readonly, f"{size_call}: NVRTC would write into an immutable bytes object"
            real_size = len(view)
            data = bytearray(real_size)
            status = real(prog, data)
            view[:] = data
            return status
        return fill

    for name, size_name in (("nvrtcGetCUBIN", "nvrtcGetCUBINSize"), ("nvrtcGetProgramLog", "nvrtcGetProgramLogSize")):
        monkeypatch.setattr(bindings, name, fake_fill(getattr(bindings, name), name))
    kernel = nvrtc.compile_cached(nvrtc.SOURCE_DIR / "fill_blocks.cu", "sm_90", cache_dir=tmp_path)
    assert isinstance(kernel.cubin, bytes) and kernel.cubin[:4] == b"\x7fELF"
    broken = tmp_path / "broken.cu"
    broken.write_text("this is not C++\n")
    with pytest.raises(nvrtc.NvrtcCompileError) as info:
        nvrtc.compile_cached(broken, "sm_90", cache_dir=tmp_path)
    assert "error" in info.value.log
    # the CUBIN and ptxas' report of the good compile, the error log of the broken one
    assert [s for s, _ in seen] == ["nvrtcGetCUBIN", "nvrtcGetProgramLog", "nvrtcGetProgramLog"]
    assert b" " == bytes([32])


def test_one_check_for_driver_and_nvrtc_statuses():
    from cuda.bindings import driver, nvrtc as bindings

    from pagedkv.driver.errors import check

    assert check((bindings.nvrtcResult(0), 7), "x") == 7
    with pytest.raises(driver_pkg.CudaError) as info:
        check((bindings.nvrtcResult.NVRTC_ERROR_INVALID_INPUT,), "nvrtcThing", "detail")
    assert (info.value.call, info.value.status, info.value.status_name) == (
        "nvrtcThing", 3, "NVRTC_ERROR_INVALID_INPUT")
    assert str(info.value).endswith("detail")
    with pytest.raises(driver_pkg.CudaOutOfMemory) as info:
        check((driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemAlloc")
    assert info.value.status_name == "CUDA_ERROR_OUT_OF_MEMORY"
    from pagedkv.errors import PagedKvError

    assert issubclass(driver_pkg.CudaError, PagedKvError) and issubclass(driver_pkg.CudaUnavailable, PagedKvError)


def test_source_defines_reach_the_compile_and_the_key(tmp_path):
    """The reduction's thread count comes from Python: the source refuses to compile
    without it, and compile_cached passes `source_defines` (so they key the cache too)."""
    from pagedkv.core.exact_sum import SSQ_DIGITS, SUM_DIGITS

    assert nvrtc.source_defines("reduce_bf16.cu") == (
        f"-DREDUCE_THREADS={nvrtc.REDUCE_THREADS}", f"-DSUM_DIGITS={SUM_DIGITS}", f"-DSSQ_DIGITS={SSQ_DIGITS}")
    assert nvrtc.source_defines("fill_blocks.cu") == () and nvrtc.source_defines("other.cu") == ()
    source = (nvrtc.SOURCE_DIR / "reduce_bf16.cu").read_bytes()
    with pytest.raises(nvrtc.NvrtcCompileError, match="REDUCE_THREADS"):
        nvrtc.compile_source(source, "reduce_bf16.cu", "sm_90")
    kernel = nvrtc.compile_cached(nvrtc.SOURCE_DIR / "reduce_bf16.cu", "sm_90", cache_dir=tmp_path)
    assert b"pagedkv_reduce_bf16_partial\0" in kernel.cubin


@pytest.mark.skipif(HAS_GPU_NODE, reason="this machine has an NVIDIA device node")
def test_is_available_is_false_without_loading_anything():
    driver_pkg.is_available.cache_clear()
    assert driver_pkg.is_available() is False
    assert driver_pkg.is_available() is False
    assert driver_pkg.is_available.cache_info().hits >= 1, "the answer is cached"
    with open("/proc/self/maps") as maps:
        assert "libcuda.so" not in maps.read(), "is_available() must not load libcuda"


def test_is_available_never_raises(monkeypatch):
    def boom():
        raise RuntimeError("probe failure")

    monkeypatch.setattr(driver_pkg, "_has_gpu_device_node", boom)
    driver_pkg.is_available.cache_clear()
    try:
        assert driver_pkg.is_available() is False
    finally:
        driver_pkg.is_available.cache_clear()


@pytest.mark.skipif(HAS_GPU_NODE, reason="this machine has an NVIDIA device node")
def test_cuda_unavailable_reads_as_one_sentence():
    with pytest.raises(driver_pkg.CudaUnavailable) as info:
        driver_pkg.CudaBackend()
    message = str(info.value)
    assert "\n" not in message and message.endswith(".") and message.count(". ") == 0
    assert message in (
        "No NVIDIA driver on this machine: libcuda.so.1 could not be loaded (DynamicLibNotFoundError).",
        "The NVIDIA driver is installed but reports no GPU (CUDA_ERROR_NO_DEVICE).",
    ), message


def test_launcher_refuses_values_its_c_types_cannot_hold():
    from pagedkv.driver.launch import FillArgs, KernelLauncher

    launcher = KernelLauncher("pagedkv_fill_blocks", None, FillArgs, 256)
    fields = dict(table=1, num_rows=1, blocks=2, num_blocks=2**31, value=0)
    with pytest.raises(OverflowError, match=r"num_blocks=2147483648 does not fit"):
        launcher.launch(1, 0, **fields)
    del fields["value"]
    with pytest.raises(TypeError, match=r"missing \['value'\]"):
        launcher.launch(1, 0, **fields)
