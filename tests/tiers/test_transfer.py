"""KvTransfer over NIXL: blocks written between two processes' HostBackend caches over UCX on
loopback, and every refusal (another layout, an unknown peer, a block out of range, a
timeout, a peer that is gone) with nothing sent. Skipped, with the reason, without NIXL."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, KvCacheError, PagedKvCache
from pagedkv.tiers.transfer import (
    METADATA_MAGIC,
    KvTransfer,
    LayoutMismatch,
    NixlUnavailable,
    TransferError,
    TransferTimeout,
    UnknownPeer,
    block_runs,
    layout_differences,
    layout_of,
)

# one worker runs the whole module: its module-scoped fixture is built once (pyproject: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("transfer")

from shared_helpers import nixl_reason  # noqa: E402

NIXL_REASON = nixl_reason()

needs_nixl = pytest.mark.skipif(NIXL_REASON is not None, reason=NIXL_REASON or "")

MIXED = dict(block_size=16, num_kv_heads=2, head_dim=64, num_layers=3, dtype="bf16",
             layer_dtypes=("bf16", "turbo4k_turbo3v", "fp8"), layer_dims=((2, 64), (2, 64), (1, 128)))
OTHER = dict(MIXED, layer_dims=((2, 64), (2, 64), (1, 64)))  # layer 2: another head_dim
BIG = dict(block_size=16, num_kv_heads=8, head_dim=128, num_layers=1, dtype="bf16")  # 64 KiB a block
FILL = 0xA5  # the receiver's blocks before anything arrives
WAIT = 20.0  # seconds: a bound on waits that must succeed, never reached when things work


def block_bytes(cache: PagedKvCache, gpu: HostBackend, blocks: list[int]) -> list[bytes]:
    """Every layer's K and V bytes of `blocks`, layer by layer, block by block."""
    out = []
    for layer in range(cache.config().num_layers):
        for b in blocks:
            k, v = cache.read_block(layer, b, gpu)
            out += [k.tobytes(), v.tobytes()]
    return out


def fill_random(cache: PagedKvCache, gpu: HostBackend, blocks: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    pools = cache.pools()
    for layer in range(cache.config().num_layers):
        for b in blocks:
            k = rng.integers(0, 256, pools.k_stride(layer), dtype=np.uint8)
            v = rng.integers(0, 256, pools.v_stride(layer), dtype=np.uint8)
            cache.write_block(layer, b, k, v, gpu)


def peer_main(conn, name: str, config: dict, num_blocks: int) -> None:
    """The other engine: a HostBackend cache behind a KvTransfer, driven over `conn`."""
    gpu = HostBackend(1 << 28)
    cache = PagedKvCache(KvCacheConfig(**config), num_blocks, gpu)
    transfer = KvTransfer(cache, gpu, name)
    while True:
        op, *args = conn.recv()
        try:
            if op == "metadata":
                result = transfer.metadata()
            elif op == "connect":
                result = transfer.connect(args[0])
            elif op == "alloc":
                result = cache.alloc_blocks(args[0])
                cache.fill_blocks(result, FILL, gpu, 0)
            elif op == "fill":
                result = fill_random(cache, gpu, *args)
            elif op == "read":
                result = block_bytes(cache, gpu, args[0])
            elif op == "send":
                handle = transfer.send(*args)
                handle.wait(WAIT)
                result = handle.nbytes
            elif op == "wait_notifications":
                result = transfer.wait_notifications(args[0])
            elif op == "close":
                transfer.close()
                cache.release(gpu)
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as err:  # noqa: BLE001 - the test process asserts on it
            conn.send(("err", f"{type(err).__name__}: {err}"))
        else:
            conn.send(("ok", result))


class Peer:
    """A peer process and the calls the test makes on it."""

    def __init__(self, name: str, config: dict, num_blocks: int):
        self.name = name
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=peer_main, args=(child, name, config, num_blocks), daemon=True)
        self.process.start()
        child.close()

    def call(self, *message):
        self._conn.send(message)
        if not self._conn.poll(WAIT + 10):
            raise AssertionError(f"peer {self.name} did not answer {message[0]!r}")
        status, result = self._conn.recv()
        if status != "ok":
            raise AssertionError(f"peer {self.name}: {message[0]} raised {result}")
        return result

    def call_err(self, *message) -> str:
        self._conn.send(message)
        status, result = self._conn.recv()
        assert status == "err", f"{message[0]} succeeded with {result!r}"
        return result

    def close(self) -> None:
        if self.process.is_alive():
            self.call("close")
        self.process.join(WAIT)


