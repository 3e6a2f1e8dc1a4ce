"""pagedkv.events: KV events on the wire, the prefix cache's events published in vLLM's
KV-event format, so routers that follow vLLM engines (vLLM's router, llm-d, Dynamo) follow
pagedkv's too.

`ZmqPublisher(endpoint, topic=..., replay_endpoint=...)` is a callable a `PrefixCache` takes
as `on_event`; `wire` encodes and decodes the batches. Both need the `events` extra
(`pyzmq`, `msgpack`); importing this package does not.

May import: `pagedkv.sequences`, `pagedkv.core`, `pagedkv.errors`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["PublisherStats", "ZmqPublisher", "decode_batch", "encode_batch"]

if TYPE_CHECKING:
    from .wire import decode_batch, encode_batch
    from .zmq_publisher import PublisherStats, ZmqPublisher


def __getattr__(name: str):
    """The publisher and the codec, imported on first use (they need the `events` extra)."""
    if name in ("ZmqPublisher", "PublisherStats"):
        from . import zmq_publisher

        return getattr(zmq_publisher, name)
    if name in ("decode_batch", "encode_batch"):
        from . import wire

        return getattr(wire, name)
    raise AttributeError(f"module 'pagedkv.events' has no attribute {name!r}")
