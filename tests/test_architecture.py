"""docs/ARCHITECTURE.md and the tree agree: every folder and module it names exists, every
folder of the package is named, its import table is the layering test's, and the tests
mirror the package folder for folder."""

from __future__ import annotations

import re
from pathlib import Path

import pagedkv
from test_layering import ALLOWED, FLAT_MODULES

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
PACKAGE = Path(pagedkv.__file__).parent


def _picture() -> str:
    return DOC[DOC.index("```\npagedkv/") : DOC.index("```", DOC.index("```\npagedkv/") + 3)]


def test_every_folder_in_the_picture_exists_and_every_folder_is_in_it():
    named = set(re.findall(r"^  ([a-z_]+)/", _picture(), re.M))
    folders = {d.name for d in PACKAGE.iterdir() if d.is_dir() and d.name != "__pycache__"}
    assert named == folders
    assert set(re.findall(r"^  ([a-z_]+)\.py", _picture(), re.M)) == FLAT_MODULES - {"__init__", "__main__"}


def test_every_path_the_document_names_exists():
    paths = set(re.findall(r"`((?:pagedkv|tests|docs|tools)/[^`*<]+)`", DOC))
    assert "pagedkv/sequences/" in paths
    assert sorted(p for p in paths if not (ROOT / p.split(" ")[0]).exists()) == []


def test_every_module_named_in_a_folder_paragraph_is_in_that_folder():
    section = DOC[DOC.index("## What each folder holds") : DOC.index("## One engine step")]
    paragraphs = [p for p in section.split("\n\n")[1:] if p.strip()]
    assert len(paragraphs) == 11  # core, backends, codecs, driver, interop, kv, groups, cache, tiers, sequences, events
    for paragraph in paragraphs:
        folder = re.match(r"`pagedkv/([a-z_]+)/`", paragraph)
        assert folder, paragraph[:60]
        for module in re.findall(r"`([a-z_0-9]+\.py)`", paragraph):
            assert (PACKAGE / folder.group(1) / module).exists(), f"{folder.group(1)}/{module}"


def test_every_module_of_a_package_is_described():
    section = DOC[DOC.index("## What each folder holds") : DOC.index("## One engine step")]
    described = set(re.findall(r"`([a-z_0-9]+\.py)`", section))
    for package in ("core", "backends", "codecs", "interop", "kv", "groups", "cache", "tiers", "sequences", "events"):
        modules = {p.name for p in (PACKAGE / package).glob("*.py")} - {"__init__.py"}
        assert modules <= described, f"{package}: {sorted(modules - described)} not described"


def test_the_import_table_is_the_layering_table():
    table = DOC[DOC.index("| folder | may import |") : DOC.index("(every folder may import")]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("| `"):
            continue
        folder, allowed = (cell.strip() for cell in line.strip("|").split("|"))
        rows[folder.strip("`/")] = allowed
    everything = set(ALLOWED) - {"errors"}
    for folder, allowed in rows.items():
        if allowed == "nothing (but errors)":
            expected = set()
        elif allowed == "everything":
            expected = everything - {folder}
        elif allowed.startswith("everything but "):
            expected = everything - {folder, allowed.removeprefix("everything but ")}
        else:
            expected = {name.strip() for name in allowed.split(",")}
        assert expected == ALLOWED[folder] - {"errors"}, folder
    assert set(rows) == set(ALLOWED) - {"errors"}


def test_tests_mirror_the_package():
    test_folders = {d.name for d in (ROOT / "tests").iterdir() if d.is_dir() and any(d.glob("test_*.py"))}
    packages = {d.name for d in PACKAGE.iterdir() if (d / "__init__.py").exists()}
    assert test_folders == packages
    for folder in test_folders:
        for test in (ROOT / "tests" / folder).glob("test_*.py"):
            assert not (ROOT / "tests" / test.name).exists(), test.name  # one name, one place