@pytest.fixture
def local():
    """This engine: a 16-block HostBackend cache of mixed formats with 5 blocks filled."""
    gpu = HostBackend(1 << 28)
    cache = PagedKvCache(KvCacheConfig(**MIXED), 16, gpu)
    blocks = cache.alloc_blocks(12)
    fill_random(cache, gpu, blocks, seed=7)
    yield cache, gpu, blocks
    cache.release(gpu)


@pytest.fixture(scope="module")
def receiver():
    if NIXL_REASON:
        pytest.skip(NIXL_REASON)
    peer = Peer("decoder", MIXED, 12)
    yield peer
    peer.close()


# -- without NIXL --------------------------------------------------------------------------


def test_import_never_loads_nixl_and_its_absence_is_a_clear_error():
    probe = (
        "import sys\n"
        "for m in ('nixl', 'nixl_cu13', 'nixl_cu12'): sys.modules[m] = None\n"
        "import pagedkv, pagedkv.tiers.transfer\n"
        "assert not [m for m in sys.modules if m.startswith('nixl') and sys.modules[m] is not None]\n"
        "from pagedkv import HostBackend, KvCacheConfig, PagedKvCache\n"
        "gpu = HostBackend(1 << 20)\n"
        "cache = PagedKvCache(KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=1, dtype='bf16'), 2, gpu)\n"
        "try:\n"
        "    pagedkv.tiers.transfer.KvTransfer(cache, gpu, 'a')\n"
        "except pagedkv.tiers.transfer.NixlUnavailable as err:\n"
        "    print('REFUSED', err)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("REFUSED KvTransfer needs NIXL's Python API; install it with "
                                  "`pip install --no-deps nixl-cu13==1.5.1`"), proc.stdout


def test_import_of_pagedkv_transfer_does_not_import_nixl():
    probe = "import sys, pagedkv.tiers.transfer; print(sorted(m for m in sys.modules if m.startswith('nixl')))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_block_runs_merge_consecutive_pairs_in_destination_order():
    assert block_runs([9, 4, 5], [7, 0, 1]) == [(4, 0, 2), (9, 7, 1)]
    assert block_runs([1, 2, 3], [5, 6, 8]) == [(1, 5, 2), (3, 8, 1)]
    assert block_runs([3, 2], [0, 1]) == [(3, 0, 1), (2, 1, 1)]
    assert block_runs([0], [0]) == [(0, 0, 1)]


def test_layout_differences_name_each_field():
    gpu = HostBackend(1 << 26)
    a = PagedKvCache(KvCacheConfig(**MIXED), 4, gpu)
    b = PagedKvCache(KvCacheConfig(**dict(OTHER, block_size=8)), 6, gpu)
    try:
        assert layout_differences(layout_of(a), layout_of(a)) == []
        assert layout_differences(layout_of(a), layout_of(b)) == [
            "block_size: here 16, peer 8",
            "layer 0 k_stride: here 4096, peer 2048",
            "layer 0 v_stride: here 4096, peer 2048",
            "layer 1 k_stride: here 1152, peer 576",
            "layer 1 v_stride: here 896, peer 448",
            "layer 2 head_dim: here 128, peer 64",
            "layer 2 k_stride: here 2048, peer 512",
            "layer 2 v_stride: here 2048, peer 512",
        ]
    finally:
        a.release(gpu)
        b.release(gpu)


# -- one process ---------------------------------------------------------------------------


@needs_nixl
def test_refusals_before_any_agent_exists(local):
    cache, gpu, _ = local
    with pytest.raises(TypeError, match="cache must be a PagedKvCache, got str"):
        KvTransfer("cache", gpu, "a")
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        KvTransfer(cache, gpu, "")
    with pytest.raises(KvCacheError, match="KvTransfer with HostBackend .*: the cache was built on another backend"):
        KvTransfer(cache, HostBackend(1 << 20), "a")
    released = PagedKvCache(KvCacheConfig(**MIXED), 2, gpu)
    released.release(gpu)
    with pytest.raises(KvCacheError, match="KvTransfer over a released cache"):
        KvTransfer(released, gpu, "a")
    elastic_gpu = HostBackend(1 << 26, vmm_granularity=4096)
    elastic = PagedKvCache(KvCacheConfig(**MIXED), 8, elastic_gpu, elastic=True)
    with pytest.raises(ValueError, match=r"allocated whole \(elastic=False\)"):
        KvTransfer(elastic, elastic_gpu, "a")
    elastic.release(elastic_gpu)


