"""pagedkv.core: what every other part stands on, touching no memory: the storage formats
(`dtype`: the one table of what a format is), the cache geometry (`config`), the block
allocators (`allocator`: free list and reference counts; `elastic_allocator`: blocks
backed on demand), exact checksum arithmetic (`exact_sum`), and the shared plumbing:
argument checks (`validate`), stream arguments (`streams`), environment flags (`env`),
logging (`log`), refcount tracing (`trace`), the one-thread guard (`guard`) and teardown
(`teardown`).

May import: `pagedkv.errors` only (tests/test_layering.py holds the table).
"""
