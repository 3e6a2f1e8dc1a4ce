"""`pagedkv demo`: the main job end to end on the best backend present, with checks.

It builds a model-shaped cache, runs a small serving-like cycle (sequences allocating,
sharing blocks by reference, freeing), zeroes and poisons blocks, writes and reads KV back,
runs the checksum diagnostics, builds a hybrid cache of mixed formats and dims, evicts a
cached prompt into a host tier and serves it back from there (on a backend stating
"host_tier"), and releases everything. Each step is a check; the exit status is non-zero if any fails.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from typing import Callable, Iterator

import numpy as np
import structlog

from ..backends.capabilities import backend_supports
from ..backends.host import HostBackend, bf16_bytes_to_float64
from ..backends.protocol import GpuBackend
from ..cache.paged_cache import POISON_BYTE, PagedKvCache
from ..core.config import KvCacheConfig
from ..core.lazy_dtypes import ml
from ..core.teardown import Teardown
from ..errors import DeviceOutOfMemory, PagedKvError
from ..sequences.prefix_cache import PrefixCache
from ..sequences.sequence_table import SequenceTable
from ..tiers.host_tier import HostTier
from .args import UsageError, positive_int

HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 16
"""The demo cache's geometry per layer (BF16)."""


def best_backend() -> tuple[GpuBackend, str]:
    """A CudaBackend when a CUDA GPU is usable, else a HostBackend; with a sentence saying which."""
    try:
        from .. import driver
    except ImportError:
        driver = None
    is_available = getattr(driver, "is_available", None)
    if is_available is not None and is_available():
        gpu = driver.CudaBackend()
        return gpu, f"CudaBackend on {gpu.device_name}"
    return HostBackend(capacity_bytes=4 << 30), "HostBackend (no CUDA GPU found: device memory emulated in host RAM)"


class CheckFailed(PagedKvError):
    """A demo check found a wrong result (raised by `_expect`, so it holds under `python -O`)."""


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


class Checks:
    """Runs named checks, printing `[ok]`, `[FAIL]` with the reason, or `[skip]` for a check
    whose prerequisite did not pass, and counts them."""

    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0
        self.skipped = 0
        self._not_passed: set[str] = set()

    def run(self, name: str, check: Callable[[], str | None], needs: tuple[str, ...] = ()) -> bool:
        """Run `check` unless a check named in `needs` did not pass (then it is skipped); `check`
        returns a detail string, or raises on failure. True when it ran and passed."""
        missing = [need for need in needs if need in self._not_passed]
        if missing:
            self.skipped += 1
            self._not_passed.add(name)
            print(f"  [skip] {name}: needs {', '.join(repr(m) for m in missing)}, which did not pass")
            return False
        try:
            detail = check()
        except Exception as err:  # noqa: BLE001 - a demo reports every failure and goes on
            self.failed += 1
            self._not_passed.add(name)
            print(f"  [FAIL] {name}: {type(err).__name__}: {err}")
            return False
        self.passed += 1
        print(f"  [ok]   {name}" + (f": {detail}" if detail else ""))
        return True


@contextlib.contextmanager
def _captured_events() -> Iterator[list[dict]]:
    """Every structlog event of the block, debug included, into a list; afterwards structlog's
    configuration is what it was (left unconfigured if it was: structlog's capture_logs alone
    would mark it configured and send later events to stdout)."""
    was_configured = structlog.is_configured()
    wrapper_class = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs() as events:
            yield events
    finally:
        structlog.configure(wrapper_class=wrapper_class)
        if not was_configured:
            structlog.reset_defaults()


