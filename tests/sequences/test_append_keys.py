"""Extra keys for tokens appended later (`SequenceTable.append(..., extra_keys=...)`): the
blocks those tokens complete are keyed (and, under the vLLM scheme, hashed) with them when
they are cached, after the prompt's keys; truncate cuts them; bad ranges change nothing."""

from __future__ import annotations

import numpy as np
import pytest
from shared_helpers import hits, keyed_table_world
from test_vllm_hash import ref_chain

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable

BS = 4
TOKENS = list(range(100, 113))  # 13: 3 full blocks and one token


@pytest.fixture
def world():
    yield from keyed_table_world(BS)




def test_keys_given_with_appended_tokens_key_the_blocks_they_complete(world):
    cache, prefix, table = world
    table.add("a", TOKENS[:6])
    table.append("a", token_ids=TOKENS[6:], extra_keys=[(1, 3, "img")])  # positions 7, 8, 9: blocks 1 and 2
    assert table.num_tokens("a") == 13
    assert table.cache_prefix("a") == 3
    assert hits(prefix, cache, TOKENS, extra_keys=[(7, 3, "img")]) == 12
    assert hits(prefix, cache, TOKENS) == 4  # block 0 has no key; block 1 does
    assert hits(prefix, cache, TOKENS, extra_keys=[(8, 2, "img")]) == 4  # now block 1 lacks it
    assert hits(prefix, cache, TOKENS, extra_keys=[(7, 3, "other")]) == 4


def test_appended_keys_follow_the_prompts_and_one_token_steps_take_them(world):
    cache, prefix, table = world
    table.add("a", TOKENS[:5], extra_keys=[(0, 5, "lora:a")])
    for i, t in enumerate(TOKENS[5:]):
        table.append("a", 1, [t], extra_keys=[(0, 1, "img")] if i == 2 else None)  # position 7: block 1
    table.free("a")
    want = [(0, 5, "lora:a"), (7, 1, "img")]  # block 1 carries both
    assert hits(prefix, cache, TOKENS, extra_keys=want) == 12
    assert hits(prefix, cache, TOKENS, extra_keys=want[::-1]) == 4  # keys are in order: the prompt's first


def test_truncate_cuts_the_keys_of_the_positions_it_takes_back(world):
    cache, prefix, table = world
    table.add("a", TOKENS[:6])
    table.append("a", token_ids=TOKENS[6:10], extra_keys=[(0, 4, "img")], lookahead=2)  # positions 6..9
    table.truncate("a", 8)  # keeps 6, 7 of the image
    table.append("a", token_ids=TOKENS[8:])
    table.free("a")
    assert hits(prefix, cache, TOKENS, extra_keys=[(6, 2, "img")]) == 12
    assert hits(prefix, cache, TOKENS, extra_keys=[(6, 4, "img")]) == 8


@pytest.mark.parametrize(("keys", "error", "words"), [
    ([(0, 3, "x")], ValueError, r"extra_keys\[0\] covers tokens \[0, 3\) of the step, which appends 2"),
    ([(0, 1, "x"), (2, 1, "y")], ValueError, r"extra_keys\[1\] covers tokens \[2, 3\)"),
    ([(0, 0, "x")], ValueError, r"extra_keys\[0\] length must be >= 1"),
    ([(0, 1, 1.5)], TypeError, r"extra_keys\[0\] key must be a str, bytes or an int"),
    ("abc", TypeError, "extra_keys must be an iterable"),
])
def test_bad_keys_are_refused_and_nothing_changes(world, keys, error, words):
    cache, prefix, table = world
    table.add("a", TOKENS[:6])
    free, blocks = cache.num_free_blocks(), table.blocks("a")
    with pytest.raises(error, match=words):
        table.append("a", token_ids=TOKENS[6:8], extra_keys=keys)
    assert table.num_tokens("a") == 6 and table.blocks("a") == blocks and cache.num_free_blocks() == free
    table.append("a", token_ids=TOKENS[6:])
    table.free("a")
    assert hits(prefix, cache, TOKENS) == 12  # no key stuck to the sequence


def test_appended_keys_enter_vllm_block_hashes_where_vllm_puts_them():
    bs = 16
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, 70000, 50).tolist()
    image = bytes(rng.integers(0, 256, 32, dtype=np.uint8))
    events: list = []
    gpu = HostBackend(1 << 26)
    cache = PagedKvCache(KvCacheConfig(block_size=bs, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16"), 16, gpu)
    prefix = PrefixCache(cache, on_event=events.append, hash_scheme="vllm-sha256-cbor", hash_seed="7")
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", tokens[:20], extra_keys=[(0, 20, "lora-x")], cache_salt="tenant")
    table.append("a", token_ids=tokens[20:], extra_keys=[(5, 10, image)])  # positions 25..34: blocks 1 and 2
    table.cache_prefix("a")
    want = ref_chain("7", tokens, bs, [("lora-x", "tenant"), ("lora-x", image), (image,)])
    assert [prefix.block_hash(b) for b in table.blocks("a")[:3]] == want
    assert events[0].block_hashes == tuple(want)
    assert events[0].extra_keys == (("lora-x", "tenant"), ("lora-x", image), (image,))
    table.free("a")
    prefix.close()
    cache.release(gpu)
