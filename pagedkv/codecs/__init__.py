"""pagedkv.codecs: host codecs of every storage format, bit-exact to FORMATS.md (shipped as docs/FORMATS.md).

`encode`/`decode` turn a block side's values into its bytes and back; `rotate`/`unrotate`
are the Walsh-Hadamard transform of the turbo formats. Everything is vectorised numpy and
ml_dtypes; the sub-modules hold the pieces (floats, codebooks, packing, groups, rotation).

May import: `pagedkv.core`, `pagedkv.errors`.
"""

from .rotation import ROTATED_HEAD_DIMS, rotate, unrotate
from .side import check_side_geometry, decode, encode, side_format

__all__ = [
    "ROTATED_HEAD_DIMS",
    "check_side_geometry",
    "decode",
    "encode",
    "rotate",
    "side_format",
    "unrotate",
]
