"""The "vllm-sha256-cbor" hash scheme: canonical CBOR against RFC 8949's own examples, and
the prefix cache's block hashes against an independent implementation written here from
vLLM v1's specification (sha256 of CBOR [parent, [tokens], extra_keys], the root from the
seed string, the salt on a prompt's first block), on random blocks with and without keys."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.sequences.vllm_hash import cbor

RFC8949_EXAMPLES = [  # Appendix A
    (0, "00"), (1, "01"), (10, "0a"), (23, "17"), (24, "1818"), (25, "1819"), (100, "1864"), (1000, "1903e8"),
    (1000000, "1a000f4240"), (1000000000000, "1b000000e8d4a51000"), (18446744073709551615, "1bffffffffffffffff"),
    (18446744073709551616, "c249010000000000000000"), (-18446744073709551616, "3bffffffffffffffff"),
    (-18446744073709551617, "c349010000000000000000"), (-1, "20"), (-10, "29"), (-100, "3863"), (-1000, "3903e7"),
    (False, "f4"), (True, "f5"), (None, "f6"), (b"", "40"), (bytes.fromhex("01020304"), "4401020304"), ("", "60"),
    ("a", "6161"), ("IETF", "6449455446"), ('"\\', "62225c"), ("\u00fc", "62c3bc"), ("\u6c34", "63e6b0b4"),
    ((), "80"), ((1, 2, 3), "83010203"), ((1, (2, 3), (4, 5)), "8301820203820405"),
    (tuple(range(1, 26)), "98190102030405060708090a0b0c0d0e0f101112131415161718181819"),
]


@pytest.mark.parametrize("value, encoded", RFC8949_EXAMPLES)
def test_canonical_cbor_matches_the_rfc_examples(value, encoded):
    assert cbor(value).hex() == encoded


# -- an independent implementation of vLLM's scheme, for the test ------------------------------

def ref_cbor(x) -> bytes:
    def head(major, n):
        for limit, extra, fmt in ((24, None, None), (1 << 8, 24, ">B"), (1 << 16, 25, ">H"), (1 << 32, 26, ">I"),
                                  (1 << 64, 27, ">Q")):
            if n < limit:
                return struct.pack(">B", (major << 5) | (n if extra is None else extra)) + (
                    b"" if fmt is None else struct.pack(fmt, n))
        raise AssertionError("not needed here")

    if x is None:
        return b"\xf6"
    if isinstance(x, bytes):
        return head(2, len(x)) + x
    if isinstance(x, str):
        return head(3, len(x.encode())) + x.encode()
    if isinstance(x, int):
        return head(0, x) if x >= 0 else head(1, -x - 1)
    return head(4, len(x)) + b"".join(ref_cbor(v) for v in x)


def ref_chain(seed, tokens, bs, per_block_extras):
    parent = hashlib.sha256(ref_cbor(seed)).digest()
    out = []
    for i in range(len(tokens) // bs):
        parent = hashlib.sha256(ref_cbor((parent, tuple(tokens[i * bs : (i + 1) * bs]), per_block_extras[i]))).digest()
        out.append(parent)
    return out


BS = 16


def make(seed="0", events=None):
    gpu = HostBackend(1 << 26)
    cfg = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(cfg, 64, gpu)
    prefix = PrefixCache(cache, on_event=events, hash_scheme="vllm-sha256-cbor", hash_seed=seed)
    return gpu, cache, prefix, SequenceTable(cache, prefix, gpu)


@pytest.mark.parametrize("trial", range(12))
def test_block_hashes_agree_with_the_independent_implementation(trial):
    rng = np.random.default_rng(trial)
    got = []
    seed = str(int(rng.integers(0, 2**32)))
    gpu, cache, prefix, table = make(seed, got.append)
    n = int(rng.integers(BS, 5 * BS))
    tokens = rng.integers(0, [30, 300, 70000, 2**40][trial % 4], n).tolist()
    kw, extras = {}, [None] * (n // BS)
    if trial % 3:
        lora = "lora-%d" % trial
        image = bytes(rng.integers(0, 256, 32, dtype=np.uint8))
        at = int(rng.integers(0, n - 3))
        kw["extra_keys"] = [(0, n, lora), (at, 3, image)]
        extras = [tuple([lora] + ([image] if i * BS < at + 3 and at < (i + 1) * BS else [])) for i in range(n // BS)]
    if trial % 2:
        kw["cache_salt"] = "salt-%d" % trial
        extras[0] = tuple(list(extras[0] or ()) + [kw["cache_salt"]])
    table.add("a", tokens, **kw)
    table.cache_prefix("a")
    want = ref_chain(seed, tokens, BS, extras)
    assert [prefix.block_hash(b) for b in table.blocks("a")[: n // BS]] == want
    assert got[0].block_hashes == tuple(want) and got[0].parent_block_hash is None
    table.free("a")
    prefix.close()
    cache.release(gpu)


def test_a_continuation_names_its_parent_and_removals_carry_digests():
    got = []
    gpu, cache, prefix, table = make("1234", got.append)
    tokens = list(range(3 * BS + 1))
    table.add("a", tokens[: BS + 1])
    table.free("a")
    table.add("b", tokens)
    table.free("b")
    want = ref_chain("1234", tokens, BS, [None] * 3)
    assert got[1].parent_block_hash == want[0] and got[1].block_hashes == tuple(want[1:])
    prefix.evict(3)
    assert set(got[-1].block_hashes) == set(want)
    prefix.close()
    cache.release(gpu)


def test_the_seed_is_required_and_checked(monkeypatch):
    gpu = HostBackend(1 << 26)
    cache = PagedKvCache(KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16"), 4, gpu)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="needs hash_seed="):
        PrefixCache(cache, hash_scheme="vllm-sha256-cbor")
    with pytest.raises(TypeError, match="hash_seed must be a str"):
        PrefixCache(cache, hash_scheme="vllm-sha256-cbor", hash_seed=0)
    with pytest.raises(ValueError, match="hash_scheme must be one of"):
        PrefixCache(cache, hash_scheme="sha256")
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    prefix = PrefixCache(cache, hash_scheme="vllm-sha256-cbor")
    assert prefix.hash_scheme() == "vllm-sha256-cbor"
    blocks = cache.alloc_blocks(1)
    prefix.insert(list(range(BS)), blocks)
    assert prefix.block_hash(blocks[0]) == ref_chain("42", list(range(BS)), BS, [None])[0]
    cache.free_blocks(blocks)
    prefix.close()
    cache.release(gpu)


def test_token_ids_at_every_cbor_width_boundary():
    edges = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 1, 22, 25, 254, 257, 65537]
    gpu, cache, prefix, table = make("7")
    blocks = cache.alloc_blocks(1)
    prefix.insert(edges, blocks)
    assert prefix.block_hash(blocks[0]) == ref_chain("7", edges, BS, [None])[0]
    cache.free_blocks(blocks)
    prefix.close()
    cache.release(gpu)
