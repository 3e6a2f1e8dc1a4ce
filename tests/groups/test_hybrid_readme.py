"""The README's "Hybrid models" example runs, and what it leaves behind is freed."""

from __future__ import annotations

import pathlib
import re


def test_the_readme_hybrid_example_runs():
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Hybrid models"):readme.index("## Serving: drafting")]
    (example,) = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["gpu"].live_allocations() == 0


def test_the_readme_plan_command_splits_the_budget_as_compute_num_blocks_does(capsys):
    import shlex

    import structlog

    from pagedkv import KvCacheConfig, PagedKvCache
    from pagedkv.cli import main
    from pagedkv.core.layer_groups import LayerGroup
    from pagedkv.groups.layout import GroupLayout

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Hybrid models"):readme.index("## Serving: drafting")]
    (command,) = re.findall(r"`pagedkv (plan [^`]*--groups[^`]*)`", section.replace("\n", " "))
    try:
        assert main(shlex.split(command)) in (0, None)
    finally:
        structlog.reset_defaults()
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:4]]
    kinds = ["sliding" if i % 6 != 5 else "full" for i in range(62)]
    config = KvCacheConfig(16, 16, 128, 62, "bf16", layer_groups=(
        LayerGroup("sliding", [i for i, k in enumerate(kinds) if k == "sliding"], window=1024),
        LayerGroup("full", [i for i, k in enumerate(kinds) if k == "full"])))
    layout = GroupLayout(config)
    counts = PagedKvCache.compute_num_blocks(config, 40 * 2**30, context=32768)
    for g, row in enumerate(rows):
        assert row[1] == layout.groups[g].kind
        assert int(row[6].replace(",", "")) == counts[g]
        assert int(row[5].replace(",", "")) == layout.bytes_per_sequence(g, 32768)
        assert float(row[4].replace(",", "")) == round(layout.bytes_per_sequence(g, 32768) / 32768, 1)
