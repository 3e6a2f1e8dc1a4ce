"""A warm restart rebuilds only nodes that lead to a restored entry: records it cannot use
(a keyed chain's, whose tokens do not give their hash) leave no node behind, and every node
below a root holds an entry or a child (`check_invariants`)."""

from __future__ import annotations

from test_hybrid_disk_tiers import PROMPT, DiskWorld


def nodes(prefix) -> tuple[int, int]:
    """(nodes below the roots, those holding no entry of any tier)."""
    stack, count, empty = list(prefix._roots.values()), 0, 0
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.parent is not None:
            count += 1
            empty += not (node.entries or node.lower or node.disk)
    return count, empty


def test_a_warm_restart_leaves_no_empty_node(tmp_path):
    first = DiskWorld(tmp_path / "t", host=(1, 1, 1))
    first.cached_prompt()
    first.cached_prompt("c", list(range(500, 517)))
    first.push_down()
    first.table.add("k", list(range(900, 917)), extra_keys=[(0, 2, "img")])  # keyed from its first unit
    first.scribble("k")
    first.table.free("k")
    first.push_down()
    first.cached_prompt("d", list(range(700, 717)))  # the keyed chain's host entries go to disk too
    first.push_down()
    first.disk.flush()
    written = {(t, g) for _, t, g, _ in first.prefix.disk_entries()}
    assert (tuple(range(900, 904)), 0) in written  # a keyed record that starts at the root
    first.close()

    second = DiskWorld(tmp_path / "t", host=(8, 4, 4))
    try:
        restored = {(t, g) for _, t, g, _ in second.prefix.disk_entries()}
        assert restored and restored <= written and not any(t[0] == 900 for t, _ in restored)
        units = {t[:k] for t, _ in restored for k in range(4, len(t) + 1, 4)}  # the nodes they need
        assert nodes(second.prefix) == (len(units), 0)  # no other node, none empty
        second.prefix.check_invariants()
    finally:
        second.close()
