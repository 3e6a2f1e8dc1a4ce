"""Backends beyond the two built in, and building blocks for writing one.

- `pagedkv.backends.torch_arena.TorchArenaBackend`: device memory from torch's CPU
  allocator (needs torch; import the module explicitly).
- `pagedkv.backends.per_range.PerRangeBlockOps`: the region table and the three block
  calls built from a backend's own memsets and copies, for a backend without batched
  kernels (it then does not support "batched_copy").

Importing this package imports neither torch nor any driver.
"""
