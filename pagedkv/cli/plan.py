"""`pagedkv plan`: how many tokens fit in a memory budget, per storage format."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from fractions import Fraction

from ..core.config import KvCacheConfig
from ..core.dtype import KvCacheDtype
from .args import UsageError, converted, positive_int
from .plan_groups import parse_pattern, parse_state, run_groups

_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}


MAX_MEMORY = 1 << 60
"""The largest --memory `pagedkv plan` takes (1 EiB): past it the figures mean nothing."""


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
    if nbytes > MAX_MEMORY:
        raise ValueError(f"not a memory size: {text!r} is over 1 EiB (2**60 bytes), more than any machine holds")
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
    """Repeated or comma-separated format names -> the formats to show, in order, each once;
    every format when `values` is empty."""
    if not values:
        return list(KvCacheDtype)
    names = [n for value in values for n in value.split(",") if n.strip()]
    return list(dict.fromkeys(KvCacheDtype.parse(n) for n in names))


def parse_layer_dtypes(text: str) -> tuple[KvCacheDtype, ...]:
    """`bf16,bf16,fp8` -> one format per layer, first layers first, repeats kept (each is a layer)."""
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise ValueError(f"empty format name in {text!r} (example: bf16,bf16,fp8)")
    return tuple(KvCacheDtype.parse(n) for n in names)


@dataclass(frozen=True)
class PlanRow:
    """One format's cost: bytes of one block across all layers, blocks and tokens that fit."""

    dtype: KvCacheDtype
    bytes_per_block: int
    blocks: int
    tokens: int


def config_for(base: dict, dtype: KvCacheDtype) -> KvCacheConfig:
    """KvCacheConfig(dtype=dtype, **base); ValueError saying why when it cannot store its KV
    (for example a grouped format on a head_dim that is not a multiple of 16)."""
    return KvCacheConfig(dtype=dtype, **base)


def plan_row(config: KvCacheConfig, memory: int) -> PlanRow:
    """The row of `config` for a budget of `memory` bytes."""
    per_block = config.block_bytes_kv_all_layers()
    blocks = memory // per_block
    return PlanRow(config.dtype, per_block, blocks, blocks * config.block_size)


def plan_rows(base: dict, dtypes: list[KvCacheDtype], memory: int) -> tuple[list[PlanRow], dict[KvCacheDtype, str]]:
    """A row per format of `dtypes` that can store KV with the config keyword arguments
    `base` (without `dtype`), and for each other format the reason it cannot, the format's
    own name replaced by "its format" so that formats refused for one reason share it."""
    rows, refused = [], {}
    for dtype in dtypes:
        try:
            rows.append(plan_row(config_for(base, dtype), memory))
        except ValueError as err:
            refused[dtype] = str(err).replace(f" {dtype} ", " its format ")
    return rows, refused