def _bf16_block(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    values = rng.standard_normal(nbytes // 2).astype(ml().bfloat16)
    return values.view(np.uint8)


def _serving_cycle(cache: PagedKvCache, gpu: GpuBackend, stream: int, checks: Checks) -> None:
    rng = np.random.default_rng(0)
    tables: dict[str, list[int]] = {}

    def allocate() -> str:
        tables["a"] = cache.alloc_blocks(4)
        tables["b"] = tables["a"][:2] + cache.alloc_blocks(2)  # b shares a's 2-block prefix
        for block in tables["a"][:2]:
            cache.inc_ref(block)
        cache.init_blocks(tables["a"] + tables["b"][2:], gpu, stream)
        shared = [cache.ref_count(b) for b in tables["a"][:2]]
        _expect(shared == [2, 2], f"shared prefix counts {shared}, expected [2, 2]")
        free = cache.num_free_blocks()
        _expect(free == cache.num_blocks() - 6, f"{free} free blocks, expected {cache.num_blocks() - 6}")
        return f"seq a {tables['a']}, seq b {tables['b']} (2 blocks shared, count 2)"

    written: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def write_read() -> str:
        for layer in range(cache.num_layers()):
            for block in tables["a"]:
                k = _bf16_block(rng, cache.k_block_stride_bytes_for_layer(layer))
                v = _bf16_block(rng, cache.v_block_stride_bytes_for_layer(layer))
                cache.write_block(layer, block, k, v, gpu)
                written[layer, block] = (k, v)
        gpu.synchronize(stream)
        for (layer, block), (k, v) in written.items():
            got_k, got_v = cache.read_block(layer, block, gpu)
            _expect(np.array_equal(got_k, k) and np.array_equal(got_v, v), f"layer {layer} block {block} differs")
        return f"{len(written)} (layer, block) pairs of random BF16 K and V read back byte-exact"

    def checksum() -> str:
        blocks = tables["a"]
        with _captured_events() as events:
            cache.debug_kv_checksum_per_layer(blocks, 2, gpu, stream, tag="demo")
        events = [e for e in events if e["event"] == "kv_checksum"]
        for event in events:
            region = blocks[:2] if event["region"] == "prefix" else blocks[2:]
            side = 0 if event["side"] == "K" else 1
            values = np.concatenate([bf16_bytes_to_float64(written[event["layer"], b][side]) for b in region])
            expected = (values.sum(), (values * values).sum(), np.abs(values).sum())
            got = (event["sum"], event["ssq"], event["sabs"])
            _expect(np.allclose(got, expected, rtol=1e-12, atol=1e-9), f"{event}: expected {expected}")
        _expect(len(events) == cache.num_layers() * 2 * 2, f"{len(events)} checksum events")
        return f"{len(events)} kv_checksum events agree with float64 sums of the data written"

    def poison_and_free() -> str:
        freed = tables["b"][2:]
        cache.free_blocks(tables["b"])
        cache.poison_blocks(freed, gpu, stream)
        gpu.synchronize(stream)
        k, v = cache.read_block(cache.num_layers() - 1, freed[0], gpu)
        _expect((k == POISON_BYTE).all() and (v == POISON_BYTE).all(), "poisoned block not all 0xFF")
        counts = [cache.ref_count(b) for b in tables["a"][:2]]
        _expect(counts == [1, 1], f"shared prefix counts {counts} after b freed, expected [1, 1]")
        cache.free_blocks(tables["a"])
        cache.check_invariants()
        _expect(cache.num_free_blocks() == cache.num_blocks(), "blocks leaked")
        reused = cache.alloc_block()
        _expect(reused == tables["a"][0], f"LIFO reuse gave {reused}")
        cache.free_block(reused)
        return "all blocks back on the free list, poisoned blocks read 0xFF, LIFO reuse"

    checks.run("allocate and share", allocate)
    checks.run("write and read back", write_read, needs=("allocate and share",))
    checks.run("checksum diagnostics", checksum, needs=("write and read back",))
    checks.run("poison and free", poison_and_free, needs=("allocate and share",))


def _sequences(gpu: GpuBackend, stream: int, checks: Checks) -> None:
    """Prefix reuse and copy-on-write through SequenceTable and PrefixCache, with real KV."""
    config = KvCacheConfig(block_size=16, num_kv_heads=4, head_dim=64, num_layers=2, dtype="bf16")
    cache = prefix = table = None  # built by the first check, so a failure to build is reported
    rng = np.random.default_rng(2)
    prompt = list(range(1000, 1072))  # 4.5 blocks

    def write_step(seq_id) -> dict[int, np.ndarray]:
        slots = table.slot_mapping([seq_id]).host
        written = {}
        for layer in range(config.num_layers):
            k = rng.standard_normal((slots.size, 4, 64)).astype(ml().bfloat16)
            cache.write_tokens(layer, slots, k, k, gpu, stream)
            written[layer] = k.astype(np.float32)
        return written

    def slots_of(seq_id, start, stop) -> np.ndarray:
        blocks = table.blocks(seq_id)
        return np.array([blocks[p // 16] * 16 + p % 16 for p in range(start, stop)], dtype=np.int64)

    def reuse() -> str:
        nonlocal cache, prefix, table
        cache = PagedKvCache(config, 64, gpu)
        prefix = PrefixCache(cache)
        table = SequenceTable(cache, prefix, gpu, stream)
        matched_a = table.add("a", prompt)
        _expect(matched_a == 0, f"seq a matched {matched_a} tokens of an empty prefix cache")
        first = write_step("a")
        table.free("a")
        _expect(prefix.num_cached_blocks() == 4, f"{prefix.num_cached_blocks()} blocks cached")
        matched = table.add("b", prompt[:64] + list(range(9000, 9011)))
        _expect(matched == 64, f"matched {matched} tokens, expected 64")
        for layer in range(config.num_layers):
            k, _ = cache.read_tokens(layer, slots_of("b", 0, 64), gpu)
            _expect(np.array_equal(k, first[layer][:64]), f"layer {layer}: reused KV differs")
        write_step("b")
        table.check_invariants()
        return f"seq b reused {matched} cached tokens of seq a; their KV reads back exactly"

    def copy_on_write() -> str:
        before = {layer: cache.read_tokens(layer, slots_of("b", 64, 75), gpu)[0] for layer in range(2)}
        table.fork("b", "c")
        shared = table.blocks("b")[-1]
        table.append("c", token_ids=[7])
        _expect(table.blocks("c")[-1] != shared, "the partly filled block was not copied")
        write_step("c")
        for layer in range(config.num_layers):
            for seq_id in ("b", "c"):
                k, _ = cache.read_tokens(layer, slots_of(seq_id, 64, 75), gpu)
                _expect(np.array_equal(k, before[layer]), f"layer {layer}: seq {seq_id}'s tokens 64-74 changed")
        table.check_invariants()
        for seq_id in ("b", "c"):
            table.free(seq_id)
        evicted = prefix.evict(cache.num_blocks())
        table.check_invariants()
        _expect(cache.num_free_blocks() == cache.num_blocks(), "blocks leaked")
        return f"fork + append copied the shared last block; parent unchanged; {len(evicted)} cached blocks evicted"

    try:
        checks.run("prefix reuse", reuse)
        checks.run("fork and copy-on-write", copy_on_write, needs=("prefix reuse",))
    finally:
        if table is not None:
            table.release(gpu)
        if prefix is not None:
            prefix.close()
        if cache is not None:
            cache.release(gpu)


def _hybrid_cache(gpu: GpuBackend, stream: int, checks: Checks) -> None:
    config = KvCacheConfig(
        block_size=16, num_kv_heads=8, head_dim=128, num_layers=4, dtype="turbo4k3v",
        layer_dtypes=("bf16", "fp8k_turbo4v", "nvfp4"), layer_dims=((8, 128), (4, 256)),
    )

    def build() -> str:
        cache = PagedKvCache(config, 32, gpu)
        try:
            sizes = [(cache.k_block_stride_bytes_for_layer(i), cache.v_block_stride_bytes_for_layer(i)) for i in range(4)]
            expected = [(32768, 32768), (16384, 9216), (9216, 9216), (9216, 7168)]
            _expect(sizes == expected, f"per-layer K/V block bytes {sizes}, expected {expected}")
            block = cache.alloc_block()
            cache.zero_block(block, gpu, stream)
            payload = np.arange(cache.v_block_stride_bytes_for_layer(3), dtype=np.uint32).astype(np.uint8)
            cache.write_block(3, block, None, payload, gpu)
            _, v = cache.read_block(3, block, gpu)
            _expect(np.array_equal(v, payload), "hybrid V block differs")
        finally:
            cache.release(gpu)
        return "K/V block bytes per layer " + ", ".join(f"{k}/{v}" for k, v in sizes)

    def tokens() -> str:
        cache = PagedKvCache(config, 32, gpu)
        rng = np.random.default_rng(1)
        errors = []
        try:
            blocks = cache.alloc_blocks(2)
            slots = np.array([blocks[0] * 16 + 3, -1, blocks[1] * 16, blocks[1] * 16 + 15], dtype=np.int64)
            for layer in range(config.num_layers):
                heads, head_dim = config.dims_for_layer(layer)
                k = rng.standard_normal((4, heads, head_dim)).astype(np.float32)
                v = rng.standard_normal((4, heads, head_dim)).astype(np.float32)
                cache.write_tokens(layer, slots, k, v, gpu, stream)
                k_back, v_back = cache.read_tokens(layer, slots, gpu)
                keep = slots >= 0
                for side, (sent, back) in zip("KV", ((k, k_back), (v, v_back))):
                    fmt = config.dtype_for_layer(layer).kv_pair()["KV".index(side)]
                    rel = float(np.mean((back[keep] - sent[keep]) ** 2) / np.mean(sent[keep] ** 2))
                    _expect(rel < _MAX_REL_MSE[str(fmt)], f"layer {layer} {side} ({fmt}): relative MSE {rel:.4f}")
                    errors.append(f"{fmt} {rel:.1e}")
        finally:
            cache.release(gpu)
        return "relative MSE per layer side: " + ", ".join(errors)

    checks.run("hybrid formats and dims", build)
    checks.run("tokens through every format", tokens)


def _host_tier(gpu: GpuBackend, stream: int, checks: Checks) -> None:
    """A prompt's cached blocks evicted from the device into a host tier, then served back to
    a new sequence from there with identical KV bytes."""
    if not backend_supports(gpu, "host_tier"):
        print(f"  [n/a]  host tier: {type(gpu).__name__} does not state 'host_tier'")
        return
    config = KvCacheConfig(block_size=16, num_kv_heads=2, head_dim=64, num_layers=3, dtype="bf16k_turbo4v",
                           layer_dtypes=("bf16", "fp8k_turbo3v", "nvfp4"))
    prompt = list(range(3000, 3065))  # 4 full blocks and one token

    def evict_and_serve() -> str:
        cache = PagedKvCache(config, 8, gpu)
        tier = prefix = table = None
        try:
            tier = HostTier(cache, 8, gpu)
            prefix = PrefixCache(cache, host_tier=tier, swap_stream=stream)
            table = SequenceTable(cache, prefix, gpu, stream)
            table.add("a", prompt)
            rng = np.random.default_rng(3)
            written = {}
            for layer in range(config.num_layers):
                for block in table.blocks("a")[:4]:
                    k = rng.integers(0, 256, cache.k_block_stride_bytes_for_layer(layer), dtype=np.uint8)
                    v = rng.integers(0, 256, cache.v_block_stride_bytes_for_layer(layer), dtype=np.uint8)
                    cache.write_block(layer, block, k, v, gpu)
                    written.setdefault(block, []).append((k, v))
            order = table.blocks("a")[:4]
            table.free("a")
            demoted = prefix.evict(cache.num_blocks())
            _expect(sorted(demoted) == sorted(order), f"evicted {demoted}, expected {order}")
            _expect(prefix.num_cached_blocks() == 0 and prefix.num_host_blocks() == 4,
                    f"{prefix.num_cached_blocks()} device and {prefix.num_host_blocks()} host blocks cached")
            matched = table.add("b", prompt)
            _expect(matched == 64, f"seq b matched {matched} tokens, expected 64 from the host tier")
            gpu.synchronize(stream)
            for old, new in zip(order, table.blocks("b")[:4]):
                for layer, (k, v) in enumerate(written[old]):
                    got_k, got_v = cache.read_block(layer, new, gpu)
                    _expect(np.array_equal(got_k, k) and np.array_equal(got_v, v),
                            f"layer {layer}: block {old} served back into block {new} differs")
            stats = prefix.stats()
            _expect((stats.demotions, stats.promotions, stats.host_hit_tokens) == (4, 4, 64), f"{stats}")
            table.free("b")
            table.check_invariants()
        finally:
            if table is not None:
                table.release(gpu)
            if prefix is not None:
                prefix.close()
            if tier is not None:
                tier.release(gpu)
            cache.release(gpu)
        return "a prompt's 4 blocks evicted to the host tier, then served to a new sequence from it; KV bytes identical"

    checks.run("host tier", evict_and_serve)


# Bounds on the relative MSE of a token round trip, ~3x FORMATS.md's unit-Gaussian figures.
_MAX_REL_MSE = {"bf16": 1e-4, "fp8": 3e-3, "nvfp4": 0.03, "turbo4": 0.02, "turbo3": 0.075, "turbo2": 0.4, "turbo8": 3e-3}


def demo_cache_bytes(layers: int, blocks: int) -> int:
    """Device bytes of the demo's main cache: `layers` x `blocks` BF16 blocks of K and V."""
    return layers * blocks * 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 2


def _check_room(gpu: GpuBackend, layers: int, blocks: int) -> None:
    needed, (free, _) = demo_cache_bytes(layers, blocks), gpu.mem_info()
    if needed > free:
        raise UsageError(
            f"--layers {layers} --blocks {blocks} need {needed / 2**30:.2f} GiB for the demo cache "
            f"but the backend has {free / 2**30:.2f} GiB free; give fewer --layers or --blocks"
        )


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 when every check passed, 1 otherwise. UsageError (before any
    check runs) when the cache asked for does not fit the backend."""
    started = time.perf_counter()
    gpu, which = best_backend()
    checks = Checks()
    teardown = Teardown()
    try:
        _check_room(gpu, args.layers, args.blocks)
        config = KvCacheConfig(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                               num_layers=args.layers, dtype="bf16")
        try:
            cache = PagedKvCache(config, args.blocks, gpu)
        except DeviceOutOfMemory as err:
            raise UsageError(f"--layers {args.layers} --blocks {args.blocks}: {err}") from None
        teardown.push(cache)
        print(f"pagedkv demo on {which}")
        print(
            f"cache: {config.num_layers} layers x {args.blocks} blocks of {config.block_size} tokens, bf16, "
            f"{config.block_bytes_kv_all_layers() * args.blocks / 2**20:.1f} MiB"
        )
        stream = gpu.default_stream()
        try:
            _serving_cycle(cache, gpu, stream, checks)
            _sequences(gpu, stream, checks)
            _hybrid_cache(gpu, stream, checks)
            _host_tier(gpu, stream, checks)
        finally:
            checks.run("teardown", lambda: teardown.release_all(gpu))
            if isinstance(gpu, HostBackend):
                checks.run("nothing leaked", lambda: _no_leak(gpu))
    finally:
        close = getattr(gpu, "close", None)
        if close is not None:
            close()
    print(
        f"demo: {checks.passed} passed, {checks.failed} failed, {checks.skipped} skipped "
        f"in {time.perf_counter() - started:.2f} s"
    )
    return 1 if checks.failed or checks.skipped else 0


def _no_leak(gpu: HostBackend) -> str:
    live = gpu.live_allocations()
    _expect(live == 0, f"{live} allocations ({gpu.live_bytes()} bytes) live")
    swap, events = gpu.live_swap_memory(), gpu.live_events()
    _expect(swap == 0 and events == 0, f"{swap} swap memories and {events} events live")
    return "HostBackend reports 0 live allocations"


def register(subparsers) -> None:
    """Add the `demo` subcommand."""
    p = subparsers.add_parser("demo", help="run the main job end to end with checks")
    p.add_argument("--layers", type=positive_int, default=8, help="layers of the demo cache (default 8)")
    p.add_argument("--blocks", type=positive_int, default=128, help="blocks of the demo cache (default 128)")
    p.set_defaults(func=run)
