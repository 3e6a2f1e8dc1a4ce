"""Prefix reuse across tiers: eviction demotes cached blocks into a HostTier (one swap_out
per eviction batch), a full host tier drops its least recently used leaves, `match`
reports host-resident blocks, `SequenceTable.add` promotes them (one swap_in) with
identical KV, events carry their medium, and a failed promotion changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.backends.capabilities import backend_supports

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.errors import KvCacheExhausted
from pagedkv.tiers.host_tier import HostTier
from pagedkv.sequences.prefix_cache import BlockRemoved, BlockStored, chain_hash, root_hash

BS = 4
CONFIG = KvCacheConfig(
    block_size=BS, num_kv_heads=2, head_dim=32, num_layers=3, dtype="turbo4k3v",
    layer_dtypes=("bf16", "fp8k_turbo4v", "nvfp4"), layer_dims=((2, 32), (1, 64)),
)
PROMPT = list(range(100, 113))  # 3 full blocks + 1 token



@pytest.fixture
def gpu(gpu):
    """The conftest backend, skipped (with the reason) where it does not state "host_tier"."""
    if not backend_supports(gpu, "host_tier"):
        pytest.skip(f"{type(gpu).__name__} does not state 'host_tier'")
    return gpu

class World:
    """A cache of `device` blocks, a host tier of `host` blocks, a prefix cache recording
    its events, and a table, on `gpu`."""

    def __init__(self, gpu, device: int = 6, host: int = 4):
        self.gpu = gpu
        self.cache = PagedKvCache(CONFIG, device, gpu)
        self.tier = HostTier(self.cache, host, gpu)
        self.events: list = []
        self.prefix = PrefixCache(self.cache, on_event=self.events.append, host_tier=self.tier)
        self.table = SequenceTable(self.cache, self.prefix, gpu, gpu.default_stream())
        self.rng = np.random.default_rng(11)

    def write(self, blocks) -> dict:
        written = {}
        for layer in range(CONFIG.num_layers):
            for block in blocks:
                k = self.rng.integers(0, 256, self.cache.k_block_stride_bytes_for_layer(layer), dtype=np.uint8)
                v = self.rng.integers(0, 256, self.cache.v_block_stride_bytes_for_layer(layer), dtype=np.uint8)
                self.cache.write_block(layer, block, k, v, self.gpu)
                written[layer, block] = (k, v)
        return written

    def cached_prompt(self, seq_id, prompt) -> list[tuple[np.ndarray, np.ndarray]]:
        """Add, write and free `prompt`: its full blocks are then cached on the device. Returns
        each full block's bytes per layer, in prompt order."""
        self.table.add(seq_id, prompt)
        blocks = self.table.blocks(seq_id)
        written = self.write(blocks)
        self.table.free(seq_id)
        return [[written[layer, b] for layer in range(CONFIG.num_layers)] for b in blocks[: len(prompt) // BS]]

    def squeeze(self, n: int) -> list[int]:
        """Allocate `n` device blocks (evicting as needed); the caller frees them."""
        return self.cache.alloc_blocks(n)

    def close(self) -> None:
        self.table.release(self.gpu)
        self.prefix.close()
        self.tier.release(self.gpu)
        self.cache.release(self.gpu)


@pytest.fixture
def world(gpu):
    w = World(gpu)
    yield w
    w.close()


class Copies:
    def __init__(self, gpu, monkeypatch, fail_after: int | None = None):
        self.calls = 0
        original = gpu.copy_batch_async

        def counted(dsts, srcs, sizes, stream):
            self.calls += 1
            if fail_after is not None and self.calls > fail_after:
                raise IndexError("copy_batch_async entry 0: planted failure")
            return original(dsts, srcs, sizes, stream)

        monkeypatch.setattr(gpu, "copy_batch_async", counted)


def _hashes(prompt, n):
    out, parent = [], root_hash(0)
    for i in range(n):
        parent = chain_hash(parent, prompt[i * BS : (i + 1) * BS])
        out.append(parent)
    return out


def test_hashes_are_unchanged_and_survive_a_round_trip_through_the_host_tier(host):
    assert root_hash(0) == 0x984CD6943ED57F52
    assert [f"{h:016x}" for h in _hashes(PROMPT, 3)] == ["c10e4cdbe93cd42a", "a51144a31d197383", "1e5250552b7ea918"]
    world = World(host)
    try:
        world.cached_prompt("a", PROMPT)
        world.cache.free_blocks(world.squeeze(6))
        assert sorted(world.prefix._tiering.by_host[h].hash for h in world.tier.lru_blocks()) == sorted(_hashes(PROMPT, 3))
        world.table.add("b", PROMPT)
        assert [world.prefix.block_hash(b) for b in world.table.blocks("b")[:3]] == _hashes(PROMPT, 3)
    finally:
        world.close()


def test_eviction_demotes_in_one_swap_and_the_host_bytes_are_the_device_bytes(world, monkeypatch):
    kv = world.cached_prompt("a", PROMPT)
    hashes = [world.prefix.block_hash(b) for b in world.prefix.block_references()]
    assert world.prefix.num_cached_blocks() == 3 and world.cache.num_free_blocks() == 3
    world.events.clear()
    copies = Copies(world.gpu, monkeypatch)
    taken = world.squeeze(6)  # 3 free + 3 evicted, in one eviction batch
    assert copies.calls == 1
    assert world.prefix.num_cached_blocks() == 0 and world.prefix.num_host_blocks() == 3
    removed, *stored = world.events
    assert removed == BlockRemoved(block_hashes=removed.block_hashes, block_ids=removed.block_ids, medium="GPU")
    assert sorted(removed.block_hashes) == sorted(hashes) and len(removed.block_ids) == 3
    assert [(e.medium, e.block_size, len(e.block_ids)) for e in stored] == [("CPU", BS, 1)] * 3
    assert sorted(h for e in stored for h in e.block_hashes) == sorted(_hashes(PROMPT, 3))
    found = world.prefix.match(PROMPT)
    assert (found.blocks, found.num_tokens, found.host_num_tokens) == ([], 0, 12)
    for i, host in enumerate(found.host_blocks):
        for layer in range(CONFIG.num_layers):
            k, v = world.tier.read_block(layer, host)
            assert np.array_equal(k, kv[i][layer][0]) and np.array_equal(v, kv[i][layer][1])
    stats = world.prefix.stats()
    assert (stats.evictions, stats.demotions, stats.host_cached_blocks, stats.host_hit_tokens) == (3, 3, 3, 12)
    world.cache.free_blocks(taken)
    world.table.check_invariants()


def test_add_promotes_host_blocks_in_one_swap_with_identical_kv(world, monkeypatch):
    kv = world.cached_prompt("a", PROMPT)
    world.cache.free_blocks(world.squeeze(6))  # all three demoted
    world.events.clear()
    copies = Copies(world.gpu, monkeypatch)
    matched = world.table.add("b", PROMPT + [7, 8, 9])
    assert matched == 12 and copies.calls == 1
    blocks = world.table.blocks("b")
    world.gpu.synchronize(world.gpu.default_stream())
    for i in range(3):
        for layer in range(CONFIG.num_layers):
            k, v = world.cache.read_block(layer, blocks[i], world.gpu)
            assert np.array_equal(k, kv[i][layer][0]) and np.array_equal(v, kv[i][layer][1])
    removed, stored = world.events
    assert removed.medium == "CPU" and removed.block_hashes == tuple(_hashes(PROMPT, 3))
    assert stored == BlockStored(
        block_hashes=tuple(_hashes(PROMPT, 3)), parent_block_hash=None, token_ids=tuple(PROMPT[:12]),
        block_ids=tuple(blocks[:3]), block_size=BS, adapter_id=0, medium="GPU",
    )
    assert [world.prefix.block_hash(b) for b in blocks[:3]] == _hashes(PROMPT, 3)
    assert [world.cache.ref_count(b) for b in blocks] == [2, 2, 2, 1]
    stats = world.prefix.stats()
    assert (stats.promotions, stats.host_cached_blocks, stats.cached_blocks) == (3, 0, 3)
    assert (stats.device_hit_tokens, stats.host_hit_tokens, stats.hit_tokens) == (0, 12, 12)
    assert world.tier.num_free_blocks() == 4
    world.table.check_invariants()


def test_a_match_spanning_both_tiers_is_served_whole(world):
    world.cached_prompt("a", PROMPT)
    world.cache.free_blocks(world.squeeze(4))  # 3 free + the leaf: block 2 of the chain demoted
    found = world.prefix.match(PROMPT)
    assert (found.num_tokens, found.host_num_tokens, len(found.host_blocks)) == (8, 4, 1)
    world.cache.free_blocks(found.blocks)
    assert world.table.add("b", PROMPT) == 12
    stats = world.prefix.stats()
    assert (stats.device_hit_tokens, stats.host_hit_tokens) == (8 + 8, 4 + 4)
    world.table.check_invariants()


def test_a_promotion_without_device_blocks_changes_nothing(world):
    world.cached_prompt("a", PROMPT)
    held = world.squeeze(6)  # every device block held: nothing free, nothing evictable
    before = (world.prefix.stats(), world.tier.lru_blocks(), world.cache.num_free_blocks(), list(world.events))
    with pytest.raises(KvCacheExhausted):
        world.table.add("b", PROMPT)
    assert "b" not in world.table
    assert before == (world.prefix.stats(), world.tier.lru_blocks(), world.cache.num_free_blocks(), world.events)
    assert world.prefix._tiering._pinned == set()
    world.cache.free_blocks(held)
    assert world.table.add("b", PROMPT) == 12
    world.table.check_invariants()


def test_a_failing_swap_in_changes_nothing(world, monkeypatch):
    world.cached_prompt("a", PROMPT)
    world.cache.free_blocks(world.squeeze(6))
    before = (world.prefix.stats(), world.tier.lru_blocks(), world.cache.num_free_blocks(), list(world.events))
    Copies(world.gpu, monkeypatch, fail_after=0)
    with pytest.raises(IndexError, match="planted failure"):
        world.table.add("b", PROMPT)
    assert "b" not in world.table
    assert before == (world.prefix.stats(), world.tier.lru_blocks(), world.cache.num_free_blocks(), world.events)
    world.table.check_invariants()


def test_a_promotion_whose_swap_event_cannot_be_polled_changes_nothing(world, monkeypatch):
    """The host tier polls the swap_in's event to know when its host blocks may be reused;
    a backend error there (an event recorded inside a graph capture, a device fault) leaves
    the sequence unadded, the host blocks allocated and cached, every count as it was."""
    world.cached_prompt("a", PROMPT)
    world.cache.free_blocks(world.squeeze(6))
    before = (world.prefix.stats(), world.tier.lru_blocks(), world.tier.num_free_blocks(),
              world.cache.num_free_blocks(), list(world.events))

    def refused(event):
        raise RuntimeError(f"event {event}: planted query failure")

    monkeypatch.setattr(world.gpu, "event_done", refused)
    with pytest.raises(RuntimeError, match="planted query failure"):
        world.table.add("b", PROMPT)
    assert "b" not in world.table and world.prefix._tiering._pinned == set()
    assert before == (world.prefix.stats(), world.tier.lru_blocks(), world.tier.num_free_blocks(),
                      world.cache.num_free_blocks(), world.events)
    world.table.check_invariants()
    monkeypatch.undo()
    assert world.table.add("b", PROMPT) == 12
    world.table.free("b")
    world.table.check_invariants()
    assert world.tier.num_free_blocks() == 4 and world.prefix.num_host_blocks() == 0


def test_a_failing_swap_out_leaves_the_victims_cached_on_the_device(world, monkeypatch):
    world.cached_prompt("a", PROMPT)
    before = (world.prefix.stats(), world.cache.num_free_blocks(), world.prefix.block_references())
    Copies(world.gpu, monkeypatch, fail_after=0)
    with pytest.raises(IndexError, match="planted failure"):
        world.squeeze(6)
    assert before == (world.prefix.stats(), world.cache.num_free_blocks(), world.prefix.block_references())
    assert world.tier.num_free_blocks() == 4
    world.table.check_invariants()
    monkeypatch.undo()
    world.cache.free_blocks(world.squeeze(6))
    assert world.prefix.num_host_blocks() == 3


def test_a_full_host_tier_drops_its_least_recently_used_leaves(host):
    world = World(host, device=4, host=2)
    try:
        prompts = [[10 * p + i for i in range(BS + 1)] for p in range(4)]  # one full block each
        for p, prompt in enumerate(prompts[:2]):
            world.cached_prompt(p, prompt)
        world.cache.free_blocks(world.squeeze(4))  # both demoted: host tier full
        world.prefix.match(prompts[0])  # prompt 0 is now the more recent on the host
        world.cached_prompt(2, prompts[2])
        world.events.clear()
        world.cache.free_blocks(world.squeeze(4))  # demoting prompt 2 drops prompt 1 from the host
        dropped = world.events[0]
        assert dropped == BlockRemoved(block_hashes=tuple(_hashes(prompts[1], 1)), block_ids=dropped.block_ids,
                                       medium="CPU")
        assert [world.prefix.match(p).host_num_tokens for p in prompts[:3]] == [BS, 0, BS]
        assert world.prefix.stats().host_evictions == 1
        world.table.check_invariants()
    finally:
        world.close()


def test_a_long_chain_on_a_full_host_tier_drops_deepest_first(host):
    world = World(host, device=6, host=3)
    try:
        world.cached_prompt("a", PROMPT)
        world.cache.free_blocks(world.squeeze(6))  # 3 blocks of the chain on the host
        other = [900 + i for i in range(2 * BS + 1)]
        world.cached_prompt("b", other)
        world.events.clear()
        world.cache.free_blocks(world.squeeze(6))  # 2 more: the chain's two deepest go
        assert world.events[0].medium == "CPU" and world.events[0].block_hashes == tuple(_hashes(PROMPT, 3)[:0:-1])
        assert world.prefix.match(PROMPT).host_num_tokens == BS
        found = world.prefix.match(other)
        assert (found.num_tokens, found.host_num_tokens) == (0, 2 * BS)
        world.table.check_invariants()
    finally:
        world.close()


def test_insert_over_host_resident_blocks_adopts_the_callers_blocks(world):
    world.cached_prompt("a", PROMPT)
    world.cache.free_blocks(world.squeeze(6))
    world.events.clear()
    blocks = world.cache.alloc_blocks(3)
    assert world.prefix.insert(PROMPT[:12], blocks) == 3
    removed, stored = world.events
    assert removed.medium == "CPU" and stored.medium == "GPU" and stored.block_ids == tuple(blocks)
    assert world.prefix.num_host_blocks() == 0 and world.tier.num_free_blocks() == 4
    assert [world.prefix.block_hash(b) for b in blocks] == _hashes(PROMPT, 3)
    world.cache.free_blocks(blocks)
    world.table.check_invariants()


def test_clear_frees_the_host_blocks_and_construction_checks(world):
    world.cached_prompt("a", PROMPT)
    world.cache.free_blocks(world.squeeze(6))
    world.prefix.clear()
    assert world.tier.num_free_blocks() == 4 and world.tier.lru_blocks() == []
    world.table.check_invariants()
    other = PagedKvCache(CONFIG, 4, world.gpu)
    with pytest.raises(ValueError, match="host_tier belongs to a different PagedKvCache"):
        PrefixCache(other, host_tier=world.tier)
    with pytest.raises(TypeError, match="host_tier must be a HostTier"):
        PrefixCache(other, host_tier=object())
    other.release(world.gpu)


def test_a_table_on_another_backend_is_refused(host):
    cache = PagedKvCache(CONFIG, 4, host)
    prefix = PrefixCache(cache, host_tier=HostTier(cache, 2, host))
    with pytest.raises(ValueError, match="not the backend of the prefix cache's host tier"):
        SequenceTable(cache, prefix, HostBackend(capacity_bytes=1 << 20))
    prefix.host_tier().release(host)
    cache.release(host)


def test_a_promotion_keeps_its_host_blocks_while_its_allocation_evicts(host):
    world = World(host, device=6, host=3)
    try:
        world.cached_prompt("a", PROMPT)
        world.cache.free_blocks(world.squeeze(6))  # A's 3 blocks fill the host tier
        other = [900 + i for i in range(3 * BS + 1)]
        world.cached_prompt("b", other)  # B: 3 device blocks, 3 free
        world.events.clear()
        assert world.table.add("c", PROMPT) == 12  # 4 blocks: B's leaf is evicted, the host tier has no room
        b_leaf = _hashes(other, 3)[2]
        assert world.events[0] == BlockRemoved(block_hashes=(b_leaf,), block_ids=world.events[0].block_ids)
        assert not any(e.medium == "CPU" and isinstance(e, BlockStored) for e in world.events)
        found = world.prefix.match(other)
        assert world.prefix.stats().promotions == 3 and found.num_tokens == 2 * BS
        world.cache.free_blocks(found.blocks)
        world.table.check_invariants()
    finally:
        world.close()


class _SwapInFlipsABit(HostBackend):
    """A HostBackend whose batched copies into device memory flip one bit of the first range."""

    def copy_batch_async(self, dsts, srcs, sizes, stream):
        super().copy_batch_async(dsts, srcs, sizes, stream)
        if len(dsts) and self._find(int(dsts[0])) is not None:
            self.view(int(dsts[0]), 1)[0] ^= 1


def test_the_demo_serves_a_prompt_from_the_host_tier_and_notices_a_wrong_byte(monkeypatch, capsys):
    from pagedkv.cli import demo as demo_module
    from pagedkv.cli import main

    monkeypatch.setattr(demo_module, "best_backend", lambda: (HostBackend(capacity_bytes=1 << 30), "HostBackend"))
    assert main(["demo", "--layers", "2", "--blocks", "16"]) == 0
    assert "  [ok]   host tier: a prompt's 4 blocks evicted to the host tier, then served to a new sequence from it; " \
           "KV bytes identical" in capsys.readouterr().out.splitlines()
    monkeypatch.setattr(demo_module, "best_backend", lambda: (_SwapInFlipsABit(capacity_bytes=1 << 30), "flipper"))
    assert main(["demo", "--layers", "2", "--blocks", "16"]) == 1
    out = capsys.readouterr().out
    assert "  [FAIL] host tier: CheckFailed: layer 0: block 0 served back into block 0 differs" in out
    assert out.count("[FAIL]") == 1


def test_the_readme_host_tier_example_runs():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Host tier"):readme.index("## Disk tier")]
    (example,) = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    gpu = namespace["gpu"]
    assert gpu.live_allocations() == 0 and gpu.live_swap_memory() == 0 and gpu.live_events() == 0


def test_an_eviction_batch_waits_for_its_swap_before_handing_out_blocks(world, monkeypatch):
    world.cached_prompt("a", PROMPT)
    waits = []
    original = world.gpu.wait_event
    monkeypatch.setattr(world.gpu, "wait_event", lambda e: (waits.append(world.cache.num_free_blocks()), original(e)))
    taken = world.squeeze(6)
    assert waits == [3]  # while it waits, the three evicted blocks are not on the free list yet
    world.cache.free_blocks(taken)


# -- random operations across the two tiers ----------------------------------------------

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

_BASES = [[b * 100 + i for i in range(17)] for b in range(3)]
_BASES[1][:8] = _BASES[0][:8]  # bases 0 and 1 share two blocks


def _block_bytes(cache: PagedKvCache, tokens: list[int], layer: int) -> tuple[np.ndarray, np.ndarray]:
    """The K and V bytes the machine writes for a full block whose prompt starts `tokens`."""
    seed = _hashes(tokens, len(tokens) // BS)[-1] % (1 << 32) + layer
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, cache.k_block_stride_bytes_for_layer(layer), dtype=np.uint8),
            rng.integers(0, 256, cache.v_block_stride_bytes_for_layer(layer), dtype=np.uint8))


class TierMachine(RuleBasedStateMachine):
    """Sequences added, freed, squeezed out and served again over a small device cache and
    a smaller host tier: after every step the invariants hold, and every block a sequence
    got from either tier holds the bytes written for its tokens."""

    def __init__(self):
        super().__init__()
        self.world = World(HostBackend(capacity_bytes=1 << 26), device=10, host=4)
        self.live: dict[int, list[int]] = {}
        self.held: list[int] = []
        self.next_id = 0

    @rule(base=st.integers(0, 2), n=st.integers(2, 17))
    def add(self, base, n):
        prompt = _BASES[base][:n]
        w = self.world
        try:
            matched = w.table.add(self.next_id, prompt)
        except KvCacheExhausted:
            return
        blocks = w.table.blocks(self.next_id)
        for i, block in enumerate(blocks[: n // BS]):
            for layer in range(CONFIG.num_layers):
                want = _block_bytes(w.cache, prompt[: (i + 1) * BS], layer)
                if i < matched // BS:
                    got = w.cache.read_block(layer, block, w.gpu)
                    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (i, layer)
                else:
                    w.cache.write_block(layer, block, *want, w.gpu)
        self.live[self.next_id] = prompt
        self.next_id += 1

    @rule(data=st.data())
    def free(self, data):
        if self.live:
            seq = data.draw(st.sampled_from(sorted(self.live)))
            self.world.table.free(seq)
            del self.live[seq]

    @rule(n=st.integers(1, 10), keep=st.booleans())
    def squeeze(self, n, keep):
        """Allocate `n` blocks (evicting into the host tier), and hold them or free them at once."""
        try:
            taken = self.world.cache.alloc_blocks(n)
        except KvCacheExhausted:
            return
        if keep:
            self.held += taken
        else:
            self.world.cache.free_blocks(taken)

    @rule()
    def unsqueeze(self):
        self.world.cache.free_blocks(self.held)
        self.held = []

    @rule(base=st.integers(0, 2))
    def match(self, base):
        found = self.world.prefix.match(_BASES[base])
        self.world.cache.free_blocks(found.blocks)

    @invariant()
    def consistent(self):
        w = self.world
        held = w.table.block_references()
        for block in self.held:
            held[block] = held.get(block, 0) + 1
        w.prefix.check_invariants()
        for block in w.prefix.block_references():
            held[block] = held.get(block, 0) + 1
        w.cache.check_invariants(held)
        assert w.tier.num_free_blocks() + w.prefix.num_host_blocks() == w.tier.num_blocks()

    def teardown(self):
        self.world.close()


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


def test_a_seeded_random_walk_over_both_tiers_keeps_every_byte_and_invariant():
    """The machine's rules in a long seeded walk: it must demote, promote and drop."""
    machine = TierMachine()
    rng = np.random.default_rng(2026)
    try:
        for _ in range(400):
            step = rng.integers(0, 6)
            if step <= 1:
                machine.add(int(rng.integers(0, 3)), int(rng.integers(2, 18)))
            elif step == 2 and machine.live:
                seq = sorted(machine.live)[int(rng.integers(0, len(machine.live)))]
                machine.world.table.free(seq)
                del machine.live[seq]
            elif step == 3:
                machine.squeeze(int(rng.integers(1, 11)), bool(rng.integers(0, 4) == 0))
            elif step == 4:
                machine.unsqueeze()
            else:
                machine.match(int(rng.integers(0, 3)))
            machine.consistent()
        stats = machine.world.prefix.stats()
        assert stats.demotions > 0 and stats.promotions > 0 and stats.host_evictions > 0, stats
    finally:
        machine.teardown()


def test_releasing_the_tier_first_leaves_a_device_only_cache(host):
    world = World(host)
    try:
        world.cached_prompt("a", PROMPT)
        world.cache.free_blocks(world.squeeze(6))  # 3 blocks on the host
        world.cached_prompt("b", [700 + i for i in range(2 * BS + 1)])
        world.tier.release(host)
        world.events.clear()
        assert world.prefix.match(PROMPT).host_num_tokens == 0
        assert world.events == [BlockRemoved(block_hashes=tuple(_hashes(PROMPT, 3)[::-1]), block_ids=(0, 1, 2),
                                             medium="CPU")]
        assert world.prefix.host_tier() is None and world.prefix.num_host_blocks() == 0
        world.events.clear()
        world.cache.free_blocks(world.squeeze(6))  # plain eviction now
        assert [e.medium for e in world.events] == ["GPU"] and world.prefix.stats().demotions == 3
        assert world.table.add("c", PROMPT) == 0
        world.table.check_invariants()
    finally:
        world.close()
