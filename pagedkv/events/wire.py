"""vLLM's KV-event wire format (`vllm/distributed/kv_events.py`): a batch is the msgpack of
`KVEventBatch(ts, events, data_parallel_rank)`, an array-like msgspec struct with
default-valued trailing fields omitted (so `[ts, events]` when the rank is None). Each
event is one of vLLM's structs, in one of the two encodings vLLM has used:

- "array" (vLLM up to 0.25: `array_like=True` events): a tagged array of the fields in
  vLLM's order, trailing fields at their default omitted:
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]`,
  `["BlockRemoved", block_hashes, medium, group_idx]`, `["AllBlocksCleared"]`;
- "map" (vLLM from 0.26, its PR 42892: events as named-field maps): `{"type":
  "BlockStored", "block_hashes": ..., ...}` with the same names, fields at their default
  omitted (`lora_id`, `medium` and `lora_name` have none: always there).

Hashes are ints (pagedkv's default 64-bit scheme) or 32-byte strings ("vllm-sha256-cbor",
as vLLM sends them unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); `lora_id` is the adapter
id, None for the base model (0); `lora_name` is None (pagedkv's LoRA name is an extra key,
where vLLM's block hashes put it); `extra_keys` is per block the tuple of its extra keys or
None, left out when no block has any. A hybrid prefix cache's events carry `group_idx`, and
its stores the group's `kv_cache_spec_kind` ("full_attention", "sliding_window", "mamba")
and a sliding group's window in tokens; a cache without groups leaves them out.
"""

from __future__ import annotations

from typing import Iterable

from ..sequences.events import AllBlocksCleared, BlockRemoved, BlockStored
from ..sequences.hybrid_prefix import GroupBlockRemoved, GroupBlockStored

ENCODINGS = ("array", "map")
"""The event encodings `encode_batch` writes (see the module docstring)."""

STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                 "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
"""vLLM's `BlockStored` fields in order; the first 7 have no default, the rest default to None."""

REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
"""vLLM's `BlockRemoved` fields in order; the first 2 have no default."""

_STORED_REQUIRED, _REMOVED_REQUIRED = 7, 2


def _msgpack():
    try:
        import msgpack
    except ImportError as err:  # pragma: no cover - the events extra installs it
        raise ImportError("the KV-event wire format needs msgpack: pip install 'pagedkv[events]'") from err
    return msgpack


_PACKER = None


def _packer():
    """One msgpack Packer (bin type for bytes; reused: packing is the publisher thread's)."""
    global _PACKER
    if _PACKER is None:
        _PACKER = _msgpack().Packer(use_bin_type=True)
    return _PACKER


def _values(event: object) -> tuple[str, tuple, int]:
    """(vLLM's tag, the field values in vLLM's order, how many of them have no default)."""
    kind = type(event)
    if kind is BlockStored:
        return "BlockStored", (event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                               event.adapter_id or None, event.medium, None, event.extra_keys, event.group_idx,
                               event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window), _STORED_REQUIRED
    if kind is BlockRemoved:
        return "BlockRemoved", (event.block_hashes, event.medium, event.group_idx), _REMOVED_REQUIRED
    if kind is GroupBlockStored:
        return "BlockStored", ((event.block_hash,), event.parent_block_hash, event.token_ids, event.block_size,
                               event.adapter_id or None, event.medium, None,
                               None if event.extra_keys is None else (event.extra_keys,), event.group,
                               event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window), _STORED_REQUIRED
    if kind is GroupBlockRemoved:
        return "BlockRemoved", ((event.block_hash,), event.medium, event.group), _REMOVED_REQUIRED
    if kind is AllBlocksCleared:
        return "AllBlocksCleared", (), 0
    raise TypeError(f"not a KV event: {type(event).__name__}")


def event_fields(event: object) -> tuple:
    """One pagedkv event as vLLM's tagged array (a tuple: msgpack writes it as an array),
    trailing fields at their default (None) left out."""
    kind = type(event)
    if kind is BlockStored and event.extra_keys is None and event.group_idx is None:  # the usual store
        if event.kv_cache_spec_kind is None and event.kv_cache_spec_sliding_window is None:
            return ("BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                    event.adapter_id or None, event.medium, None)
    elif kind is BlockRemoved and event.group_idx is None:
        return ("BlockRemoved", event.block_hashes, event.medium)
    tag, values, required = _values(event)
    n = len(values)
    while n > required and values[n - 1] is None:
        n -= 1
    return (tag, *values[:n])


def event_map(event: object) -> dict:
    """One pagedkv event as vLLM's named-field map: `type` first, then every field without
    a default and those not at their default (None), in vLLM's order."""
    tag, values, required = _values(event)
    names = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS
    out: dict = {"type": tag}
    for i, (name, value) in enumerate(zip(names, values)):
        if i < required or value is not None:
            out[name] = value
    return out


def encode_batch(ts: float, events: Iterable[object], data_parallel_rank: int | None = None,
                 encoding: str = "array") -> bytes:
    """The msgpack payload of one `KVEventBatch`, its events in `encoding` ("array" or
    "map"; ValueError otherwise)."""
    if encoding == "array":
        fields = [event_fields(e) for e in events]
    elif encoding == "map":
        fields = [event_map(e) for e in events]
    else:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    body = (float(ts), fields) if data_parallel_rank is None else (float(ts), fields, data_parallel_rank)
    return _packer().pack(body)


def decode_batch(payload: bytes) -> tuple[float, list, int | None]:
    """(ts, events as tagged lists or maps, data_parallel_rank) of a batch payload, for subscribers."""
    body = _msgpack().unpackb(payload, raw=False)
    return body[0], body[1], body[2] if len(body) > 2 else None
