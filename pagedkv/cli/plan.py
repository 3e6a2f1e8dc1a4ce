"""`pagedkv plan`: how many tokens fit in a memory budget, per storage format."""

from __future__ import annotations

import argparse
import re
from fractions import Fraction
from dataclasses import dataclass

from .config import KvCacheConfig
from .dtype import KvCacheDtype

_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}


def parse_bytes(text: str) -> int:
    """`40GiB`, `512MiB`, `1.5TB`, `40G` (binary), `1000` -> bytes, computed exactly and
    rounded down to a whole byte; ValueError on anything else or on less than one byte."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (examples: 40GiB, 512MiB, 1.5TB, 1000)")
    nbytes = int(Fraction(match.group(1)) * _UNITS[unit])
    if nbytes < 1:
        raise ValueError(f"not a memory size: {text!r} is less than one byte")
    return nbytes


def parse_dims(text: str) -> tuple[tuple[int, int], ...]:
    """`8x128,4x256` -> ((8, 128), (4, 256)): per-layer (num_kv_heads, head_dim)."""
    dims = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", item)
        if match is None:
            raise ValueError(f"not a HEADSxHEAD_DIM pair: {item!r} (example: 8x128)")
        dims.append((int(match.group(1)), int(match.group(2))))
    return tuple(dims)


def parse_dtypes(values: list[str] | None) -> list[KvCacheDtype]:
    """Repeated or comma-separated format names -> formats, in order, without repeats."""
    if not values:
        return list(KvCacheDtype)
    names = [n for value in values for n in value.split(",") if n.strip()]
    return list(dict.fromkeys(KvCacheDtype.parse(n) for n in names))


@dataclass(frozen=True)
class PlanRow:
    """One format's cost: bytes per token across all layers, blocks and tokens that fit."""

    dtype: KvCacheDtype
    bytes_per_block: int
    blocks: int
    tokens: int
    error: str | None = None


def plan_rows(base: dict, dtypes: list[KvCacheDtype], memory: int) -> list[PlanRow]:
    """A row per format for the config keyword arguments `base` (without `dtype`)."""
    rows = []
    for dtype in dtypes:
        try:
            config = KvCacheConfig(dtype=dtype, **base)
        except ValueError as err:
            rows.append(PlanRow(dtype, 0, 0, 0, error=str(err)))
            continue
        per_block = config.block_bytes_kv_all_layers()
        blocks = memory // per_block
        rows.append(PlanRow(dtype, per_block, blocks, blocks * config.block_size))
    return rows


def format_table(rows: list[PlanRow], block_size: int, bf16_tokens: int | None) -> str:
    """The plan as an aligned text table."""
    header = ("format", "K bits", "V bits", "bytes/token", "blocks", "tokens", "vs bf16")
    lines = [header]
    for row in rows:
        k_bits, v_bits = row.dtype.side_bits()
        if row.error:
            lines.append((str(row.dtype), f"{k_bits:g}", f"{v_bits:g}", "n/a", "-", "-", row.error))
            continue
        ratio = f"{row.tokens / bf16_tokens:.2f}x" if bf16_tokens else "-"
        lines.append((
            str(row.dtype), f"{k_bits:g}", f"{v_bits:g}", f"{row.bytes_per_block / block_size:,.1f}",
            f"{row.blocks:,}", f"{row.tokens:,}", ratio,
        ))
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
        for line in lines
    )


def _gpu_free_bytes() -> int | None:
    """Free memory of GPU 0 when a CUDA backend is present, else None."""
    try:
        from . import driver
    except ImportError:
        return None
    is_available = getattr(driver, "is_available", None)
    if is_available is None or not is_available():
        return None
    with driver.CudaBackend() as gpu:
        return gpu.mem_info()[0]


def run(args: argparse.Namespace) -> int:
    """Print the plan table; returns the exit status."""
    memory = parse_bytes(args.memory) if args.memory else _gpu_free_bytes()
    if memory is None:
        print("pagedkv plan: no GPU here to measure free memory; give --memory (e.g. --memory 40GiB)")
        return 2
    base = dict(
        block_size=args.block_size, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        num_layers=args.layers, v_aliases_k=args.v_aliases_k,
        layer_dtypes=tuple(parse_dtypes([args.layer_dtypes])) if args.layer_dtypes else (),
        layer_dims=parse_dims(args.layer_dims) if args.layer_dims else (),
    )
    rows = plan_rows(base, parse_dtypes(args.dtype), memory)
    bf16 = plan_rows(base, [KvCacheDtype.BF16], memory)[0]
    print(
        f"{args.layers} layers, {args.kv_heads} KV heads x head_dim {args.head_dim}, block {args.block_size}"
        f"{', V aliases K' if args.v_aliases_k else ''}, memory {memory / 2**30:.2f} GiB"
    )
    print(format_table(rows, args.block_size, bf16.tokens if not bf16.error else None))
    return 0


def register(subparsers) -> None:
    """Add the `plan` subcommand."""
    p = subparsers.add_parser("plan", help="tokens that fit in a memory budget, per format")
    p.add_argument("--layers", type=int, required=True, help="number of attention layers")
    p.add_argument("--kv-heads", type=int, required=True, help="KV heads per layer")
    p.add_argument("--head-dim", type=int, required=True, help="elements per head")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--memory", help="budget, e.g. 40GiB (default: the GPU's free memory)")
    p.add_argument("--dtype", action="append", help="formats to show (repeat or comma-separate; default all)")
    p.add_argument("--layer-dtypes", help="per-layer formats, comma-separated, first layers first")
    p.add_argument("--layer-dims", help="per-layer HEADSxHEAD_DIM, comma-separated (e.g. 8x128,4x256)")
    p.add_argument("--v-aliases-k", action="store_true", help="V shares K's pool (MLA-style)")
    p.set_defaults(func=_run_checked)


def _run_checked(args: argparse.Namespace) -> int:
    try:
        return run(args)
    except ValueError as err:
        print(f"pagedkv plan: {err}")
        return 2
