"""Stream arguments: ints and `__cuda_stream__` objects, at every public entry point."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import KvCacheConfig, PagedKvCache, SequenceTable
from pagedkv.core.streams import is_stream_object, stream_handle


class EngineStream:
    """An engine's stream object, as cuda.core's Stream speaks the protocol (a method)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class TupleStream:
    """An older form of the protocol: the tuple as an attribute."""

    def __init__(self, handle: int):
        self.__cuda_stream__ = (0, handle)


def test_stream_handle_of_ints_and_protocol_objects():
    assert stream_handle(0) == 0
    assert stream_handle(np.int64(7)) == 7 and type(stream_handle(np.int64(7))) is int
    assert stream_handle(EngineStream(0x5A5A00)) == 0x5A5A00
    assert stream_handle(TupleStream(12)) == 12
    assert is_stream_object(EngineStream(3)) and not is_stream_object(3)


@pytest.mark.parametrize(
    "bad, error, words",
    [
        (True, TypeError, "True"),
        (1.0, TypeError, "1.0"),
        ("0", TypeError, "'0'"),
        (None, TypeError, "None"),
        (-3, ValueError, "-3"),
        (EngineStream(-1), ValueError, "-1"),
        (EngineStream(2.5), TypeError, "2.5"),
    ],
)
def test_stream_handle_refuses_bad_values_naming_them(bad, error, words):
    with pytest.raises(error, match=words):
        stream_handle(bad)


def test_stream_handle_refuses_an_unknown_protocol_version_or_shape():
    class V1:
        def __cuda_stream__(self):
            return (1, 5)

    class Bare:
        def __cuda_stream__(self):
            return 5

    with pytest.raises(ValueError, match="version 1"):
        stream_handle(V1())
    with pytest.raises(TypeError, match="must give \\(version, handle\\)"):
        stream_handle(Bare())


def _bf16_cache(gpu):
    config = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=2, dtype="bf16")
    return PagedKvCache(config, num_blocks=8, gpu=gpu)


def test_host_backend_takes_stream_objects_and_still_refuses_unknown_ones(host):
    handle = host.create_stream()
    stream = EngineStream(handle)
    host.synchronize(stream)
    ptr = host.alloc(64)
    host.memset_async(ptr, 0x3C, 64, stream)
    assert host.view(ptr, 64).tolist() == [0x3C] * 64
    with pytest.raises(ValueError, match="unknown stream 99"):
        host.synchronize(EngineStream(99))
    host.free(ptr)
    host.destroy_stream(handle)


def test_cache_entry_points_take_a_stream_object(host):
    cache = _bf16_cache(host)
    stream = EngineStream(host.create_stream())
    blocks = cache.alloc_blocks(2)
    cache.poison_blocks(blocks, host, stream)
    k, v = cache.read_block(1, blocks[1], host)
    assert set(k.tolist()) == {0xFF} and set(v.tolist()) == {0xFF}
    cache.zero_block(blocks[0], host, stream)
    cache.copy_blocks([(blocks[0], blocks[1])], host, stream)
    k, v = cache.read_block(1, blocks[1], host)
    assert set(k.tolist()) == {0} and set(v.tolist()) == {0}
    rows = np.full((1, 1, 16), 2.0, dtype=np.float32)
    cache.write_tokens(0, [blocks[1] * 4 + 3], rows, rows, host, stream)
    k_back, _ = cache.read_tokens(0, [blocks[1] * 4 + 3], host)
    assert k_back.tolist() == rows.tolist()
    cache.debug_kv_checksum_per_layer(blocks, 1, host, stream, tag="stream-object")
    cache.free_blocks(blocks)
    cache.release(host)


def test_sequence_table_takes_a_stream_object_and_refuses_a_bad_one(host, env_flags):
    env_flags(METRALE_KV_POISON="1")
    cache = _bf16_cache(host)
    table = SequenceTable(cache, gpu=host, stream=EngineStream(host.create_stream()))
    table.add("a", [1, 2, 3, 4, 5])
    k, _ = cache.read_block(0, table.blocks("a")[1], host)
    assert set(k.tolist()) == {0xFF}  # initialised (poisoned) on the engine's stream
    with pytest.raises(TypeError, match="1.5"):
        SequenceTable(cache, gpu=host, stream=1.5)
    table.free("a")
    table.release()
    cache.release(host)
