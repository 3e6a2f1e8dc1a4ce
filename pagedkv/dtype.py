"""The sixteen KV storage formats and the byte cost of one block side in each.

A *side format* is one of the seven symmetric formats (bf16, fp8, nvfp4, turbo4, turbo3,
turbo2, turbo8); an asymmetric format names a K side format and a V side format. Every
byte count in the library comes from `side_bytes`.
"""

from __future__ import annotations

import enum

from .validate import positive_int

GROUP_SIZE = 16
"""Elements per quantisation group of the grouped formats (nvfp4 and turbo*)."""


class KvCacheDtype(enum.Enum):
    """A KV cache storage format; the value is the canonical (long) lower-case name."""

    BF16 = "bf16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"
    TURBO4 = "turbo4"
    TURBO3 = "turbo3"
    TURBO2 = "turbo2"
    TURBO8 = "turbo8"
    TURBO4K_TURBO3V = "turbo4k_turbo3v"
    TURBO4K_TURBO8V = "turbo4k_turbo8v"
    TURBO3K_TURBO8V = "turbo3k_turbo8v"
    BF16K_TURBO4V = "bf16k_turbo4v"
    BF16K_TURBO3V = "bf16k_turbo3v"
    FP8K_TURBO4V = "fp8k_turbo4v"
    FP8K_TURBO3V = "fp8k_turbo3v"
    BF16K_TURBO2V = "bf16k_turbo2v"
    FP8K_TURBO2V = "fp8k_turbo2v"

    def __str__(self) -> str:
        return self.value

    @property
    def canonical_name(self) -> str:
        """The canonical lower-case name (`turbo4k_turbo3v`), the same as `str(self)`."""
        return self.value

    @classmethod
    def parse(cls, name: "str | KvCacheDtype") -> "KvCacheDtype":
        """The format named `name` (canonical name, short alias or member); ValueError lists every accepted name."""
        if isinstance(name, KvCacheDtype):
            return name
        if not isinstance(name, str):
            raise TypeError(f"a KV cache dtype name must be a str, got {type(name).__name__} {name!r}")
        found = _BY_NAME.get(name.strip().lower())
        if found is None:
            raise ValueError(
                f"unknown KV cache dtype {name!r}; accepted names: {', '.join(accepted_names())}"
            )
        return found

    def kv_pair(self) -> tuple["KvCacheDtype", "KvCacheDtype"]:
        """(K side format, V side format); a symmetric format returns (self, self)."""
        return _PAIRS.get(self, (self, self))

    def is_asymmetric(self) -> bool:
        """True when K and V are stored in different formats."""
        return self in _PAIRS

    def is_wht_rotated(self) -> bool:
        """True for the symmetric turbo formats, whose values are Walsh-Hadamard rotated."""
        return self in _ROTATED

    def is_grouped(self) -> bool:
        """True when either side stores 16-element groups with per-group scales (nvfp4, turbo*)."""
        k, v = self.kv_pair()
        return _SIDE_GROUPED[k] or _SIDE_GROUPED[v]

    def side_bits(self) -> tuple[float, float]:
        """Bits per element of the K side and of the V side, scales included."""
        k, v = self.kv_pair()
        return _SIDE_BITS[k], _SIDE_BITS[v]

    def bits_per_element(self) -> float:
        """Mean bits per stored element over K and V (the side's bits for a symmetric format)."""
        k, v = self.side_bits()
        return (k + v) / 2


_SIDE_BITS = {
    KvCacheDtype.BF16: 16.0,
    KvCacheDtype.FP8: 8.0,
    KvCacheDtype.NVFP4: 4.5,
    KvCacheDtype.TURBO4: 4.5,
    KvCacheDtype.TURBO3: 3.5,
    KvCacheDtype.TURBO2: 2.5,
    KvCacheDtype.TURBO8: 9.0,
}
# (data bits per element, scale bytes per 16-element group) of each side format.
_SIDE_LAYOUT = {
    KvCacheDtype.BF16: (16, 0),
    KvCacheDtype.FP8: (8, 0),
    KvCacheDtype.NVFP4: (4, 1),
    KvCacheDtype.TURBO4: (4, 1),
    KvCacheDtype.TURBO3: (3, 1),
    KvCacheDtype.TURBO2: (2, 1),
    KvCacheDtype.TURBO8: (8, 2),
}
_SIDE_GROUPED = {fmt: scale > 0 for fmt, (_, scale) in _SIDE_LAYOUT.items()}
_ROTATED = frozenset(
    {KvCacheDtype.TURBO4, KvCacheDtype.TURBO3, KvCacheDtype.TURBO2, KvCacheDtype.TURBO8}
)


def _pairs() -> dict[KvCacheDtype, tuple[KvCacheDtype, KvCacheDtype]]:
    pairs = {}
    for fmt in KvCacheDtype:
        if "_" in fmt.value:
            k_name, v_name = fmt.value.split("_")
            pairs[fmt] = (KvCacheDtype(k_name[:-1]), KvCacheDtype(v_name[:-1]))
    return pairs


_PAIRS = _pairs()


def _short_alias(fmt: KvCacheDtype) -> str:
    """`turbo4k_turbo3v` -> `turbo4k3v`, `bf16k_turbo4v` -> `bf16k4v`."""
    k, v = _PAIRS[fmt]
    return f"{k.value}k{v.value.removeprefix('turbo')}v"


_BY_NAME: dict[str, KvCacheDtype] = {fmt.value: fmt for fmt in KvCacheDtype}
_BY_NAME.update({_short_alias(fmt): fmt for fmt in _PAIRS})


def accepted_names() -> list[str]:
    """Every name `KvCacheDtype.parse` accepts: canonical names, then short aliases."""
    return [fmt.value for fmt in KvCacheDtype] + [_short_alias(fmt) for fmt in _PAIRS]


def side_data_bytes(side: KvCacheDtype, elements: int) -> int:
    """Bytes of the data section of one block side of `elements` values in side format `side`."""
    bits, _ = _layout(side, elements)
    return elements * bits // 8


def side_scale_bytes(side: KvCacheDtype, elements: int) -> int:
    """Bytes of the scale section of one block side (0 for bf16 and fp8)."""
    _, scale = _layout(side, elements)
    return elements // GROUP_SIZE * scale


def side_bytes(side: KvCacheDtype, elements: int) -> int:
    """Bytes of one block side of `elements` values in side format `side`: data, then scales."""
    return side_data_bytes(side, elements) + side_scale_bytes(side, elements)


def _layout(side: KvCacheDtype, elements: int) -> tuple[int, int]:
    if side not in _SIDE_LAYOUT:
        raise ValueError(f"{side} is not a side format; use kv_pair() to split an asymmetric format")
    elements = positive_int(elements, "elements per block side")
    bits, scale = _SIDE_LAYOUT[side]
    if scale and elements % GROUP_SIZE:
        raise ValueError(
            f"{side} stores {GROUP_SIZE}-element groups: {elements} elements per block side "
            f"is not a multiple of {GROUP_SIZE}"
        )
    return bits, scale
