"""HostTier: a pool of host blocks beside a PagedKvCache, filled and read back by batched swaps.

The tier holds, for every row of the cache's region table (each layer's K pool, then its V
pool; one row under `v_aliases_k`), one swap memory (`alloc_swap_memory`: pinned and mapped
on CudaBackend, numpy on HostBackend) of `num_blocks` blocks with the device pool's stride.
Host block h of row r lives at `memory[r].address + h * stride[r]`, so mixed per-layer formats
and dims keep their own strides.

Bookkeeping: a free list of host blocks (handed out lowest first) and an LRU of the host
blocks that hold cached KV (oldest first). A block is free, allocated, or allocated and
cached; the tier never decides on its own what to drop: the owner (a PrefixCache) does.

A swap moves every row's bytes of the listed blocks in ONE `copy_batch_async` call: pairs
are sorted by device block and runs contiguous on both sides merged into one range per row.
Worked example, 2 rows of strides 512 and 256: `swap_out([4, 5, 9], [0, 1, 2])` gives
4 ranges (rows x runs [4, 5] -> [0, 1] and [9] -> [2]): 1024 and 512 bytes in row 0, 512
and 256 in row 1.
"""

from __future__ import annotations

import collections
import heapq
import threading
from typing import Any, NamedTuple, Sequence

import numpy as np

from ..backends.capabilities import require
from ..backends.protocol import GpuBackend
from ..cache.hybrid_cache import HybridKvCache, StateGroup
from ..cache.paged_cache import PagedKvCache
from ..core.log import get_logger
from ..core.streams import stream_handle
from ..core.teardown import free_each
from ..core.validate import block_list, index_in_range, non_negative_int, positive_int
from ..errors import KvCacheError, KvCacheExhausted, RefCountError

_log = get_logger("host_tier")


class Event(NamedTuple):
    """An event handle from the backend's `record_event`, wrapped so that `after=` can tell
    it from a stream handle (both are ints). The caller still owns (and destroys) it."""

    handle: int


class SwapHandle:
    """The completion of one swap: `done()` polls, `wait()` blocks, both through the
    backend's events. The event is destroyed exactly once: when `done()` first answers True,
    when `wait()` returns, or by `close()` (which waits first). A swap of no blocks has no
    event and is done at once."""

    def __init__(self, gpu: Any, event: int | None, blocks: int):
        self._gpu = gpu
        self._event = event
        self.blocks = blocks
        """How many blocks the swap moved."""

    def event(self) -> int | None:
        """The live event recorded after the copy, or None once it is known complete."""
        return self._event

    def done(self) -> bool:
        """True when the copy has finished (never blocks)."""
        if self._event is None:
            return True
        if not self._gpu.event_done(self._event):
            return False
        self._destroy()
        return True

    def wait(self) -> None:
        """Block until the copy has finished."""
        if self._event is not None:
            self._gpu.wait_event(self._event)
            self._destroy()

    close = wait

    def _destroy(self) -> None:
        self._gpu.destroy_event(self._event)  # first: a refused destroy keeps the event for a retry
        self._event = None

    def __repr__(self) -> str:
        return f"SwapHandle({self.blocks} blocks, {'done' if self._event is None else 'pending'})"


