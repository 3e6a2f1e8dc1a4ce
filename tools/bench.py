#!/usr/bin/env python3
"""pagedkv benchmarks: each section measures ours and its baseline side by side in one run
and prints ratios. `python tools/bench.py` runs the CPU sections; `--gpu` the GPU ones.

Sections live in their own modules beside this file (bench_host.py, bench_serving.py, bench_gpu.py,
bench_kv.py, bench_quality.py, bench_elastic.py, bench_transfer.py, bench_tier.py, bench_disk.py,
bench_step.py, bench_engine.py, bench_model.py, bench_drafting.py, bench_events.py, bench_hybrid.py); each exposes
`run(args) -> None` and prints its own table.

Floors: a section checks each figure that has a bound with `floors.py` (beside this file):

    from floors import ceiling, floor
    floor("batched alloc vs single", speedup, 5.0)       # speedup must be >= 5x
    ceiling("SequenceTable vs direct", slowdown, 1.1)    # slowdown must be <= 1.1x

Each prints one line ending `ok` or `MISSED`. `--strict` makes bench.py exit 1 when any
floor of the sections run was missed (and lists them); without it the exit status is 0.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import floors  # noqa: E402 - beside this file

# name -> (module, needs a GPU)
SECTIONS = {
    "host": ("bench_host", False),
    "quality": ("bench_quality", False),
    "serving": ("bench_serving", False),
    "elastic": ("bench_elastic", False),
    "transfer": ("bench_transfer", False),
    "disk": ("bench_disk", False),
    "step": ("bench_step", False),
    "engine": ("bench_engine", False),
    "model": ("bench_model", False),
    "drafting": ("bench_drafting", False),
    "events": ("bench_events", False),
    "hybrid": ("bench_hybrid", False),
    "gpu": ("bench_gpu", True),
    "kv": ("bench_kv", True),
    "tier": ("bench_tier", True),
}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections (with no flag, every CPU section); 1 with --strict when a floor was missed."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpu", action="store_true", help="run the GPU section (needs CUDA)")
    parser.add_argument("--section", action="append", choices=sorted(SECTIONS), help="run only these")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a floor is missed")
    args = parser.parse_args(argv)
    floors.reset()
    chosen = args.section or [n for n, (_, gpu) in SECTIONS.items() if gpu == args.gpu]
    for name in chosen:
        module_name, _ = SECTIONS[name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:
                raise
            print(f"[{name}] section not present in this checkout")
            continue
        print(f"== {name} ==")
        module.run(args)
    missed = floors.missed()
    if missed:
        print(f"MISSED {len(missed)} floor(s): {'; '.join(missed)}")
    return 1 if missed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