@needs_nixl
def test_metadata_checks_and_close_is_idempotent(local):
    cache, gpu, _ = local
    with KvTransfer(cache, gpu, "prefill-a") as transfer:
        with pytest.raises(ValueError, match="not KvTransfer metadata"):
            transfer.connect(b"hello")
        with pytest.raises(ValueError, match="names this agent itself"):
            transfer.connect(transfer.metadata())
        with pytest.raises(UnknownPeer, match=r"unknown peer 'nobody' \(connected: none\)"):
            transfer.send("nobody", [0], [0])
        assert transfer.peers() == []
    transfer.close()
    assert transfer.closed()
    with pytest.raises(TransferError, match="'prefill-a' is closed"):
        transfer.metadata()


def edited(metadata: bytes, edit) -> bytes:
    """`metadata` with its layout description passed through `edit(info) -> None`."""
    head = len(METADATA_MAGIC)
    size = int.from_bytes(metadata[head : head + 8], "little")
    info = json.loads(metadata[head + 8 : head + 8 + size])
    edit(info)
    text = json.dumps(info).encode()
    return METADATA_MAGIC + len(text).to_bytes(8, "little") + text + metadata[head + 8 + size :]


@needs_nixl
def test_metadata_that_does_not_describe_its_pools_is_refused(local):
    cache, gpu, _ = local
    other_gpu = HostBackend(1 << 26)
    other = PagedKvCache(KvCacheConfig(**MIXED), 4, other_gpu)
    try:
        with KvTransfer(cache, gpu, "here") as transfer, KvTransfer(other, other_gpu, "there") as peer:
            md = peer.metadata()
            with pytest.raises(ValueError, match="peer 'there' metadata lists 5 pools that do not match its layout"):
                transfer.connect(edited(md, lambda info: info["pools"].pop()))
            with pytest.raises(ValueError, match="peer_metadata lacks one of name, num_blocks"):
                transfer.connect(edited(md, lambda info: info.pop("num_blocks")))
            with pytest.raises(ValueError, match="layout version 1 is not 3"):
                transfer.connect(edited(md, lambda info: info["layout"].update(layout_version=1)))
            assert transfer.peers() == []
            assert transfer.connect(md) == "there"
            with pytest.raises(ValueError, match="peer 'there' is already connected"):
                transfer.connect(md)
            transfer.disconnect("there")
            assert transfer.peers() == []
    finally:
        other.release(other_gpu)


@needs_nixl
def test_a_peer_with_other_fp8_scales_is_refused_naming_both_values():
    gpu, other_gpu = HostBackend(1 << 26), HostBackend(1 << 26)
    mine = PagedKvCache(KvCacheConfig(**MIXED), 4, gpu)  # layer 2 stores fp8
    other = PagedKvCache(KvCacheConfig(**MIXED, k_scale=0.5), 4, other_gpu)
    try:
        with KvTransfer(mine, gpu, "here") as transfer, KvTransfer(other, other_gpu, "there") as peer:
            with pytest.raises(LayoutMismatch, match=r"has another cache layout .*: k_scale: here 1\.0, peer 0\.5$"):
                transfer.connect(peer.metadata())
            assert transfer.peers() == []
            with pytest.raises(LayoutMismatch, match=r"k_scale: here 0\.5, peer 1\.0$"):
                peer.connect(transfer.metadata())
    finally:
        mine.release(gpu)
        other.release(other_gpu)


# -- two processes -------------------------------------------------------------------------


