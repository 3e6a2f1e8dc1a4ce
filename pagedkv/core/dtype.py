"""The sixteen KV storage formats and the byte cost of one block side in each.

A *side format* is one of the seven symmetric formats (bf16, fp8, nvfp4, turbo4, turbo3,
turbo2, turbo8); an asymmetric format names a K side format and a V side format.
`SIDE_FORMATS` is the one table of what a side format is (data bits, scale bytes per
group, rotation, codec); every byte count in the library comes from `side_bytes`.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

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
        return self in SIDE_FORMATS and SIDE_FORMATS[self].rotated

    def is_grouped(self) -> bool:
        """True when either side stores 16-element groups with per-group scales (nvfp4, turbo*)."""
        k, v = self.kv_pair()
        return SIDE_FORMATS[k].grouped or SIDE_FORMATS[v].grouped

    def side_bits(self) -> tuple[float, float]:
        """Bits per element of the K side and of the V side, scales included."""
        k, v = self.kv_pair()
        return SIDE_FORMATS[k].bits, SIDE_FORMATS[v].bits

    def bits_per_element(self) -> float:
        """Mean bits per stored element over K and V (the side's bits for a symmetric format)."""
        k, v = self.side_bits()
        return (k + v) / 2


class SideFormat(NamedTuple):
    """What one side format is: `data_bits` per element in the data section, `scale_bytes`
    per `GROUP_SIZE`-element group in the scale section (0: not grouped), whether values are
    Walsh-Hadamard `rotated` per head before encoding, and the `codec` family that encodes
    it in `pagedkv.codecs` ("bf16", "e4m3", "nvfp4", "turbo" codebook, "turbo8")."""

    data_bits: int
    scale_bytes: int
    rotated: bool
    codec: str

    @property
    def grouped(self) -> bool:
        """True when the format stores groups with a per-group scale."""
        return self.scale_bytes > 0

    @property
    def bits(self) -> float:
        """Bits per element, scales included."""
        return self.data_bits + self.scale_bytes * 8 / GROUP_SIZE


SIDE_FORMATS: dict[KvCacheDtype, SideFormat] = {
    KvCacheDtype.BF16: SideFormat(16, 0, False, "bf16"),
    KvCacheDtype.FP8: SideFormat(8, 0, False, "e4m3"),
    KvCacheDtype.NVFP4: SideFormat(4, 1, False, "nvfp4"),
    KvCacheDtype.TURBO4: SideFormat(4, 1, True, "turbo"),
    KvCacheDtype.TURBO3: SideFormat(3, 1, True, "turbo"),
    KvCacheDtype.TURBO2: SideFormat(2, 1, True, "turbo"),
    KvCacheDtype.TURBO8: SideFormat(8, 2, True, "turbo8"),
}
"""The seven side formats and what each is; asymmetric formats are pairs of these."""


def side_spec(side: KvCacheDtype) -> SideFormat:
    """The `SIDE_FORMATS` entry of side format `side`; ValueError for an asymmetric format."""
    spec = SIDE_FORMATS.get(side)
    if spec is None:
        raise ValueError(f"{side} is not a side format; use kv_pair() to split an asymmetric format")
    return spec


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
    bits, scale = side_spec(side)[:2]
    elements = positive_int(elements, "elements per block side")
    if scale and elements % GROUP_SIZE:
        raise ValueError(
            f"{side} stores {GROUP_SIZE}-element groups: {elements} elements per block side "
            f"is not a multiple of {GROUP_SIZE}"
        )
    return bits, scale
