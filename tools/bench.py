#!/usr/bin/env python3
"""pagedkv benchmarks: each section measures ours and its baseline side by side in one run
and prints ratios. `python tools/bench.py` runs the CPU sections; `--gpu` the GPU one.

Sections live in their own modules beside this file (bench_host.py, bench_serving.py, bench_gpu.py,
bench_quality.py); each exposes `run(args) -> None` and prints its own table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# name -> (module, needs a GPU)
SECTIONS = {
    "host": ("bench_host", False),
    "quality": ("bench_quality", False),
    "serving": ("bench_serving", False),
    "gpu": ("bench_gpu", True),
}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections; with no flag, every CPU section."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpu", action="store_true", help="run the GPU section (needs CUDA)")
    parser.add_argument("--section", action="append", choices=sorted(SECTIONS), help="run only these")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    args = parser.parse_args(argv)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
