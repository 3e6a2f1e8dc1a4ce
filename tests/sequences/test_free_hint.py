"""Freeing a sequence offers its matched prefix without walking the tree again (its nodes,
kept from `add`, are taken while the last of them still holds the sequence's block): the
shortcut must give way whenever those nodes are stale, so that the cache ends exactly as a
full walk would leave it."""

from __future__ import annotations

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable

BS = 4


def world(num_blocks: int = 64) -> tuple[SequenceTable, PrefixCache]:
    config = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=8, num_layers=1, dtype="bf16")
    cache = PagedKvCache(config, num_blocks, HostBackend(capacity_bytes=1 << 22))
    prefix = PrefixCache(cache)
    return SequenceTable(cache, prefix), prefix


def matched_blocks(prefix: PrefixCache, tokens: list[int]) -> list[int]:
    """The device blocks `prefix` matches for `tokens` (the match's references handed back)."""
    found = prefix.match(tokens)
    prefix._cache.free_blocks(found.blocks)
    return list(found.blocks)


PROMPT = list(range(100, 117))  # 4 whole blocks and one token


def test_a_matched_prefix_is_offered_again_after_a_clear():
    table, prefix = world()
    table.add("a", PROMPT)
    table.free("a")
    assert table.add("b", PROMPT) == 16
    held = table.blocks("b")
    prefix.clear()  # the nodes b matched are gone; b keeps its blocks
    assert matched_blocks(prefix, PROMPT) == []
    table.add("x", list(range(900, 905)))  # another chain: the root is there again
    table.free("x")
    table.free("b")
    assert matched_blocks(prefix, PROMPT) == held[:4]  # cached anew, under the root
    prefix.check_invariants()
    table.check_invariants()


def test_a_prefix_rewritten_after_truncate_is_cached_as_its_new_tokens():
    table, prefix = world()
    table.add("a", PROMPT)
    table.free("a")
    old = matched_blocks(prefix, PROMPT)
    assert table.add("b", PROMPT) == 16
    table.truncate("b", 5)  # one block and a token of the matched prefix stay
    other = list(range(500, 512))
    table.append("b", len(other), other)
    new_tokens = PROMPT[:5] + other
    held = table.blocks("b")
    assert held[0] == old[0] and not set(held[1:4]) & set(old)
    table.free("b")
    assert matched_blocks(prefix, new_tokens) == held[:4]
    assert matched_blocks(prefix, PROMPT) == old  # the old chain is still cached
    prefix.check_invariants()
    table.check_invariants()


def test_a_fork_offers_the_shared_prefix_once():
    table, prefix = world()
    table.add("a", PROMPT)
    table.free("a")
    assert table.add("b", PROMPT + [7, 8, 9]) == 16
    table.fork("b", "c")
    table.append("c", 2, [1, 2])
    table.free("b")
    table.free("c")
    chain = matched_blocks(prefix, PROMPT + [7, 8, 9, 1, 2, 0])
    assert len(chain) == 5 and chain[:4] == matched_blocks(prefix, PROMPT)
    allocator = table._cache.allocator()
    assert [allocator.ref_count(b) for b in chain] == [1] * 5  # the cache's own reference only
    prefix.check_invariants()
    table.check_invariants()


def test_a_live_sequence_keeps_no_other_part_of_a_cleared_tree_alive():
    table, prefix = world()
    table.add("a", PROMPT)
    table.free("a")
    for i in range(6):  # other chains under the same root and under the matched prefix
        table.add(("x", i), [100 + i] * 9)
        table.free(("x", i))
        table.add(("y", i), PROMPT[:8] + [300 + i] * 9)
        table.free(("y", i))
    assert table.add("long", PROMPT) == 16
    held = table._seqs["long"].cached
    prefix.clear()
    seen, stack = set(), [held[0].parent, *held]
    while stack:  # everything the sequence's nodes still reach, up and down
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(node.children.values())
        if node.parent is not None:
            stack.append(node.parent)
    assert len(seen) == len(held) + 1  # its own chain and the old root
    blocks = table.blocks("long")
    table.free("long")
    assert matched_blocks(prefix, PROMPT) == blocks[:4]  # cached anew
    prefix.check_invariants()
