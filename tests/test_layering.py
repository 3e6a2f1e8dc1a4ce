"""Import layering: pagedkv's modules import each other without a circle, and the core
modules never import back up to the ones built on them (TYPE_CHECKING imports count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pagedkv

PACKAGE_DIR = Path(pagedkv.__file__).parent

# Lower rank = lower layer. A listed module may import only listed modules of lower or equal
# rank; modules not listed (new ones) are held to the no-circle rule alone.
RANKS = {
    "pagedkv.errors": 0,
    "pagedkv.validate": 0,
    "pagedkv.env": 0,
    "pagedkv.log": 0,
    "pagedkv.trace": 0,
    "pagedkv.teardown": 1,
    "pagedkv.dtype": 1,
    "pagedkv.config": 2,
    "pagedkv.backend": 2,
    "pagedkv.codecs": 2,
    "pagedkv.host_backend": 3,
    "pagedkv.allocator": 3,
    "pagedkv.pools": 3,
    "pagedkv.driver": 3,
    "pagedkv.kv_rows": 4,
    "pagedkv.diagnostics": 4,
    "pagedkv.cache": 5,
    "pagedkv.prefix_cache": 6,
    "pagedkv.sequence_table": 7,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(name: str) -> str:
    """The module `name` names: itself when a module or package of pagedkv exists there,
    else its parent (an attribute imported from a module)."""
    rel = Path(*name.split("."))
    base = PACKAGE_DIR.parent
    if (base / rel).with_suffix(".py").exists() or (base / rel / "__init__.py").exists():
        return name
    return name.rsplit(".", 1)[0]


def imports_of(path: Path) -> set[str]:
    """Every pagedkv module `path` imports, anywhere in the file."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(resolve(a.name) for a in node.names if a.name.split(".")[0] == "pagedkv")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "pagedkv":
                base = node.module
            else:
                continue
            found.update(resolve(f"{base}.{a.name}") for a in node.names)  # a submodule, or `base`
    found.discard(me)
    return {m for m in found if m != "pagedkv"}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PACKAGE_DIR.rglob("*.py")}


def ranked(module: str) -> int | None:
    """The rank of `module` or of the nearest listed package containing it."""
    while module:
        if module in RANKS:
            return RANKS[module]
        module = module.rpartition(".")[0]
    return None


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_walk_sees_the_known_imports():
    edges = graph()
    assert "pagedkv.allocator" in edges["pagedkv.cache"] and "pagedkv.pools" in edges["pagedkv.cache"]
    assert "pagedkv.kv_rows" in edges["pagedkv.cache"] and "pagedkv.pools" in edges["pagedkv.kv_rows"]
    assert "pagedkv.dtype" in edges["pagedkv.codecs.side"]
    assert "pagedkv.cache" in edges["pagedkv.prefix_cache"]


def test_no_import_circle_anywhere():
    assert find_cycle(graph()) is None, f"import circle: {' -> '.join(find_cycle(graph()))}"


def test_find_cycle_finds_a_planted_circle():
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(planted) == ["a", "b", "c", "a"]


def test_no_import_points_back_up_the_layers():
    upward = []
    for module, targets in graph().items():
        mine = ranked(module)
        if mine is None or module.startswith("pagedkv.cli"):
            continue
        for target in targets:
            theirs = ranked(target)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} (rank {mine}) imports {target} (rank {theirs})")
    assert upward == []


def test_pools_rows_and_diagnostics_know_nothing_of_the_cache():
    edges = graph()
    for module in ("pagedkv.allocator", "pagedkv.pools", "pagedkv.kv_rows", "pagedkv.diagnostics"):
        assert edges[module] & {"pagedkv.cache", "pagedkv.prefix_cache", "pagedkv.sequence_table"} == set(), module
