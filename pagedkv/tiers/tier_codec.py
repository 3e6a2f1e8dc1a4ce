"""TierCodec: a host tier's blocks in a smaller pagedkv format than the device's, encoded
on the device before the copy down and decoded on the device after the copy up.

No kernel of its own: the codec runs the KV row kernels through their Python entry points
(`kv.rows.read_tokens` / `write_tokens`, one launch per layer each on CudaBackend; the host
codecs on HostBackend). Swapping `k` device blocks out, in chunks of `staging_blocks`:
decode each transcoded layer's rows of the blocks (the read path, float32, turbo sides in
the model's basis) into a device row buffer, encode them (the write path) into a staging
pool of the tier format, then ONE `copy_batch_async` per chunk moves every row to the host
blocks: transcoded rows from the staging pool, the others (layers whose tier format is
their own) straight from the device pools. Swapping in runs the same steps backwards.

The bytes are exactly those of the host codecs: a host block holds
`encode(tier, decode(device, x))` and a block swapped back in holds
`encode(device, decode(tier, host))` (tests compare every pairing). The error a pairing
adds is `pagedkv quality --tier`'s table.

Ordering: everything is enqueued on the swap's stream; the slots a chunk's kernels read are
uploaded with a synchronous copy, so the host first waits for the previous chunk (and for
the codec's previous swap, when that ran on another stream).

Worked example: a BF16 cache of 2 layers with 8 KV heads x 128 and block 16 has 64 KiB a
side and block; `format="fp8"` makes host blocks of 32 KiB a side (half the PCIe bytes);
`format="turbo4"` 18 KiB (9/32).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..core.config import KvCacheConfig
from ..core.dtype import KvCacheDtype
from ..interop.device_array import DeviceArray
from ..kv import rows as kv_rows
from ..kv.pools import KvPools


def tier_config(config: KvCacheConfig, format: Any) -> tuple[KvCacheConfig, list[bool]]:
    """(the config of the tier's blocks, per layer whether it is transcoded) for `format`: a
    format name for every layer, or a sequence of one name (or None: the layer's own) per
    layer. ValueError naming the layer when a tier format would not be smaller or equal."""
    if isinstance(format, (str, KvCacheDtype)):
        formats = [KvCacheDtype.parse(format)] * config.num_layers
    else:
        formats = list(format)
        if len(formats) != config.num_layers:
            raise ValueError(f"format lists {len(formats)} layer formats for a cache of {config.num_layers} layers")
        formats = [config.dtype_for_layer(i) if f is None else KvCacheDtype.parse(f) for i, f in enumerate(formats)]
    dims = tuple(config.dims_for_layer(i) for i in range(config.num_layers))
    tier = KvCacheConfig(block_size=config.block_size, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                         num_layers=config.num_layers, dtype=formats[0], layer_dtypes=tuple(formats), layer_dims=dims,
                         v_aliases_k=config.v_aliases_k, layout=config.layout, k_scale=config.k_scale,
                         v_scale=config.v_scale)
    transcoded = []
    for layer in range(config.num_layers):
        mine = tier.k_block_bytes_for_layer(layer) + tier.v_block_bytes_for_layer(layer)
        theirs = config.k_block_bytes_for_layer(layer) + config.v_block_bytes_for_layer(layer)
        if mine > theirs:
            raise ValueError(f"tier format {formats[layer]} of layer {layer} takes {mine} bytes a block, more than "
                             f"its device format {config.dtype_for_layer(layer)} ({theirs}): a tier format must be smaller")
        transcoded.append(formats[layer] != config.dtype_for_layer(layer))
    return tier, transcoded


class TierCodec:
    """Device-side encoding of `cache`'s blocks into `format` (see the module docstring),
    with `staging_blocks` blocks of staging on `gpu`. `release(gpu)` frees it."""

    def __init__(self, cache: Any, format: Any, gpu: Any, staging_blocks: int = 64):
        config = cache.config()
        self.config, self.transcoded = tier_config(config, format)
        self._name = str(self.config.dtype) if len(set(self.config.layer_dtypes)) == 1 else ",".join(
            str(d) for d in self.config.layer_dtypes)
        self._cache = cache
        self._gpu = gpu
        self._n = staging_blocks
        bs = config.block_size
        tokens = staging_blocks * bs
        widest = max(h * d for h, d in (config.dims_for_layer(i) for i in range(config.num_layers)))
        self._allocs: list[Any] = []
        self._staging: KvPools | None = None
        try:
            self._staging = KvPools(self.config, staging_blocks, gpu)
            self._k_rows, self._v_rows = (self._alloc(tokens * widest * 4) for _ in range(2))
            self._src_slots, self._stage_slots = (self._alloc(tokens * 8) for _ in range(2))
            gpu.copy_h2d(np.arange(tokens, dtype=np.int64), self._stage_slots)
        except BaseException:
            self.release(gpu)
            raise
        self._busy: Any = None  # the stream the codec's last swap ran on

    def _alloc(self, nbytes: int) -> Any:
        ptr = self._gpu.alloc(nbytes)
        self._allocs.append(ptr)
        return ptr

    def name(self) -> str:
        """The tier format's name (one name, or the per-layer names joined by commas)."""
        return self._name

    def host_strides(self, cache: Any) -> list[int]:
        """Bytes of one host block per region row (the tier format's strides)."""
        config = self.config
        out = []
        for layer in range(config.num_layers):
            out.append(config.k_block_bytes_for_layer(layer))
            if not config.v_aliases_k:
                out.append(config.v_block_bytes_for_layer(layer))
        return out

    def swap(self, device: Sequence[int], host: Sequence[int], host_bases: np.ndarray, host_strides: np.ndarray,
             stream: Any, to_host: bool) -> None:
        """Move blocks `device[i]` <-> host blocks `host[i]` through the codec, in chunks,
        enqueued on `stream` (arguments checked by the host tier)."""
        gpu, cache = self._gpu, self._cache
        pools, staging = cache.pools(), self._staging
        regions = cache.block_regions()
        dev_bases, dev_strides = regions.bases.astype(np.int64), regions.strides.astype(np.int64)
        stage = staging.regions()
        stage_bases, stage_strides = stage.bases.astype(np.int64), stage.strides.astype(np.int64)
        rows = np.array([self.transcoded[r // (1 if cache.config().v_aliases_k else 2)] for r in range(len(dev_bases))])
        bs = cache.block_size()
        for start in range(0, len(device), self._n):
            d = np.asarray(device[start : start + self._n], dtype=np.int64)
            h = np.asarray(host[start : start + self._n], dtype=np.int64)
            k = d.size
            if rows.any():
                if self._busy is not None:
                    gpu.synchronize(self._busy)  # the previous chunk (or swap) still reads the slot buffer
                gpu.copy_h2d((d[:, None] * bs + np.arange(bs)).reshape(-1), self._src_slots)
                self._busy = stream
            i = np.arange(k, dtype=np.int64)
            here = np.where(rows[:, None], stage_bases[:, None] + i[None, :] * stage_strides[:, None],
                            dev_bases[:, None] + d[None, :] * dev_strides[:, None])
            there = host_bases[:, None] + h[None, :] * host_strides[:, None]
            sizes = np.broadcast_to(host_strides[:, None], here.shape)
            if to_host:
                self._transcode(pools, staging, k * bs, stream, down=True)
                gpu.copy_batch_async(there.reshape(-1), here.reshape(-1), sizes.reshape(-1), stream)
            else:
                gpu.copy_batch_async(here.reshape(-1), there.reshape(-1), sizes.reshape(-1), stream)
                self._transcode(staging, pools, k * bs, stream, down=False)

    def _transcode(self, src: KvPools, dst: KvPools, tokens: int, stream: Any, down: bool) -> None:
        """Decode the transcoded layers' rows of `src` and encode them into `dst`: device
        block slots are in the slot buffer, staging slots 0.. in the other."""
        gpu, config = self._gpu, self.config
        src_slots = DeviceArray(int(self._src_slots if down else self._stage_slots), (tokens,), "int64", backend=gpu)
        dst_slots = DeviceArray(int(self._stage_slots if down else self._src_slots), (tokens,), "int64", backend=gpu)
        for layer, transcoded in enumerate(self.transcoded):
            if not transcoded:
                continue
            heads, head_dim = config.dims_for_layer(layer)
            k = DeviceArray(int(self._k_rows), (tokens, heads, head_dim), "float32", backend=gpu)
            v = DeviceArray(int(self._v_rows), (tokens, heads, head_dim), "float32", backend=gpu)
            kv_rows.read_tokens(src, layer, src_slots, gpu, k_scale=config.k_scale, v_scale=config.v_scale,
                                out_k=k, out_v=v, stream=stream)  # (the tier's scales are the cache's)
            kv_rows.write_tokens(dst, layer, dst_slots, k, None if config.v_aliases_k else v, gpu, stream,
                                 config.k_scale, config.v_scale)

    def release(self, gpu: Any) -> None:
        """Free the staging pool and buffers (after the swaps using them are done); what
        fails stays recorded for a retry, and the first error is raised."""
        first = None
        if self._staging is not None:
            try:
                self._staging.release(gpu)
                self._staging = None
            except Exception as err:  # noqa: BLE001 - the buffers must still be attempted
                first = err
        kept = []
        for ptr in self._allocs:
            try:
                gpu.free(ptr)
            except Exception as err:  # noqa: BLE001
                kept.append(ptr)
                first = first or err
        self._allocs = kept
        if first is not None:
            raise first
