"""Prefill writes of many layers in one launch: `LayerWritePlan`, made by
`PagedKvCache.plan_layer_writes`.

A prefill writes the same tokens' K and V rows into the same slots in every layer. The plan
names, once, the layers and the device buffers their rows will be in; each `write(slots,
stream)` then encodes every layer's rows on CudaBackend with one `pagedkv_kv_write_layers`
launch, byte-identical to a `write_tokens` per layer, and like it stream-ordered only (no
synchronisation, allocation or copy per call: it can be captured in a CUDA graph). The plan
keeps a small device table of the layers (allocated and uploaded when the plan is made),
freed by `close()`. On a backend without the KV row kernels (HostBackend) `write` is a
`write_tokens` per layer through the host codecs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..codecs.side import check_scale
from ..driver.kv_kernels import KvSideArgs
from ..interop.device_array import check_backend
from . import device_path as kv_device
from . import rows as kv_rows


class LayerWritePlan:
    """The writes of `layers` (distinct layer indices) from `k_rows[i]` / `v_rows[i]` (device
    arrays of layer `layers[i]`: DeviceArray or DLPack producers, `[num_tokens, heads,
    head_dim]` float32 or BF16, one `num_tokens` for all; `v_rows` None under
    `v_aliases_k`), fp8 sides divided by `k_scale` / `v_scale`. Validated when made
    (ValueError/TypeError naming the bad layer or array, nothing allocated then). The row
    buffers are read at each `write`, so new contents written into them make the next
    prefill; their addresses are taken when the plan is made (a DLPack producer is asked
    for its tensor then, on the legacy default stream). A row array naming another owning
    backend than `gpu` (`DeviceArray.backend`) is refused then, ValueError naming both. The plan is valid while the cache
    holds its pools and the row buffers stay allocated; close it first. Use from one
    thread at a time."""

    def __init__(self, pools, layers: Sequence[int], k_rows: Sequence[Any], v_rows: Sequence[Any] | None, gpu: Any,
                 k_scale: float = 1.0, v_scale: float = 1.0, nonfinite: int = 0,
                 check_blocks: Callable | None = None):
        config = pools.config()
        layers = [int(layer) for layer in layers]
        if not layers:
            raise ValueError("layers must name at least one layer")
        if len(set(layers)) != len(layers):
            raise ValueError(f"layers must be distinct, got {layers}")
        for layer in layers:
            if not 0 <= layer < config.num_layers:
                raise ValueError(f"layer {layer} is not one of the cache's {config.num_layers} layers")
        aliased = config.v_aliases_k
        if v_rows is None and not aliased:
            raise TypeError("v_rows is required unless the cache's V aliases K")
        k_rows = list(k_rows)
        v_rows = [None] * len(layers) if v_rows is None else list(v_rows)
        if len(k_rows) != len(layers) or len(v_rows) != len(layers):
            raise ValueError(f"give one k and one v array per layer: {len(layers)} layers, "
                             f"{len(k_rows)} k arrays, {len(v_rows)} v arrays")
        check_scale(k_scale), check_scale(v_scale)
        self._pools, self._gpu, self._layers = pools, gpu, layers
        self._k_rows, self._v_rows = k_rows, v_rows
        self._scales = (k_scale, v_scale)
        self._nonfinite, self._check_blocks = nonfinite, check_blocks
        self._table = None
        self._launch = None
        self._prepared: dict = {}
        self._closed = False
        self._device = kv_device.has_kv_kernels(gpu)
        self.num_tokens = None
        """The token count every write takes (the rows' first axis)."""
        entries = []
        for layer, k, v in zip(layers, k_rows, v_rows):
            heads, head_dim, k_fmt, v_fmt = kv_rows.layer_geometry(pools, layer)
            if not self._device:
                rows = kv_device.host_view(k, f"k of layer {layer}", gpu) if kv_device.is_device_input(k) else k
                check_backend(v, f"v of layer {layer}", gpu)
                self.num_tokens = self._tokens(rows, layer)
                continue
            k_arr = _layer_rows(k, f"k of layer {layer}", gpu, heads, head_dim, self.num_tokens)
            self.num_tokens = k_arr.shape[0]
            k_side = KvSideArgs(k_fmt, int(pools.k_pool(layer)), pools.k_stride(layer), k_arr.ptr, k_arr.row_stride,
                                k_arr.dtype.name == "bfloat16", k_scale,
                                layout=config.layout)
            if aliased and v is None:
                v_side = KvSideArgs(None, 0, 0, 0, 0)
            else:
                v_arr = _layer_rows(v, f"v of layer {layer}", gpu, heads, head_dim, self.num_tokens)
                v_side = KvSideArgs(None if aliased else v_fmt, int(pools.v_pool(layer)), pools.v_stride(layer),
                                    v_arr.ptr, v_arr.row_stride, v_arr.dtype.name == "bfloat16", v_scale,
                                    layout=config.layout)
            entries.append((heads, head_dim, k_side, v_side))
        if self._device:
            table = gpu.kv_layer_table(entries)
            self._launch = gpu.kv_layer_launch(table) if hasattr(gpu, "kv_layer_launch") else None
            ptr = gpu.alloc(len(table))
            try:
                gpu.copy_h2d(np.frombuffer(table, np.uint8), ptr)
            except BaseException:
                gpu.free(ptr)
                raise
            self._table = ptr

    def _tokens(self, rows: Any, layer: int) -> int:
        tokens = len(rows)
        if self.num_tokens is not None and tokens != self.num_tokens:
            raise ValueError(f"k of layer {layer} holds {tokens} tokens, the other layers {self.num_tokens}")
        return tokens

    def write(self, slots: Any, stream: int) -> None:
        """Encode every layer's rows into `slots` (`num_tokens` int64 slots: a device array or
        a SequenceTable export on CudaBackend, -1 skips), enqueued on `stream`: one launch on
        CudaBackend (slot values not checked on the host, as in `write_tokens`' device
        path), a `write_tokens` per layer elsewhere."""
        if self._closed:
            raise RuntimeError("this LayerWritePlan is closed")
        k_scale, v_scale = self._scales
        if not self._device:
            for layer, k, v in zip(self._layers, self._k_rows, self._v_rows):
                kv_rows.write_tokens(self._pools, layer, slots, k, v, self._gpu, stream, k_scale, v_scale,
                                     check_blocks=self._check_blocks)
            return
        _launch_planned(self, slots, stream, False, self._nonfinite)

    def close(self) -> None:
        """Free the device table (after the work enqueued with it: the backend's free waits
        for the device). A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._table is not None:
            table, self._table = self._table, None
            self._gpu.free(table)


def _launch_planned(plan, slots: Any, stream, reading: bool, nonfinite: int) -> None:
    """One launch of `plan` (a write or read plan on CudaBackend) for `slots`: a DeviceArray
    seen before takes its prepared launch; anything else is validated first."""
    key = kv_device._array_key(slots)
    prepared = plan._prepared.get(key) if key is not None else None
    if prepared is None:
        slot_arr = kv_device.slot_array(slots, plan._gpu, stream)
        if slot_arr.shape[0] != plan.num_tokens:
            raise ValueError(f"slots must hold the plan's {plan.num_tokens} tokens, got {slot_arr.shape[0]}")
        config = plan._pools.config()
        gpu = plan._gpu
        gpu._stream(stream)
        prepared = gpu.kv_prepare_layers(reading, plan._table, len(plan._layers), slot_arr.ptr, plan.num_tokens,
                                         config.block_size, plan._pools.num_blocks() * config.block_size,
                                         nonfinite, plan._launch)
        limit = plan._pools.num_blocks() * config.block_size
        check = [] if reading else kv_device.slot_check(gpu, slot_arr.ptr, plan.num_tokens, limit, nonfinite)
        prepared = check + ([prepared] if prepared is not None else [])
        if key is not None:
            if len(plan._prepared) >= 64:
                plan._prepared.clear()
            plan._prepared[key] = prepared
    for launch in prepared:
        launch.launch(stream)


def _layer_rows(x: Any, what: str, gpu: Any, heads: int, head_dim: int, tokens: int | None):
    if not kv_device.is_device_input(x):
        raise TypeError(f"{what} must be a DeviceArray or a DLPack producer on the device, got {type(x).__name__}")
    return kv_device.rows_array(x, what, gpu, heads, head_dim, tokens)


class LayerReadPlan:
    """The reads of `layers` (distinct layer indices) into `out_k[i]` / `out_v[i]` (device
    arrays of layer `layers[i]`: DeviceArray or DLPack producers, `[num_tokens, heads,
    head_dim]` float32 or BF16, one `num_tokens` for all), turbo sides unrotated unless
    `unrotate=False`, fp8 sides multiplied by `k_scale` / `v_scale`: a decode step's read of
    every layer. Validated when made (nothing allocated then on a failure). Each
    `read(slots, stream)` decodes the slots of every layer into the outputs with one
    `pagedkv_kv_read_layers` launch on CudaBackend, byte-identical to a `read_tokens` per
    layer (a slot outside the cache reads as zeros) and capturable in a CUDA graph; elsewhere a
    `read_tokens` per layer. An output naming another owning backend than `gpu`
    (`DeviceArray.backend`) is refused when the plan is made, ValueError naming both. The plan keeps a small device table, freed by `close()`; it is
    valid while the cache holds its pools and the outputs stay allocated. Use from one thread
    at a time."""

    def __init__(self, pools, layers: Sequence[int], out_k: Sequence[Any], out_v: Sequence[Any], gpu: Any,
                 unrotate: bool = True, k_scale: float = 1.0, v_scale: float = 1.0):
        config = pools.config()
        layers = [int(layer) for layer in layers]
        if not layers:
            raise ValueError("layers must name at least one layer")
        if len(set(layers)) != len(layers):
            raise ValueError(f"layers must be distinct, got {layers}")
        for layer in layers:
            if not 0 <= layer < config.num_layers:
                raise ValueError(f"layer {layer} is not one of the cache's {config.num_layers} layers")
        out_k, out_v = list(out_k), list(out_v)
        if len(out_k) != len(layers) or len(out_v) != len(layers):
            raise ValueError(f"give one out_k and one out_v array per layer: {len(layers)} layers, "
                             f"{len(out_k)} out_k arrays, {len(out_v)} out_v arrays")
        check_scale(k_scale), check_scale(v_scale)
        self._pools, self._gpu, self._layers = pools, gpu, layers
        self._outs = (out_k, out_v)
        self._read_args = (unrotate, k_scale, v_scale)
        self._table = None
        self._launch = None
        self._prepared: dict = {}
        self._closed = False
        self._device = kv_device.has_kv_kernels(gpu)
        self.num_tokens = None
        """The token count every read takes (the outputs' first axis)."""
        entries = []
        for layer, ok, ov in zip(layers, out_k, out_v):
            heads, head_dim, k_fmt, v_fmt = kv_rows.layer_geometry(pools, layer)
            if not self._device:
                check_backend(ok, f"out_k of layer {layer}", gpu)
                check_backend(ov, f"out_v of layer {layer}", gpu)
                continue
            k_arr = _layer_rows(ok, f"out_k of layer {layer}", gpu, heads, head_dim, self.num_tokens)
            self.num_tokens = k_arr.shape[0]
            v_arr = _layer_rows(ov, f"out_v of layer {layer}", gpu, heads, head_dim, self.num_tokens)
            v_pool, v_stride = (pools.k_pool(layer), pools.k_stride(layer)) if config.v_aliases_k else (
                pools.v_pool(layer), pools.v_stride(layer))
            k_side = KvSideArgs(k_fmt, int(pools.k_pool(layer)), pools.k_stride(layer), k_arr.ptr, k_arr.row_stride,
                                k_arr.dtype.name == "bfloat16", k_scale, unrotate,
                                layout=config.layout)
            v_side = KvSideArgs(k_fmt if config.v_aliases_k else v_fmt, int(v_pool), v_stride, v_arr.ptr,
                                v_arr.row_stride, v_arr.dtype.name == "bfloat16",
                                k_scale if config.v_aliases_k else v_scale, unrotate,
                                layout=config.layout)
            entries.append((heads, head_dim, k_side, v_side))
        if self._device:
            table = gpu.kv_layer_table(entries, reading=True)
            self._launch = gpu.kv_layer_launch(table)
            ptr = gpu.alloc(len(table))
            try:
                gpu.copy_h2d(np.frombuffer(table, np.uint8), ptr)
            except BaseException:
                gpu.free(ptr)
                raise
            self._table = ptr

    def read(self, slots: Any, stream: int) -> None:
        """Decode `slots` (`num_tokens` int64 slots: a device array or a SequenceTable export on
        CudaBackend) of every planned layer into its outputs, enqueued on `stream`: one launch on
        CudaBackend, a `read_tokens` per layer elsewhere."""
        if self._closed:
            raise RuntimeError("this LayerReadPlan is closed")
        unrotate, k_scale, v_scale = self._read_args
        if not self._device:
            for layer, ok, ov in zip(self._layers, *self._outs):
                kv_rows.read_tokens(self._pools, layer, slots, self._gpu, unrotate, k_scale, v_scale,
                                    out_k=ok, out_v=ov, stream=stream)
            return
        _launch_planned(self, slots, stream, True, 0)

    def close(self) -> None:
        """Free the device table (after the work enqueued with it: the backend's free waits
        for the device). A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._table is not None:
            table, self._table = self._table, None
            self._gpu.free(table)
