"""Helpers several test modules share (importable as `shared_helpers`: tests/ is on the path)."""

from __future__ import annotations

import threading


def nixl_reason() -> str | None:
    """None when NIXL loads, else why not (the skip reason of the transfer tests)."""
    from pagedkv.tiers.transfer import NixlUnavailable, load_nixl

    try:
        load_nixl()
    except NixlUnavailable as err:
        return f"NIXL is not installed: {err}"
    return None


def from_other_thread(fn, timeout: float = 30.0):
    """Run `fn()` in a second thread: ("ok", its result) or (exception name, message)."""
    out = []

    def run():
        try:
            out.append(("ok", fn()))
        except BaseException as err:  # noqa: BLE001 - reported to the test
            out.append((type(err).__name__, str(err)))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the call did not return"
    return out[0]


HYBRID_STATE = (((4,), "float32"), ((2, 3), "float16"))
"""The state tensors of the hybrid tier tests' state layer."""


def hybrid_tier_config():
    """Four layers: a full group (0, 3), a sliding group of 8 tokens (1), a state group (2,
    checkpoints every 8 tokens); blocks of 4."""
    from pagedkv import KvCacheConfig
    from pagedkv.core.layer_groups import LayerGroup

    return KvCacheConfig(4, 1, 16, 4, "bf16", layer_groups=(
        LayerGroup("full", (0, 3)),
        LayerGroup("sliding", (1,), window=8),
        LayerGroup("state", (2,), state=HYBRID_STATE, checkpoint_every=8),
    ))


def counting_host():
    """A HostBackend that counts its batched copies (`batches`) and fails them while `fail`."""
    from pagedkv import HostBackend

    class CountingHost(HostBackend):
        batches = 0
        fail = False

        def copy_batch_async(self, *args, **kwargs):
            if self.fail:
                raise IndexError("copy_batch_async entry 0: planted failure")
            self.batches += 1
            return super().copy_batch_async(*args, **kwargs)

    return CountingHost()


def hits(prefix, cache, tokens, **kw) -> int:
    """The tokens `prefix.match(tokens, **kw)` hits, its references given back."""
    found = prefix.match(tokens, **kw)
    cache.free_blocks(found.blocks)
    return found.num_tokens


def keyed_table_world(block_size: int, blocks: int = 32):
    """A fixture body (a generator): a one-layer BF16 cache of `blocks` blocks of `block_size`
    on HostBackend with a PrefixCache and a SequenceTable, yielded as (cache, prefix, table);
    afterwards every sequence is freed, the invariants checked, everything released."""
    from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable

    gpu = HostBackend(1 << 26)
    config = KvCacheConfig(block_size=block_size, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(config, blocks, gpu)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    yield cache, prefix, table
    for seq in table.seq_ids():
        table.free(seq)
    table.check_invariants()
    prefix.close()
    cache.release(gpu)
