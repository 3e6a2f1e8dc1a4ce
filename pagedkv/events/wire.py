"""vLLM's KV-event wire format (`vllm/distributed/kv_events.py`): a batch is the msgpack of
`KVEventBatch(ts, events, data_parallel_rank)`, msgspec structs encoded array-like with
default-valued trailing fields omitted (so `[ts, events]` when the rank is None), and each
event a tagged array:

- `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`
- `["BlockRemoved", block_hashes, medium]`
- `["AllBlocksCleared"]`

Hashes are ints (pagedkv's default 64-bit scheme) or 32-byte strings ("vllm-sha256-cbor",
as vLLM sends them unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); `lora_id` is the adapter
id, None for the base model (0).
"""

from __future__ import annotations

from typing import Iterable

from ..sequences.events import AllBlocksCleared, BlockRemoved, BlockStored


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


def event_fields(event: object) -> tuple:
    """One pagedkv event as vLLM's tagged array (a tuple: msgpack writes it as an array)."""
    kind = type(event)
    if kind is BlockStored:
        return ("BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                event.adapter_id or None, event.medium)
    if kind is BlockRemoved:
        return ("BlockRemoved", event.block_hashes, event.medium)
    if kind is AllBlocksCleared:
        return ("AllBlocksCleared",)
    raise TypeError(f"not a KV event: {type(event).__name__}")


def encode_batch(ts: float, events: Iterable[object], data_parallel_rank: int | None = None) -> bytes:
    """The msgpack payload of one `KVEventBatch`."""
    fields = [event_fields(e) for e in events]
    body = (float(ts), fields) if data_parallel_rank is None else (float(ts), fields, data_parallel_rank)
    return _packer().pack(body)


def decode_batch(payload: bytes) -> tuple[float, list[list], int | None]:
    """(ts, events as tagged lists, data_parallel_rank) of a batch payload, for subscribers."""
    body = _msgpack().unpackb(payload, raw=False)
    return body[0], body[1], body[2] if len(body) > 2 else None