class HostTier:
    """Host blocks with the layout of `cache`'s pools, on `gpu` (the cache's backend, which
    must state "host_tier": BackendFeatureMissing otherwise). Construction is all or
    nothing: a failed allocation frees what was allocated. `release(gpu)` frees the memory.
    One thread at a time, like the cache it serves.

    `format` (a format name, or one per layer with None for a layer's own) stores host
    blocks in a smaller pagedkv format, encoded on the device before the copy and decoded
    after it (`tier_codec.TierCodec`, with `staging_blocks` blocks of device staging): fewer
    host bytes and less PCIe traffic, at the error `pagedkv quality --tier` reports."""

    def __init__(self, cache: PagedKvCache, num_blocks: int, gpu: GpuBackend, format: Any = None,
                 staging_blocks: int = 64):
        if isinstance(cache, HybridKvCache):
            raise KvCacheError("HostTier does not support a cache with layer_groups: use "
                               "HybridHostTier(cache, num_blocks, gpu) (a HostTier per group)")
        if not isinstance(cache, (PagedKvCache, StateGroup)):
            raise TypeError(f"cache must be a PagedKvCache (or a hybrid cache's group), got {type(cache).__name__}")
        if isinstance(cache, StateGroup) and format is not None:
            raise ValueError(f"format={format!r}: a state group's host slots keep the device bytes (no tier format)")
        require(gpu, "host_tier", "HostTier")
        try:
            cache.pools().check_backend(gpu)
        except KvCacheError:
            raise ValueError(
                f"HostTier's gpu {type(gpu).__name__} {gpu!r:.60} is not the backend the cache was built on"
            ) from None
        self._num_blocks = positive_int(num_blocks, "host tier num_blocks")
        self._cache = cache
        self._gpu = gpu
        regions = cache.block_regions()
        self._device_bases = regions.bases.astype(np.int64).copy()
        self._strides = regions.strides.astype(np.int64).copy()
        self._nbytes = regions.nbytes.astype(np.int64).copy()
        self._memories: list[Any] = []  # one per region row; kept while a free fails
        self._codec = None
        if format is not None:
            from .tier_codec import TierCodec

            self._codec = TierCodec(cache, format, gpu, positive_int(staging_blocks, "staging_blocks"))
            self._strides = np.array(self._codec.host_strides(cache), dtype=np.int64)
            self._nbytes = self._strides.copy()
        try:
            for stride in self._strides.tolist():
                self._memories.append(gpu.alloc_swap_memory(self._num_blocks * stride))
        except BaseException:
            self._free_memories(raise_first=False)
            if self._codec is not None:
                self._codec.release(gpu)
            raise
        self._host_bases = np.array([m.address for m in self._memories], dtype=np.int64)
        self._owner = None  # the ThreadGuard of the PrefixCache whose cached host blocks these are
        self._free: list[int] = list(range(self._num_blocks))  # a min-heap
        self._allocated = np.zeros(self._num_blocks, dtype=bool)
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._pending: list[tuple[SwapHandle, list[int]]] = []  # freed once their swap is done
        self._orphans: list[Any] = []  # events whose destroy failed, handles given to `keep`: release retries
        self._live = True
        _log.info("host_tier_allocated", blocks=self._num_blocks, rows=len(self._memories),
                  bytes=int(self._strides.sum()) * self._num_blocks)

    # -- facts ------------------------------------------------------------------------

    def num_blocks(self) -> int:
        """Host blocks in the tier."""
        return self._num_blocks

    def num_free_blocks(self) -> int:
        """Host blocks not allocated (including those waiting for a swap to finish reading them)."""
        return len(self._free) + sum(len(blocks) for _, blocks in self._pending)

    def gpu(self) -> GpuBackend:
        """The backend the tier's memory is on."""
        return self._gpu

    def cache(self) -> PagedKvCache:
        """The device cache whose layout the tier mirrors."""
        return self._cache

    def block_bytes(self) -> int:
        """Bytes of one host block over every row (the cache's block bytes over all layers)."""
        return int(self._strides.sum())

    def is_live(self) -> bool:
        """True until `release`."""
        return self._live

    def format_name(self) -> str | None:
        """The pagedkv format host blocks are stored in when it is not the device's (None:
        the device pools' own bytes)."""
        return None if self._codec is None else self._codec.name()

    def rows(self) -> list[dict]:
        """What one host block holds, row by row (the region table's order): layer, side,
        side format, dims and stride (what a disk tier's layout records); for a state
        group's tier: layer, tensor, dtype, shape and stride of each slot row."""
        if isinstance(self._cache, StateGroup):
            pools = self._cache.pools()
            return [{"layer": layer, "tensor": t, "dtype": str(dtype), "shape": list(shape),
                     "stride": int(self._strides[pools.region_index(layer, t)])}
                    for layer in self._cache.layers for t, (shape, dtype) in enumerate(pools.group().state)]
        config = self._cache.config() if self._codec is None else self._codec.config
        out = []
        for layer in range(config.num_layers):
            heads, head_dim = config.dims_for_layer(layer)
            k_fmt, v_fmt = config.dtype_for_layer(layer).kv_pair()
            sides = (("K", k_fmt),) if config.v_aliases_k else (("K", k_fmt), ("V", v_fmt))
            for side, fmt in sides:
                out.append({"layer": layer, "side": side, "dtype": str(fmt), "num_kv_heads": heads,
                            "head_dim": head_dim, "stride": int(self._strides[self._cache.region_index(layer, side)])})
        return out

    def block_rows(self, block: int) -> list[np.ndarray]:
        """Writable views of host block `block`'s bytes, one per row (no copy; valid until
        `release`). Wait for the swap that writes it before reading them."""
        return [m.array[block * s : (block + 1) * s] for m, s in zip(self._memories, self._strides.tolist())]

    # -- free list ----------------------------------------------------------------------

    def alloc(self, n: int) -> list[int]:
        """Take `n` free host blocks (lowest first). Blocks waiting for a swap that reads
        them are reclaimed first (waiting for it when needed). KvCacheExhausted, nothing
        taken, when fewer than `n` are free."""
        n = non_negative_int(n, "number of host blocks")
        self._check_live()
        self._reap(wait=len(self._free) < n)
        if n > len(self._free):
            raise KvCacheExhausted(f"host tier: {n} block(s) asked, {len(self._free)} of {self._num_blocks} free")
        taken = [heapq.heappop(self._free) for _ in range(n)]
        self._allocated[taken] = True
        return taken

    def free(self, blocks: Sequence[int], after: SwapHandle | None = None) -> None:
        """Give allocated host blocks back (they leave the LRU). With `after`, a swap still
        reading them, they become free only once it is done. Checked before anything
        changes: a free or repeated block raises naming it, and so does an error polling
        `after` (the blocks stay allocated)."""
        blocks = self.checked_free(blocks)
        reading = after is not None and not after.done()  # may raise (an event error): nothing changed yet
        for block in blocks:
            self._lru.pop(block, None)
        self._allocated[blocks] = False
        if reading:
            self._pending.append((after, blocks))
        else:
            for block in blocks:
                heapq.heappush(self._free, block)

    def checked_free(self, blocks: Sequence[int], verb: str = "free") -> list[int]:
        """`blocks` after every check `free` makes (nothing freed): each valid, allocated, not
        the prefix cache's (unless it is the caller), listed once."""
        blocks = self._host_blocks(blocks, verb)
        self._check_allocated(blocks, f"{verb} of")
        self._check_not_owned(blocks, verb)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"host tier {verb} lists a block twice: {blocks}")
        return blocks

    def abandon(self, handle: SwapHandle, blocks: Sequence[int]) -> None:
        """Give back allocated host blocks that a swap whose completion could not be
        established (its `wait` or `done` raised) may still touch: they leave the LRU now and
        become free once `handle` is known done; the tier keeps the handle (and its event)
        and retries it at every `alloc` that needs them and at `release`."""
        blocks = self.checked_free(blocks, "abandon")
        for block in blocks:
            self._lru.pop(block, None)
        self._allocated[blocks] = False
        self._pending.append((handle, list(blocks)))

    def _reap(self, wait: bool) -> None:
        """Free the blocks of the pending swaps that are done (waiting for each when `wait`).
        Exception-safe: what was reaped before a wait or poll raises is off the list, the
        swap that raised and the ones after it stay pending."""
        pending, i = self._pending, 0
        while i < len(pending):
            handle, blocks = pending[i]
            if wait:
                handle.wait()
            if handle.done():
                del pending[i]
                for block in blocks:
                    heapq.heappush(self._free, block)
            else:
                i += 1

    # -- the LRU of cached host blocks --------------------------------------------------

    def touch(self, blocks: Sequence[int]) -> None:
        """Mark allocated host blocks as holding cached KV, used now, in the order given
        (the last is the most recent)."""
        blocks = self._host_blocks(blocks, "touch")
        self._check_allocated(blocks, "touch of")
        lru = self._lru
        for block in blocks:
            lru[block] = None
            lru.move_to_end(block)

    def uncache(self, blocks: Sequence[int]) -> None:
        """Take host blocks out of the LRU (they stay allocated). Refused (KvCacheError naming
        the block, nothing changed) for a block the attached prefix cache holds, unless
        called from within that prefix cache."""
        blocks = self._host_blocks(blocks, "uncache")
        self._check_not_owned(blocks, "uncache")
        for block in blocks:
            self._lru.pop(block, None)

    def attach_owner(self, guard: Any) -> None:
        """Bind the tier to the PrefixCache whose ThreadGuard is `guard` (PrefixCache does
        this): its cached host blocks are then freed and uncached only from within it. A
        `release` under it is allowed: the prefix cache forgets the tier's blocks at its
        next call."""
        if self._owner is not None and self._owner is not guard:
            raise KvCacheError("this host tier already serves another PrefixCache")
        self._owner = guard

    def detach_owner(self, guard: Any) -> None:
        """Undo `attach_owner` (a no-op for another guard)."""
        if self._owner is guard:
            self._owner = None

    def _check_not_owned(self, blocks: list[int], verb: str) -> None:
        owner = self._owner
        if owner is None or (owner.inside() and owner.owner == threading.get_ident()):
            return
        held = next((b for b in blocks if b in self._lru), None)
        if held is not None:
            raise KvCacheError(f"{verb} of host block {held}: the PrefixCache holds it (cached KV); it frees "
                               "its own host blocks (clear() or close() it), nothing was changed")

    def is_cached(self, block: int) -> bool:
        """True when host block `block` is in the LRU."""
        return block in self._lru

    def lru_blocks(self) -> list[int]:
        """The cached host blocks, least recently used first."""
        return list(self._lru)

    def oldest(self):
        """An iterator over the cached host blocks, least recently used first (lazy: do not
        change the LRU while iterating)."""
        return iter(self._lru)

    def num_cached_blocks(self) -> int:
        """How many host blocks hold cached KV."""
        return len(self._lru)

    # -- swaps --------------------------------------------------------------------------

    def swap_out(self, device_blocks: Sequence[int], host_blocks: Sequence[int], stream: Any,
                 after: Any = None) -> SwapHandle:
        """Copy every row's bytes of device block `device_blocks[i]` into host block
        `host_blocks[i]`, in ONE `copy_batch_async` on `stream`, after `after` (a stream, an
        `Event`, or a SwapHandle; the KV's producer) so it never reads KV before the work that
        wrote it. Device blocks must be allocated (count > 0); host blocks allocated, distinct
        and not cached. Every check runs before anything is enqueued. Returns the handle."""
        device, host = self.checked_swap_out(device_blocks, host_blocks)
        return self._swap(device, host, stream, after, to_host=True)

    def checked_swap_out(self, device_blocks: Sequence[int], host_blocks: Sequence[int]) -> tuple[list[int], list[int]]:
        """The pairs of a `swap_out` after every one of its checks (nothing enqueued): for
        a caller batching several tiers' swaps into one copy (`HybridHostTier`)."""
        device, host = self._pairs(device_blocks, host_blocks, "swap_out")
        allocator = self._cache.allocator()
        for block in device:
            if allocator.ref_count(block) == 0:
                raise RefCountError(f"swap_out of free device block {block} (count 0): it holds no KV")
        self._check_distinct(host, "swap_out host destinations")
        self._check_allocated(host, "swap_out into")
        cached = [b for b in host if b in self._lru]
        if cached:
            raise KvCacheError(f"swap_out into host block {cached[0]}, which holds cached KV: free it first")
        return device, host

    def swap_in(self, host_blocks: Sequence[int], device_blocks: Sequence[int], stream: Any,
                after: Any = None) -> SwapHandle:
        """Copy every row's bytes of host block `host_blocks[i]` over device block
        `device_blocks[i]`, in ONE `copy_batch_async` on `stream`, after `after` (a stream,
        an `Event` or a SwapHandle). Host blocks must be allocated; device blocks distinct,
        held by the caller and not in the prefix cache (the cache's write rule). Every check
        runs before anything is enqueued. Returns the handle; work enqueued later on
        `stream` sees the bytes."""
        device, host = self.checked_swap_in(host_blocks, device_blocks)
        return self._swap(device, host, stream, after, to_host=False)

    def checked_swap_in(self, host_blocks: Sequence[int], device_blocks: Sequence[int]) -> tuple[list[int], list[int]]:
        """The (device, host) pairs of a `swap_in` after every one of its checks (nothing
        enqueued); see `checked_swap_out`."""
        device, host = self._pairs(device_blocks, host_blocks, "swap_in")
        self._check_distinct(device, "swap_in device destinations")
        self._cache.allocator().check_writable(device)
        self._check_allocated(host, "swap_in from")
        return device, host

    def handle_after(self, stream: Any, blocks: int) -> SwapHandle:
        """The handle of a swap of `blocks` blocks the caller just enqueued on `stream`."""
        return self._handle(stream, blocks)

    def wait_for(self, after: Any, stream: Any) -> None:
        """Make `stream` wait for `after` (a SwapHandle, an `Event` or a stream), as a swap's
        `after=` does."""
        self._wait_for(after, stream)

    def has_codec(self) -> bool:
        """True when host blocks are stored in another format (`format=`)."""
        return self._codec is not None

    def _pairs(self, device_blocks: Sequence[int], host_blocks: Sequence[int], verb: str) -> tuple[list[int], list[int]]:
        self._check_live()
        device = self._cache.allocator().blocks(device_blocks, f"{verb} device_blocks")
        if device:
            self._cache.pools().check_resident(max(device))
        host = self._host_blocks(host_blocks, verb)
        if len(device) != len(host):
            raise ValueError(f"{verb} needs as many device as host blocks, got {len(device)} and {len(host)}")
        return device, host

    def _swap(self, device: list[int], host: list[int], stream: Any, after: Any, to_host: bool) -> SwapHandle:
        gpu = self._gpu
        if not device:
            return SwapHandle(gpu, None, 0)
        if self._codec is not None:
            self._wait_for(after, stream)
            self._codec.swap(device, host, self._host_bases, self._strides, stream, to_host)
            return self._handle(stream, len(device))
        device_addr, host_addr, sizes = self.descriptors(device, host)
        dsts, srcs = (host_addr, device_addr) if to_host else (device_addr, host_addr)
        self._wait_for(after, stream)
        gpu.copy_batch_async(dsts, srcs, sizes, stream)
        return self._handle(stream, len(device))

    def _handle(self, stream: Any, blocks: int) -> SwapHandle:
        """The handle of the swap just enqueued on `stream`. Without an event (record_event
        failed) nothing could tell when the copy is done, so the stream is waited for before
        the error is raised: the blocks it touches are then safe to reuse."""
        gpu = self._gpu
        try:
            event = gpu.record_event(stream)
        except BaseException:
            gpu.synchronize(stream)
            raise
        return SwapHandle(gpu, event, blocks)

    def _wait_for(self, after: Any, stream: Any) -> None:
        """Make `stream` wait for `after`: a SwapHandle, an Event, or a stream."""
        gpu = self._gpu
        if after is None:
            return
        if isinstance(after, SwapHandle):
            if after.event() is not None:
                gpu.stream_wait_event(stream, after.event())
            return
        if isinstance(after, Event):
            gpu.stream_wait_event(stream, after.handle)
            return
        if stream_handle(after) == stream_handle(stream):
            return  # work on one stream is already in order
        event = gpu.record_event(after)
        try:
            gpu.stream_wait_event(stream, event)
        finally:
            self._destroy_event(event)

    def _destroy_event(self, event: int) -> None:
        """Destroy an event of the tier's own; one the backend refuses is kept and retried
        by `release` (the refusal is raised)."""
        try:
            self._gpu.destroy_event(event)
        except BaseException:
            self._orphans.append(event)
            raise

    def keep(self, handle: SwapHandle) -> None:
        """Hand the tier a swap whose completion could not be waited for (its `wait` or
        `done` raised): `release` waits for it and destroys its event, so it cannot leak."""
        if not isinstance(handle, SwapHandle):
            raise TypeError(f"keep takes a SwapHandle, got {type(handle).__name__}")
        if handle.event() is not None:
            self._orphans.append(handle)

    def descriptors(self, device: Sequence[int], host: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(device addresses, host addresses, sizes) of the ranges one swap of the pairs
        `(device[i], host[i])` copies: pairs sorted by device block, runs contiguous on both
        sides merged, one range per run per row (row-major). Indices must be valid."""
        d = np.asarray(device, dtype=np.int64)
        h = np.asarray(host, dtype=np.int64)
        order = np.argsort(d, kind="stable")
        d, h = d[order], h[order]
        breaks = np.flatnonzero((np.diff(d) != 1) | (np.diff(h) != 1)) + 1
        starts = np.concatenate([[0], breaks])
        lengths = np.diff(np.concatenate([starts, [d.size]]))
        d0, h0 = d[starts], h[starts]
        strides, nbytes = self._strides[:, None], self._nbytes[:, None]
        device_addr = self._device_bases[:, None] + d0[None, :] * strides
        host_addr = self._host_bases[:, None] + h0[None, :] * strides
        sizes = (lengths[None, :] - 1) * strides + nbytes
        return device_addr.reshape(-1), host_addr.reshape(-1), sizes.reshape(-1)

    # -- reading host blocks ------------------------------------------------------------

    def read_block(self, layer: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(K bytes, V bytes) of host block `block` in `layer` (copies, each its side's
        stride long; V is K's copy under `v_aliases_k`). Wait for the swap that wrote it first.
        A diagnostic read: a free host block is read too, and returns whatever bytes it last
        held (zeros before any swap on HostBackend); `is_cached` says whether it holds KV."""
        self._check_live()
        if isinstance(self._cache, StateGroup):
            raise TypeError("read_block of a state group's tier: its host slots have no K and V (use block_rows)")
        block = index_in_range(block, self._num_blocks, "host block", f"a host tier of {self._num_blocks} blocks")
        cache = self._cache
        out = []
        for side in ("K", "V"):
            row = cache.region_index(layer, side)
            stride = int(self._strides[row])
            out.append(self._memories[row].array[block * stride : (block + 1) * stride].copy())
        return out[0], out[1]

    # -- checks -------------------------------------------------------------------------

    def _check_live(self) -> None:
        if not self._live:
            raise KvCacheError("the host tier has been released")

    def _host_blocks(self, blocks: Sequence[int], verb: str) -> list[int]:
        try:
            return block_list(blocks, self._num_blocks, f"{verb} host_blocks")
        except IndexError as err:
            raise IndexError(f"{verb}: host {err} (the host tier's size)") from None

    def _check_allocated(self, blocks: list[int], what: str) -> None:
        if blocks:
            free = np.flatnonzero(~self._allocated[blocks])
            if free.size:
                raise RefCountError(f"{what} free host block {blocks[int(free[0])]}: allocate it first")

    @staticmethod
    def _check_distinct(blocks: list[int], what: str) -> None:
        if len(set(blocks)) != len(blocks):
            seen: set[int] = set()
            repeated = next(b for b in blocks if b in seen or seen.add(b))
            raise ValueError(f"{what} repeat block {repeated}: {blocks}")

    # -- release ------------------------------------------------------------------------

    def label(self) -> str:
        """A short name for teardown messages."""
        return f"HostTier({self._num_blocks} blocks x {len(self._strides)} rows)"

    def release(self, gpu: GpuBackend) -> None:
        """Wait for swaps still reading host blocks, then free every swap memory on `gpu`
        (the tier's backend; ValueError otherwise, nothing freed). Every free is attempted;
        one that fails stays recorded and the first error is raised, so a second call
        retries it. With nothing left a call does nothing."""
        if gpu is not self._gpu:
            raise ValueError(f"release with {type(gpu).__name__} {gpu!r:.60}: the host tier is on "
                             f"{type(self._gpu).__name__} {self._gpu!r:.60}")
        if not self._memories and not self._live and not self._orphans:
            return
        if self._live:
            self._reap(wait=True)
            self._live = False
            self._lru.clear()
            self._free = []
        self._orphans, failed = free_each(self._orphans, self._end_orphan, _log, "host_tier_event_destroy_failed",
                                          field="orphan")
        if self._codec is not None:
            self._codec.release(gpu)
            self._codec = None
        self._free_memories(raise_first=True)
        if failed is not None:
            raise failed

    def _end_orphan(self, orphan: Any) -> None:
        if isinstance(orphan, SwapHandle):
            orphan.wait()  # waits, then destroys the event (kept if either fails)
        else:
            self._gpu.destroy_event(orphan)

    def _free_memories(self, raise_first: bool) -> None:
        self._memories, first = free_each(self._memories, lambda m: m.free(), _log, "host_tier_free_failed", field="memory")
        if first is not None and raise_first:
            raise first
