"""The WHT sign tables compiled into kv_rows.cu (bit masks) are the package's sign tables
(formats/wht_signs.json through pagedkv.codecs.rotation), at the word offsets the driver
passes (pagedkv.driver.kv_kernels.SIGN_TABLE_WORDS)."""

import re

import numpy as np

from pagedkv.codecs.rotation import ROTATED_HEAD_DIMS, sign_tables
from pagedkv.driver import nvrtc
from pagedkv.driver.kv_kernels import SIGN_TABLE_WORDS


def test_kernel_sign_masks_are_the_json_tables():
    source = (nvrtc.SOURCE_DIR / "kv_rows.cu").read_text()
    body = re.search(r"WHT_SIGNS\[(\d+)\] = \{([^}]*)\}", source)
    words = [int(w.rstrip("u"), 16) for w in re.findall(r"0x[0-9A-F]+u", body.group(2))]
    assert len(words) == int(body.group(1)) == sum(2 * n // 32 for n in ROTATED_HEAD_DIMS)
    for n in ROTATED_HEAD_DIMS:
        for offset, signs in zip(SIGN_TABLE_WORDS[n], sign_tables(n)):
            bits = [(words[offset + d // 32] >> (d % 32)) & 1 for d in range(n)]
            assert np.array_equal(np.where(np.array(bits) == 1, -1.0, 1.0).astype(np.float32), signs), n
