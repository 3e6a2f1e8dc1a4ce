"""The quality table: structure, the orderings it must show, the CLI and the bench section."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pytest

from pagedkv import KvCacheDtype
from pagedkv.cli import main
from pagedkv.kv.quality import SCORE_SPREAD, attention, format_table, quality_table, synthetic_kv


@pytest.fixture(scope="module")
def rows():
    return {row.fmt: row for row in quality_table(tokens=64, heads=4, head_dim=128, seed=0)}


def test_one_row_per_format_in_order(rows):
    assert list(rows) == list(KvCacheDtype)
    for fmt, row in rows.items():
        assert row.bits == fmt.bits_per_element()
        k_fmt, v_fmt = fmt.kv_pair()
        assert (row.k_rel_mse_norot is None) == (not k_fmt.is_wht_rotated())
        assert (row.v_rel_mse_norot is None) == (not v_fmt.is_wht_rotated())


def test_asymmetric_rows_reuse_their_sides(rows):
    for fmt in KvCacheDtype:
        if fmt.is_asymmetric():
            k_fmt, v_fmt = fmt.kv_pair()
            assert rows[fmt].k_rel_mse == rows[k_fmt].k_rel_mse
            assert rows[fmt].v_rel_mse == rows[v_fmt].v_rel_mse


def test_bf16_is_the_reference(rows):
    bf16 = rows[KvCacheDtype.BF16]
    assert bf16.attn_cos_min == pytest.approx(1.0, abs=1e-12)
    assert 1e-6 < bf16.k_rel_mse < 1e-5  # BF16 rounding: about 2^-9 relative


def test_fewer_bits_lose_more(rows):
    t4, t3, t2 = rows[KvCacheDtype.TURBO4], rows[KvCacheDtype.TURBO3], rows[KvCacheDtype.TURBO2]
    assert t4.k_rel_mse < t3.k_rel_mse < t2.k_rel_mse
    assert t4.v_rel_mse < t3.v_rel_mse < t2.v_rel_mse
    assert t4.attn_cos_mean > t3.attn_cos_mean > t2.attn_cos_mean
    bf = [rows[KvCacheDtype.parse(n)].attn_cos_mean for n in ("bf16k4v", "bf16k3v", "bf16k2v")]
    assert bf[0] > bf[1] > bf[2]


def test_rotation_helps_the_outlier_channels_of_k(rows):
    for fmt in (KvCacheDtype.TURBO4, KvCacheDtype.TURBO3, KvCacheDtype.TURBO2):
        assert rows[fmt].k_rel_mse < rows[fmt].k_rel_mse_norot


def test_synthetic_queries_have_the_stated_score_spread():
    k, v, q = synthetic_kv(64, 2, 128, seed=1)
    assert k.shape == v.shape == (64, 2, 128) and q.shape == (8, 2, 128)
    scores = np.einsum("qhd,thd->qht", q.astype(np.float64), k) / np.sqrt(128)
    np.testing.assert_allclose(scores.std(axis=-1), SCORE_SPREAD, rtol=1e-5)


def test_attention_of_uniform_scores_is_the_mean_of_v():
    q = np.zeros((1, 1, 16), np.float32)
    k = np.random.default_rng(0).standard_normal((5, 1, 16)).astype(np.float32)
    v = np.arange(5 * 16, dtype=np.float32).reshape(5, 1, 16)
    np.testing.assert_allclose(attention(q, k, v)[0, 0], v[:, 0].mean(axis=0))


def test_cli_prints_the_table(capsys):
    assert main(["quality", "--tokens", "32", "--heads", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("synthetic KV: 32 tokens x 2 KV heads")
    assert out[3:] == format_table(quality_table(32, 2, 128, 0)).splitlines()[2:]
    assert [line.split()[0] for line in out[3:]] == [str(f) for f in KvCacheDtype]


def test_cli_refuses_a_head_dim_the_grouped_formats_cannot_store(capsys):
    assert main(["quality", "--head-dim", "24"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "pagedkv quality: --head-dim 24 is not a multiple of 16 (the grouped formats need it)\n"


@pytest.mark.parametrize("bad", [["--tokens", "0"], ["--heads", "-2"], ["--seed", "-1"]])
def test_cli_refuses_bad_sizes_in_one_line(capsys, bad):
    assert main(["quality", *bad]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"pagedkv quality: argument {bad[0]}: ") and f"'{bad[1]}'" in err


def test_bench_section_prints_the_same_table(capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
    try:
        import bench_quality
    finally:
        sys.path.pop(0)
    bench_quality.run(argparse.Namespace(quick=True))
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == format_table(quality_table(128, 8, 128, 0)).splitlines()


def _one_shot_synthetic_kv(tokens, heads, head_dim, seed):
    """The generator as it was before streaming (whole arrays, one rng): the chunked one must draw the same."""
    rng = np.random.default_rng(seed)
    spread = np.exp(rng.normal(0.0, 0.5, (heads, head_dim)))
    k = rng.standard_t(4, (tokens, heads, head_dim)) * spread
    outliers = np.stack([rng.choice(head_dim, 4, replace=False) for _ in range(heads)])
    for h in range(heads):
        k[:, h, outliers[h]] = k[:, h, outliers[h]] * 8 + rng.normal(0, 12, 4)
    v_spread = np.exp(rng.normal(0.0, 0.3, (heads, head_dim)))
    v = rng.standard_t(5, (tokens, heads, head_dim)) * v_spread
    v[:, np.arange(heads), rng.integers(0, head_dim, heads)] *= 6
    q = rng.standard_normal((8, heads, head_dim))
    for h in range(heads):
        q[:, h, outliers[h]] *= 3
    q *= (SCORE_SPREAD / (np.einsum("qhd,thd->qht", q, k) / np.sqrt(head_dim)).std(axis=-1))[..., None]
    return k.astype(np.float32), v.astype(np.float32), q.astype(np.float32)


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_the_chunks_are_the_one_shot_draws(chunk):
    from pagedkv.kv.quality import SyntheticKv

    k, v, q = _one_shot_synthetic_kv(23, 2, 32, 4)
    data = SyntheticKv(23, 2, 32, 4, chunk=chunk)
    parts = list(data.chunks())
    assert [p[0].shape[0] for p in parts] == data.sizes() == [chunk] * (23 // chunk) + ([23 % chunk] if 23 % chunk else [])
    assert np.array_equal(np.concatenate([p[0] for p in parts]), k)
    assert np.array_equal(np.concatenate([p[1] for p in parts]), v)
    np.testing.assert_allclose(data.q, q, rtol=1e-6)  # the score spread merged chunk by chunk
    assert list(data.chunks())[0][0].tobytes() == parts[0][0].tobytes()  # a second pass draws the same


def test_streamed_attention_is_the_whole_softmax():
    from pagedkv.kv.quality import StreamedAttention

    k, v, q = _one_shot_synthetic_kv(40, 2, 16, 1)
    streamed = StreamedAttention(q)
    for start in range(0, 40, 6):
        streamed.add(k[start:start + 6], v[start:start + 6])
    np.testing.assert_allclose(streamed.result(), attention(q, k, v), rtol=1e-12, atol=1e-12)


def test_the_work_streams_in_chunks_and_gives_the_unchunked_table(monkeypatch):
    """Memory is bounded by the chunk: every array the codecs see holds at most `chunk` tokens
    (10 tokens in chunks of 4: 4, 4, 2 per pass), and the table equals one chunk's."""
    import pagedkv.kv.quality as quality
    from pagedkv.kv.quality import format_tier_table, quality_rows, tier_table

    seen = []
    real = quality._round_trip

    def recording(x, fmt, rotate):
        seen.append(x.shape[0])
        return real(x, fmt, rotate)

    whole = format_table(list(quality_rows(10, 1, 16, 2, chunk=10)))
    whole_tier = format_tier_table(tier_table(10, 1, 16, 2, chunk=10))
    monkeypatch.setattr(quality, "_round_trip", recording)
    monkeypatch.setattr(quality, "CHUNK_ELEMENTS", 64)  # 4 tokens of 1 x 16
    assert quality.chunk_tokens(1, 16) == 4
    streamed = format_table(list(quality_rows(10, 1, 16, 2)))
    assert set(seen) == {4, 2} and seen.count(4) == 2 * seen.count(2)
    assert streamed == whole
    seen.clear()
    assert format_tier_table(tier_table(10, 1, 16, 2)) == whole_tier
    assert set(seen) == {4, 2}


def test_progress_is_reported_after_each_chunk_of_each_pass():
    from pagedkv.kv.quality import quality_rows

    calls = []
    rows = list(quality_rows(5, 1, 16, 0, progress=lambda *a: calls.append(a), chunk=2))
    names = ["reference"] + [str(f) for f in KvCacheDtype]
    assert calls == [(name, step, 17, done, 5) for step, name in enumerate(names, 1) for done in (2, 4, 5)]
    assert len(rows) == 16