@needs_nixl
def test_blocks_arrive_byte_identical_under_other_ids(local, receiver):
    cache, gpu, held = local
    dst_all = receiver.call("alloc", 6)  # the receiver's owner allocates; ids are its own
    untouched = receiver.call("read", dst_all)
    assert untouched == [bytes([FILL]) * len(x) for x in untouched]
    src = [held[2], held[3], held[4], held[9], held[10]]  # 9 and 10 go to blocks that are not neighbours
    dst = [dst_all[5], dst_all[0], dst_all[1], dst_all[2], dst_all[4]]
    with KvTransfer(cache, gpu, "prefill") as transfer:
        peer = transfer.connect(receiver.call("metadata"))
        assert peer == "decoder" and transfer.peers() == ["decoder"]
        handle = transfer.send(peer, src, dst, notify=b"seq-17")
        handle.wait(WAIT)
        assert handle.done() and handle.blocks == 5
        assert dst_all == [0, 1, 2, 3, 4, 5] and held == list(range(12))
        # pairs 3->0 4->1 | 9->2 | 10->4 | 2->5: 4 runs, each in 6 pools (3 layers, K and V)
        assert handle.descriptors == 24
        assert handle.nbytes == 5 * cache.config().block_bytes_kv_all_layers()
        assert receiver.call("wait_notifications", WAIT) == [("prefill", b"seq-17")]
        assert receiver.call("read", dst) == block_bytes(cache, gpu, src)
        rest = receiver.call("read", [dst_all[3]])
        assert rest == [bytes([FILL]) * len(x) for x in rest]


@needs_nixl
def test_every_refused_send_sends_nothing(local, receiver):
    cache, gpu, held = local
    dst = receiver.call("alloc", 2)
    before = receiver.call("read", dst)
    with KvTransfer(cache, gpu, "prefill-refused") as transfer:
        peer = transfer.connect(receiver.call("metadata"))
        with pytest.raises(UnknownPeer, match=r"unknown peer 'decoder-2' \(connected: 'decoder'\)"):
            transfer.send("decoder-2", held[:2], dst)
        with pytest.raises(IndexError, match=r"dst_blocks: block 12 out of range for a cache of 12 blocks \(peer 'decoder'\)"):
            transfer.send(peer, held[:2], [dst[0], 12])
        with pytest.raises(IndexError, match=r"src_blocks: block 16 out of range for a cache of 16 blocks \(this cache\)"):
            transfer.send(peer, [16, held[0]], dst)
        with pytest.raises(IndexError, match="block -1 out of range"):
            transfer.send(peer, held[:2], [dst[0], -1])
        with pytest.raises(ValueError, match="src_blocks has 3 blocks but dst_blocks has 2"):
            transfer.send(peer, held[:3], dst)
        with pytest.raises(ValueError, match=f"destination block {dst[1]} appears twice"):
            transfer.send(peer, held[:2], [dst[1], dst[1]])
        with pytest.raises(ValueError, match="source block 15 is free"):
            transfer.send(peer, [held[0], 15], dst)
        with pytest.raises(ValueError, match="src_blocks is empty"):
            transfer.send(peer, [], [])
        with pytest.raises(TypeError, match="notify must be bytes, got str"):
            transfer.send(peer, held[:2], dst, notify="done")
    assert receiver.call_err("wait_notifications", 0.3) == "TransferTimeout: 'decoder': no notification arrived within 0.3 s"
    assert receiver.call("read", dst) == before


@needs_nixl
def test_a_peer_of_another_layout_is_refused_naming_the_difference(local):
    cache, gpu, held = local
    other = Peer("other-layout", OTHER, 12)
    try:
        dst = other.call("alloc", 2)
        with KvTransfer(cache, gpu, "prefill-mismatch") as transfer:
            with pytest.raises(LayoutMismatch) as caught:
                transfer.connect(other.call("metadata"))
            message = str(caught.value)
            assert message.startswith("peer 'other-layout' has another cache layout")
            assert message.endswith("layer 2 head_dim: here 128, peer 64; layer 2 k_stride: here 2048, peer 1024; "
                                    "layer 2 v_stride: here 2048, peer 1024")
            assert transfer.peers() == []
            with pytest.raises(UnknownPeer):
                transfer.send("other-layout", held[:2], dst)
            # the other side refuses us the same way
            assert other.call_err("connect", transfer.metadata()).startswith(
                "LayoutMismatch: peer 'prefill-mismatch' has another cache layout")
        rest = other.call("read", dst)
        assert rest == [bytes([FILL]) * len(x) for x in rest]
    finally:
        other.close()


