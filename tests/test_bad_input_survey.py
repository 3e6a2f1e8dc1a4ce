"""A bad-input survey of the newer APIs (views, exports, tiers, elastic pools, transfer
metadata, conformance, the command line), as a new user would trip on them (issue 21).

Every case must end in a clear refusal: an exception of the kind the module uses (a
PagedKvError subclass, ValueError, TypeError, KeyError or IndexError; never another type,
which would be an internal error) whose message names the bad value, within a bound (a
call that does not return is a hang), with the world's state unchanged (counts, free
lists, cached blocks, host-tier blocks, sequences).

Accepted on purpose (not refused, documented here and in the README):
- `tier.read_block` of a free host block reads its last bytes (a diagnostic read).
- A second `free_blocks` of a `match()` result while a sequence also holds the blocks: the
  counts cannot tell whose reference it drops; the sequence's later free raises.
- A stream handle on a backend without `check_stream` (CudaBackend: a handle is a driver
  pointer it cannot check without using it) is checked when work is enqueued on it.
- A `DeviceArray` built without `backend=` is taken on the caller's word: only its DLPack
  device, when known, is checked (an address of another backend on the same device is not
  caught). One naming its backend, and every array pagedkv hands out (views, exports), is
  checked against the call's backend.
- `pagedkv quality --tokens 100000` runs: the work streams in chunks of
  `pagedkv.kv.quality.CHUNK_ELEMENTS` values (memory bounded by the chunk), with a progress
  line on stderr on a terminal or with `--progress`; only past 10,000,000 tokens (time, not
  memory) or a token's rows over one chunk is it refused.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from pagedkv import (
    DeviceArray,
    HostBackend,
    HostTier,
    KvCacheConfig,
    PagedKvCache,
    PagedKvError,
    PrefixCache,
    SequenceTable,
)
from pagedkv.cli import main as cli_main
from pagedkv.core.validate import seconds
from pagedkv.testing import backend_conformance
from pagedkv.tiers import transfer_metadata as tm
from pagedkv.tiers.transfer_layout import layout_of

CLEAR = (PagedKvError, ValueError, TypeError, KeyError, IndexError)
BS = 4


class World:
    """A HostBackend cache with a prefix cache, a host tier and a table: one sequence
    live, two blocks cached on the device, two demoted into host blocks, an export taken."""

    def __init__(self):
        self.gpu = HostBackend(1 << 24)
        self.cache = PagedKvCache(KvCacheConfig(BS, 1, 16, 2, "bf16"), 8, self.gpu)
        self.elastic_gpu = HostBackend(1 << 24, vmm_granularity=4096)
        self.elastic = PagedKvCache(KvCacheConfig(BS, 1, 16, 2, "bf16"), 64, self.elastic_gpu, elastic=True)
        self.elastic_blocks = self.elastic.alloc_blocks(3)
        self.tier = HostTier(self.cache, 4, self.gpu)
        self.prefix = PrefixCache(self.cache, host_tier=self.tier)
        self.table = SequenceTable(self.cache, self.prefix, self.gpu)
        self.table.add("old", list(range(100, 109)))
        self.table.free("old")  # two full blocks cached
        held = self.cache.alloc_blocks(8)  # evicts them into the host tier
        self.cache.free_blocks(held)
        self.table.add("a", list(range(9)))
        self.table.add("b", list(range(50, 55)))
        self.host_cached = self.tier.lru_blocks()
        assert len(self.host_cached) == 2
        self.spare_host = self.tier.alloc(1)  # allocated, not cached: a valid swap_out destination

    def state(self):
        cache, tier = self.cache, self.tier
        return (
            [cache.ref_count(b) for b in range(cache.num_blocks())], cache.num_free_blocks(),
            self.prefix.num_cached_blocks(), self.prefix.num_host_blocks(), tier.num_free_blocks(),
            tier.lru_blocks(), sorted(self.table.seq_ids()), [self.table.blocks(s) for s in ("a", "b")],
            self.elastic.resident_blocks(), self.elastic.mapped_bytes(), self.elastic.num_free_blocks(),
        )


def good_blob():
    cache = PagedKvCache(KvCacheConfig(BS, 1, 16, 2, "bf16"), 4, HostBackend(1 << 20))
    info = {"name": "p", "num_blocks": 4, "mem_type": "DRAM", "device_id": 0, "layout": layout_of(cache),
            "pools": [[0, "K", 1, 128], [0, "V", 2, 128], [1, "K", 3, 128], [1, "V", 4, 128]], "leases": 0}
    return info, tm.encode(info, b"nixl", None)


def blob_with(change):
    info, _ = good_blob()
    info = json.loads(json.dumps(info))
    info.update(nixl_bytes=4, nixl_digest=tm.digest(b"nixl"))
    change(info)
    text = json.dumps(info).encode()
    return tm.METADATA_MAGIC + len(text).to_bytes(8, "little") + text + b"nixl"


def foreign_rows(tokens: int = 1):
    """K/V rows in another HostBackend's memory, naming it as their owner."""
    other = HostBackend(1 << 20)
    return DeviceArray(other.alloc(tokens * 64), (tokens, 1, 16), "float32", backend=other)


