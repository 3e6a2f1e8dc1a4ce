"""pagedkv.backends: what memory is. The `GpuBackend` protocol and its helpers
(`protocol`), capability discovery (`capabilities`), the reference `HostBackend` on host
RAM (`host`) with its virtual memory (`host_vmm`), the range checks of batched copies every
backend shares (`batch_ranges`), and backends beside the two built in:

- `pagedkv.backends.torch_arena.TorchArenaBackend`: device memory from torch's CPU
  allocator (needs torch; import the module explicitly).
- `pagedkv.backends.per_range.PerRangeBlockOps`: the region table and the three block
  calls built from a backend's own memsets and copies, for a backend without batched
  kernels (it then does not support "batched_copy").

The CUDA backend is `pagedkv.driver`. Importing this package imports neither torch nor any
driver.

May import: `pagedkv.core`, `pagedkv.errors`.
"""