@needs_nixl
def test_a_wait_past_its_timeout_is_a_timeout_error_and_the_transfer_can_finish(monkeypatch):
    # TCP only: a stopped receiver then cannot take 32 MiB (shared-memory transports could let
    # the sender write into a stopped process).
    monkeypatch.setenv("UCX_TLS", "tcp")
    gpu = HostBackend(1 << 27)
    cache = PagedKvCache(KvCacheConfig(**BIG), 512, gpu)
    peer = Peer("stopped", BIG, 512)
    try:
        blocks = cache.alloc_blocks(512)
        fill_random(cache, gpu, blocks[:4] + blocks[-4:], seed=3)
        dst = peer.call("alloc", 512)
        with KvTransfer(cache, gpu, "prefill-big") as transfer:
            name = transfer.connect(peer.call("metadata"))
            os.kill(peer.process.pid, signal.SIGSTOP)
            try:
                handle = transfer.send(name, blocks, dst[::-1], notify=b"big")
                with pytest.raises(TransferTimeout, match=r"transfer of 512 blocks \(33554432 bytes\) to peer "
                                                          r"'stopped' not complete after 0.2 s"):
                    handle.wait(0.2)
            finally:
                os.kill(peer.process.pid, signal.SIGCONT)
            handle.wait(WAIT)
            assert peer.call("wait_notifications", WAIT) == [("prefill-big", b"big")]
            assert peer.call("read", dst[-4:][::-1] + dst[:4][::-1]) == block_bytes(cache, gpu, blocks[:4] + blocks[-4:])
    finally:
        peer.close()
        cache.release(gpu)


@needs_nixl
def test_a_send_to_a_peer_that_is_gone_fails(local):
    cache, gpu, held = local
    peer = Peer("gone", MIXED, 4)
    dst = peer.call("alloc", 2)
    with KvTransfer(cache, gpu, "prefill-gone") as transfer:
        name = transfer.connect(peer.call("metadata"))
        peer.close()
        assert peer.process.exitcode == 0
        with pytest.raises(TransferError) as caught:
            transfer.send(name, held[:2], dst).wait(WAIT)
        assert not isinstance(caught.value, TransferTimeout)
        assert "peer 'gone'" in str(caught.value)


@needs_nixl
def test_the_transfer_bench_runs_at_smoke_size(monkeypatch, capsys):
    import argparse
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
    import bench_transfer

    bench_transfer.run(argparse.Namespace(gpu=False, quick=True))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "  backend: HostBackend (DRAM); 32 blocks x 8 layers, 16 MiB a transfer"
    assert [line.split()[:2] for line in lines[1:4]] == [["NIXL", "contiguous"], ["NIXL", "scattered"],
                                                         ["backend", "copy_d2d"]]
    assert "(16 descriptors," in lines[1] and "(256 descriptors," in lines[2]
    # the layouts and splits: the same pairs, HND like NHD, a 1->2 HND split 2x, NHD per token
    assert [line.split()[:2] for line in lines[4:]] == [["HND", "scattered"], ["HND", "1->2"],
                                                        ["ceiling", "1->2"], ["NHD", "1->2"],
                                                        ["hybrid", "1->2"], ["ceiling", "hybrid"]]
    assert "(256 descriptors = 1.00x" in lines[4] and "(512 descriptors = 2.00x" in lines[5]
    assert lines[6].endswith("2.00x, needs <= 2x  ok") and "(8192 descriptors = 32.00x" in lines[7]
    # the hybrid split: the plain split's 512 descriptors and one state row per receiving rank
    assert "(514 descriptors = 2.01x the same-layout transfer, 1.004x the plain 1->2 HND split;" in lines[8]
    assert lines[9].endswith("needs <= 1.00391x  ok")


@needs_nixl
def test_the_readme_transfer_example_runs():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    (example,) = [block for block in re.findall(r"```py\n(.*?)```", readme, flags=re.S)
                  if "KvTransfer" in block and "tp_size" not in block]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["sender"].closed() and namespace["receiver"].closed()
    assert namespace["gpu_p"].live_allocations() == 0 and namespace["gpu_d"].live_allocations() == 0


@needs_nixl
def test_a_transfer_prints_nothing():
    probe = (
        "from pagedkv import HostBackend, KvCacheConfig, PagedKvCache\n"
        "from pagedkv.tiers.transfer import KvTransfer\n"
        "config = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=1, dtype='bf16')\n"
        "ga, gb = HostBackend(1 << 20), HostBackend(1 << 20)\n"
        "a, b = PagedKvCache(config, 2, ga), PagedKvCache(config, 2, gb)\n"
        "with KvTransfer(a, ga, 'a') as ta, KvTransfer(b, gb, 'b') as tb:\n"
        "    ta.send(ta.connect(tb.metadata()), a.alloc_blocks(1), b.alloc_blocks(1), b'n').wait(20)\n"
        "    assert tb.wait_notifications(20) == [('a', b'n')]\n"
        "a.release(ga); b.release(gb)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