def format_table(rows: list[PlanRow], block_size: int, bf16_tokens: int | None) -> str:
    """The plan as an aligned text table."""
    header = ("format", "K bits", "V bits", "bytes/token", "blocks", "tokens", "vs bf16")
    lines = [header]
    for row in rows:
        k_bits, v_bits = row.dtype.side_bits()
        ratio = f"{row.tokens / bf16_tokens:.2f}x" if bf16_tokens else "-"
        lines.append((
            str(row.dtype), f"{k_bits:g}", f"{v_bits:g}", f"{row.bytes_per_block / block_size:,.1f}",
            f"{row.blocks:,}", f"{row.tokens:,}", ratio,
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
        for line in lines
    )


def _runs(values: list[str]) -> str:
    """`["bf16", "bf16", "fp8"]` -> `0-1 bf16, 2 fp8`: layer ranges of equal values."""
    parts, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            parts.append(f"{span} {values[start]}")
            start = i
    return ", ".join(parts)


def describe(args: argparse.Namespace, layer_dtypes: tuple, layer_dims: tuple, memory: int) -> str:
    """The header line: geometry, budget, and the per-layer formats and dims when given."""
    line = (
        f"{args.layers} layers, {args.kv_heads} KV heads x head_dim {args.head_dim}, block {args.block_size}"
        f"{', V aliases K' if args.v_aliases_k else ''}, memory {memory / 2**30:.2f} GiB"
    )
    if layer_dtypes:
        formats = [str(d) for d in layer_dtypes]
        rest = args.layers - len(formats)
        tail = f", {len(formats)}-{args.layers - 1} the row's" if rest > 1 else (f", {len(formats)} the row's" if rest else "")
        line += f"; layer formats {_runs(formats)}{tail}"
    if layer_dims:
        dims = [f"{h}x{d}" for h, d in layer_dims]
        line += f"; layer dims {_runs(dims)}"
    return line


def _gpu_free_bytes() -> int | None:
    """Free memory of GPU 0 when a CUDA backend is present, else None."""
    try:
        from .. import driver
    except ImportError:
        return None
    is_available = getattr(driver, "is_available", None)
    if is_available is None or not is_available():
        return None
    with driver.CudaBackend() as gpu:
        return gpu.mem_info()[0]


def run(args: argparse.Namespace) -> int:
    """Print the plan table; UsageError for arguments that describe no valid cache."""
    memory = args.memory if args.memory is not None else _gpu_free_bytes()
    if memory is None:
        raise UsageError("no GPU here to measure free memory; give --memory (e.g. --memory 40GiB)")
    layer_dtypes = args.layer_dtypes or ()
    layer_dims = args.layer_dims or ()
    if len(layer_dtypes) > args.layers:
        raise UsageError(f"--layer-dtypes lists {len(layer_dtypes)} formats but --layers is {args.layers}")
    if len(layer_dims) > args.layers:
        raise UsageError(f"--layer-dims lists {len(layer_dims)} pairs but --layers is {args.layers}")
    base = dict(
        block_size=args.block_size, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        num_layers=args.layers, v_aliases_k=args.v_aliases_k, layer_dtypes=layer_dtypes, layer_dims=layer_dims,
    )
    if args.groups is not None:
        if args.context is None:
            raise UsageError("--groups needs --context (tokens per sequence)")
        dtype = parse_dtypes(args.dtype)[0] if args.dtype else KvCacheDtype.BF16
        try:
            run_groups(args, dict(base, dtype=dtype), memory)
        except ValueError as err:
            raise UsageError(str(err)) from None
        return 0
    try:
        bf16 = config_for(dict(base, layer_dtypes=()), KvCacheDtype.BF16)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if layer_dtypes:
        try:
            bf16 = config_for(base, KvCacheDtype.BF16)
        except ValueError as err:
            raise UsageError(f"--layer-dtypes: {err}") from None
    rows, refused = plan_rows(base, parse_dtypes(args.dtype), memory)
    if args.dtype and refused:
        dtype, reason = next(iter(refused.items()))
        raise UsageError(f"--dtype {dtype}: {reason}")
    print(describe(args, layer_dtypes, layer_dims, memory))
    print(format_table(rows, args.block_size, plan_row(bf16, memory).tokens or None))
    for reason in dict.fromkeys(refused.values()):
        names = [str(d) for d, r in refused.items() if r == reason]
        print(f"not listed: {', '.join(names)} ({reason})")
    return 0


def register(subparsers) -> None:
    """Add the `plan` subcommand."""
    p = subparsers.add_parser("plan", help="tokens that fit in a memory budget, per format")
    p.add_argument("--layers", type=positive_int, required=True, help="number of attention layers")
    p.add_argument("--kv-heads", type=positive_int, required=True, help="KV heads per layer")
    p.add_argument("--head-dim", type=positive_int, required=True, help="elements per head")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (default 16)")
    p.add_argument("--memory", type=converted(parse_bytes, "memory size"),
                   help="budget, e.g. 40GiB (default: the GPU's free memory)")
    p.add_argument("--dtype", action="append", type=converted(_checked_names, "formats"), help="formats to show (repeat or comma-separate; default all that fit)")
    p.add_argument("--layer-dtypes", type=converted(parse_layer_dtypes, "formats"),
                   help="per-layer formats, comma-separated, first layers first (repeats are layers)")
    p.add_argument("--layer-dims", type=converted(parse_dims, "dims"),
                   help="per-layer HEADSxHEAD_DIM, comma-separated (e.g. 8x128,4x256)")
    p.add_argument("--v-aliases-k", action="store_true", help="V shares K's pool (MLA-style)")
    p.add_argument("--groups", type=converted(parse_pattern, "layer pattern"),
                   help="hybrid layer pattern cycled over the layers, e.g. sliding/1024:5,full:1 or state:7,full:1 "
                        "(splits the budget across the groups; needs --context)")
    p.add_argument("--state", type=converted(parse_state, "state tensors"),
                   help="one state layer's tensors for state groups, e.g. 4x8192:bfloat16,128x64x128:float32")
    p.add_argument("--checkpoint-every", type=positive_int,
                   help="state groups' checkpoint_every in tokens, for --groups (sizes their checkpoint slots)")
    p.add_argument("--context", type=positive_int, help="tokens per sequence, for --groups")
    p.add_argument("--concurrency", type=positive_int, default=1, help="sequences at once, for --groups (default 1)")
    p.set_defaults(func=run)


def _checked_names(text: str) -> str:
    if not parse_dtypes([text]):
        raise ValueError(f"no format named in {text!r} (give names such as bf16,fp8)")
    return text