def cli(*argv):
    status = cli_main(list(argv))
    if status == 0:
        return "accepted"
    raise ValueError(f"exit status {status}")


PLAN = ("plan", "--layers", "2", "--kv-heads", "1", "--head-dim", "16")

# name -> (call(world), what the message must contain)
CASES = {
    # views
    "k_view layer out of range": (lambda w: w.cache.k_view(2, w.gpu), "layer 2"),
    "k_view layer True": (lambda w: w.cache.k_view(True, w.gpu), "True"),
    "k_view of another backend": (lambda w: w.cache.k_view(0, HostBackend(1 << 20)), "another backend"),
    "k_view of an object": (lambda w: w.cache.k_view(0, object()), "another backend"),
    "k_view readonly=1": (lambda w: w.cache.k_view(0, w.gpu, readonly=1), "readonly must be a bool, got 1"),
    "k_view stream str": (lambda w: w.cache.k_view(0, w.gpu, stream="s"), "stream"),
    "k_view stream 99": (lambda w: w.cache.k_view(0, w.gpu, stream=99), "unknown stream 99"),
    "SequenceTable stream 99": (lambda w: SequenceTable(w.elastic, None, w.elastic_gpu, stream=99), "unknown stream 99"),
    "PrefixCache swap_stream 99": (lambda w: PrefixCache(w.elastic, host_tier=HostTier(w.elastic, 2, w.elastic_gpu),
                                                         swap_stream=99), "unknown stream 99"),
    "scale_view of bf16": (lambda w: w.cache.k_view(0, w.gpu).scale_view(), "no scale section"),
    "release while an export is alive": (
        lambda w: (setattr(w, "held_export", np.from_dlpack(w.cache.k_view(0, w.gpu).bits_view())), w.cache.release(w.gpu)),
        "DLPack export(s) of its pools are alive"),
    "fill_blocks on another backend": (lambda w: w.cache.fill_blocks(w.table.blocks("a"), 7, HostBackend(1 << 20), 0),
                                       "fill_blocks with HostBackend"),
    "write_tokens on another backend": (lambda w: w.cache.write_tokens(
        0, [w.table.blocks("b")[0] * BS], np.ones((1, 1, 16), np.float32), np.ones((1, 1, 16), np.float32),
        HostBackend(1 << 20), 0), "write_tokens with HostBackend"),
    "write_tokens of a DeviceArray of another backend": (lambda w: w.cache.write_tokens(
        0, [w.table.blocks("b")[0] * BS], np.ones((1, 1, 16), np.float32), foreign_rows(), w.gpu, 0),
        "a DeviceArray or view of another backend"),
    "read_tokens into a DeviceArray of another backend": (lambda w: w.cache.read_tokens(
        0, [0], w.gpu, out_k=foreign_rows(), out_v=foreign_rows()), "out_k is memory of HostBackend"),
    "write_tokens into slots of another backend's table": (lambda w: w.cache.write_tokens(
        0, SequenceTable(PagedKvCache(KvCacheConfig(BS, 1, 16, 2, "bf16"), 2, other := HostBackend(1 << 20)), None,
                         other).slot_mapping([], pad_to=1), np.ones((1, 1, 16), np.float32),
        np.ones((1, 1, 16), np.float32), w.gpu, 0), "slots is memory of HostBackend"),
    "plan_layer_writes of a DeviceArray of another backend": (
        lambda w: w.cache.plan_layer_writes([0], [foreign_rows()], [foreign_rows()], w.gpu), "k of layer 0 is memory of"),
    "read_block on another backend": (lambda w: w.cache.read_block(0, 0, HostBackend(1 << 20)), "read_block with"),
    "plan_layer_reads on another backend": (lambda w: w.cache.plan_layer_reads([0], [None], [None], object()),
                                            "plan_layer_reads with object"),
    # exports
    "block_table of a set": (lambda w: w.table.block_table({"a", "b"}), "must be ordered"),
    "block_table of dict keys": (lambda w: w.table.block_table({"a": 1}.keys()), "must be ordered"),
    "block_table of a str": (lambda w: w.table.block_table("ab"), "'ab'"),
    "block_table of an unknown id": (lambda w: w.table.block_table(["a", "zz"]), "zz"),
    "block_table repeating an id": (lambda w: w.table.block_table(["a", "a"]), "'a' is listed more than once"),
    "slot_mapping pad_to -1": (lambda w: w.table.slot_mapping(["a"], pad_to=-1), "-1"),
    "SequenceTable on another backend": (lambda w: SequenceTable(w.cache, w.prefix, HostBackend(1 << 20)),
                                         "is not the backend"),
    "add with adapter_id 2**64": (lambda w: w.table.add("c", [1, 2, 3, 4, 5], adapter_id=2**64),
                                  "18446744073709551616"),
    # tiers
    "tier.free of a prefix-cached host block": (lambda w: w.tier.free(w.host_cached[:1]), "PrefixCache holds it"),
    "tier.uncache of a prefix-cached host block": (lambda w: w.tier.uncache(w.host_cached), "PrefixCache holds it"),
    "tier.free of a free host block": (lambda w: w.tier.free([3]), "3"),
    "SequenceTable on another backend, no tier": (
        lambda w: SequenceTable(w.elastic, None, HostBackend(1 << 20)), "not the backend the cache was built on"),
    "tier.alloc -1": (lambda w: w.tier.alloc(-1), "-1"),
    "tier.alloc too many": (lambda w: w.tier.alloc(5), "5 block(s) asked"),
    "swap_out of a free device block": (lambda w: w.tier.swap_out([7], w.spare_host, 0), "7"),
    "swap_in from a free host block": (lambda w: w.tier.swap_in([3], w.table.blocks("b")[-1:], 0), "3"),
    "swap_out into a cached host block": (lambda w: w.tier.swap_out(w.table.blocks("a")[:1], w.host_cached[:1], 0),
                                          str(0)),
    # elastic
    "reserve -1": (lambda w: w.elastic.reserve(-1, w.elastic_gpu), "-1"),
    "reserve past the ceiling": (lambda w: w.elastic.reserve(10_000, w.elastic_gpu), "10000"),
    "shrink with streams=5": (lambda w: w.elastic.shrink(w.elastic_gpu, streams=5), "5"),
    "shrink on another backend": (lambda w: w.elastic.shrink(HostBackend(1 << 20)), "HostBackend"),
    # transfer metadata (no NIXL needed)
    "metadata nested 100,000 deep": (lambda w: tm.parse(tm.METADATA_MAGIC + (200_000).to_bytes(8, "little")
                                                        + b"[" * 100_000 + b"]" * 100_000), "100000 levels deep"),
    "metadata num_blocks a str": (lambda w: tm.parse(blob_with(lambda i: i.update(num_blocks="4"))), "num_blocks"),
    "metadata pools a dict": (lambda w: tm.parse(blob_with(lambda i: i.update(pools={}))), "pools"),
    "metadata layers of str": (lambda w: tm.parse(blob_with(lambda i: i["layout"].update(layers=["x", "y"]))),
                               "layout.layers[0]"),
    "metadata with 64 MiB of padding": (lambda w: tm.parse(good_blob()[1] + b" " * (64 << 20)), "over the bound"),
    "metadata truncated": (lambda w: tm.parse(good_blob()[1][:-2]), "truncated"),
    "metadata of str": (lambda w: tm.parse("x"), "str"),
    "timeout nan": (lambda w: seconds(float("nan")), "nan"),
    "timeout inf": (lambda w: seconds(float("inf")), "inf"),
    # conformance
    "backend_conformance only=[]": (lambda w: backend_conformance(HostBackend, only=[]), "only=[]"),
    "backend_conformance only='x'": (lambda w: backend_conformance(HostBackend, only="x"), "'x'"),
    "backend_conformance unknown rule": (lambda w: backend_conformance(HostBackend, only=["nope"]), "'nope'"),
    # command line
    "quality --tokens 1": (lambda w: cli("quality", "--tokens", "1"), "exit status 2"),
    "quality --tokens past the bound": (lambda w: cli("quality", "--tokens", "10000001"), "exit status 2"),
    "quality a token over one chunk": (lambda w: cli("quality", "--heads", "65536", "--head-dim", "32"),
                                       "exit status 2"),
    "plan --dtype ''": (lambda w: cli(*PLAN, "--memory", "1GiB", "--dtype", ""), "exit status 2"),
    "plan absurd --memory": (lambda w: cli(*PLAN, "--memory", "99999999999999999999TiB"), "exit status 2"),
}


def run_bounded(fn, bound: float = 60.0):
    """(kind, message) of `fn()`'s outcome; "hang" when it has not returned within `bound`."""
    out = []

    def target():
        try:
            out.append(("returned", repr(fn())[:80]))
        except BaseException as err:  # noqa: BLE001 - classified by the test
            out.append((err, str(err)))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(bound)
    return out[0] if out else ("hang", "")


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_is_refused_clearly_with_nothing_changed(case, capsys):
    world = World()
    before = world.state()
    call, named = CASES[case]
    outcome, message = run_bounded(lambda: call(world))
    assert outcome != "hang", f"{case}: no answer"
    assert outcome != "returned", f"{case}: silently accepted ({message})"
    assert isinstance(outcome, CLEAR), f"{case}: internal error {type(outcome).__name__}: {message}"
    if not message.startswith("exit status"):
        assert named in message, f"{case}: the message does not name {named!r}: {message}"
    else:
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("pagedkv "), err  # one line on stderr
    if hasattr(world, "held_export"):
        del world.held_export
    assert world.state() == before, f"{case}: the state changed"
