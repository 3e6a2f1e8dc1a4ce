"""Import layering: pagedkv's modules import each other without a circle, and each
sub-package imports only the sub-packages the table below allows it (TYPE_CHECKING and
function-level imports count). The table is the one statement of the architecture's
direction; docs/ARCHITECTURE.md and each package's docstring say the same."""

from __future__ import annotations

import ast
from pathlib import Path

import pagedkv

PACKAGE_DIR = Path(pagedkv.__file__).parent

ALLOWED = {
    "errors": set(),
    "core": {"errors"},
    "backends": {"core", "errors"},
    "codecs": {"core", "errors"},
    "interop": {"backends", "core", "errors"},
    "driver": {"backends", "codecs", "core", "errors"},
    "kv": {"driver", "interop", "backends", "codecs", "core", "errors"},
    "groups": {"kv", "interop", "backends", "codecs", "core", "errors"},
    "cache": {"groups", "kv", "interop", "backends", "codecs", "core", "errors"},
    "tiers": {"cache", "groups", "kv", "interop", "backends", "core", "errors"},
    "sequences": {"tiers", "cache", "groups", "kv", "interop", "backends", "core", "errors"},
    "events": {"sequences", "core", "errors"},
    "testing": {"events", "sequences", "tiers", "cache", "groups", "kv", "interop", "driver", "backends", "codecs", "core",
                "errors"},
    "cli": {"testing", "events", "sequences", "tiers", "cache", "groups", "kv", "interop", "driver", "backends", "codecs",
            "core", "errors"},
}
"""Sub-package (or flat module) of pagedkv -> the ones it may import. The package root
(`pagedkv/__init__.py`, `__main__.py`) may import anything."""

FLAT_MODULES = {"__init__", "__main__", "errors"}
"""The only modules directly in pagedkv/; everything else lives in a sub-package."""


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


def part_of(module: str) -> str | None:
    """The sub-package (or flat module) of `module` that the table speaks of; None for the
    package root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else None


def layering_violations(edges: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    """Every import of `edges` that crosses from one sub-package into another the table
    does not allow, and every module of a sub-package the table does not list."""
    bad = []
    for module, targets in sorted(edges.items()):
        mine = part_of(module)
        if mine is None:
            continue
        if mine not in allowed:
            bad.append(f"{module} is in {mine!r}, which the layering table does not list")
            continue
        for target in sorted(targets):
            theirs = part_of(target)
            if theirs is not None and theirs != mine and theirs not in allowed[mine]:
                bad.append(f"{module} ({mine}) imports {target} ({theirs})")
    return bad


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
    cache = edges["pagedkv.cache.paged_cache"]
    assert {"pagedkv.core.allocator", "pagedkv.kv.pools", "pagedkv.kv.rows", "pagedkv.interop.views"} <= cache
    assert "pagedkv.kv.pools" in edges["pagedkv.kv.rows"]
    assert "pagedkv.core.dtype" in edges["pagedkv.codecs.side"]
    assert "pagedkv.cache" in edges["pagedkv.sequences.prefix_cache"] or \
        "pagedkv.cache.paged_cache" in edges["pagedkv.sequences.prefix_cache"]


def test_no_import_circle_anywhere():
    assert find_cycle(graph()) is None, f"import circle: {' -> '.join(find_cycle(graph()))}"


def test_find_cycle_finds_a_planted_circle():
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(planted) == ["a", "b", "c", "a"]


def test_every_import_follows_the_layering_table():
    assert layering_violations(graph(), ALLOWED) == []


def test_the_table_is_a_direction_not_a_circle():
    assert find_cycle({part: set(targets) for part, targets in ALLOWED.items()}) is None


def test_a_planted_upward_import_is_caught():
    edges = graph()
    edges["pagedkv.core.allocator"] = edges["pagedkv.core.allocator"] | {"pagedkv.cache.paged_cache"}
    edges["pagedkv.kv.rows"] = edges["pagedkv.kv.rows"] | {"pagedkv.sequences.prefix_cache"}
    assert layering_violations(edges, ALLOWED) == [
        "pagedkv.core.allocator (core) imports pagedkv.cache.paged_cache (cache)",
        "pagedkv.kv.rows (kv) imports pagedkv.sequences.prefix_cache (sequences)",
    ]
    assert layering_violations({"pagedkv.newpart.thing": set()}, ALLOWED) == [
        "pagedkv.newpart.thing is in 'newpart', which the layering table does not list"
    ]


def test_only_the_root_modules_are_flat():
    flat = {p.stem for p in PACKAGE_DIR.glob("*.py")}
    assert flat == FLAT_MODULES
    packages = {p.parent.name for p in PACKAGE_DIR.glob("*/__init__.py")}
    assert packages == set(ALLOWED) - FLAT_MODULES


def test_every_sub_package_states_its_job_and_what_it_may_import():
    for package in sorted(set(ALLOWED) - FLAT_MODULES):
        doc = ast.get_docstring(ast.parse((PACKAGE_DIR / package / "__init__.py").read_text())) or ""
        assert doc.startswith(f"pagedkv.{package}:"), package
        stated = doc.split("May import:", 1)[1] if "May import:" in doc else ""
        named = {word.split(".")[1].rstrip("`,.() ") for word in stated.split() if word.startswith("`pagedkv.")}
        assert named == ALLOWED[package], f"{package} states {sorted(named)}, the table {sorted(ALLOWED[package])}"


def test_pools_rows_and_diagnostics_know_nothing_of_counts():
    edges = graph()
    for module in ("pagedkv.core.allocator", "pagedkv.kv.pools", "pagedkv.kv.rows", "pagedkv.kv.diagnostics"):
        assert not any(t.startswith(("pagedkv.cache", "pagedkv.sequences")) for t in edges[module]), module
