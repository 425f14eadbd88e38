"""Tests of the exact scaled-sign scan (eogp_index.search.scan) against a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

from eogp_index.errors import ConfigError, InputError
from eogp_index.search import scan as scan_mod
from eogp_index.search.scan import (
    SignLayout,
    pack_signs,
    scales_of,
    scan_scores,
    scan_scores_torch,
    scan_top_k,
    score_reference,
    unpack_signs,
)

# Layouts: k=1, odd k, k not a multiple of 8 or 64, one module and many of mixed sizes, and
# all-multiples-of-64 (which takes the in-place 64-bit word path of the pre-scan).
LAYOUTS = [
    (1,),
    (7,),
    (100,),
    (13, 100, 64, 3, 512, 9, 70),
    (1, 1, 1, 8, 9),
    (64, 192, 128),
]


def random_store(layout: SignLayout, n: int, rng: np.random.Generator):
    codes = pack_signs(rng.standard_normal((n, layout.num_coords)).astype(np.float32), layout)
    scales = rng.uniform(0.05, 2.0, size=(n, layout.num_modules)).astype(np.float16)
    return codes, scales


def score_scale(scales, y, layout) -> float:
    """``max_{q,i} Σ_u s_iu ‖y_qu‖₁``: the size that float rounding is relative to."""
    starts = np.asarray(layout.coord_offsets)
    l1 = np.add.reduceat(np.abs(y.astype(np.float64)), starts, axis=1)  # (nq, U)
    return float((scales.astype(np.float64) @ l1.T).max())


def assert_close(got, ref, scale, rtol=1e-4):
    assert got.shape == ref.shape
    err = np.abs(got.astype(np.float64) - ref).max() if ref.size else 0.0
    assert err <= rtol * scale, f"max error {err:.3g} exceeds {rtol} x {scale:.3g}"


def top_by_exact(scores: np.ndarray, k: int, largest: bool) -> np.ndarray:
    """Rows of the k best float32 scores per query, ties by row index (the documented order)."""
    out = []
    for s in scores:
        idx = np.arange(s.shape[0])
        key = -s.astype(np.float64) if largest else s.astype(np.float64)
        out.append(np.lexsort((idx, key))[:k])
    return np.asarray(out, dtype=np.int64).reshape(scores.shape[0], -1)


# ---------------------------------------------------------------------------------------------
# Layout and packing
# ---------------------------------------------------------------------------------------------


def test_layout_properties():
    layout = SignLayout([13, 100, 64, 3])
    assert layout.k == (13, 100, 64, 3)
    assert layout.num_modules == 4
    assert layout.num_coords == 180
    assert layout.module_bytes == (2, 13, 8, 1)
    assert layout.nbytes == 24
    assert layout.byte_offsets == (0, 2, 15, 23)
    assert layout.coord_offsets == (0, 13, 113, 177)
    assert hash(layout) == hash(SignLayout((13, 100, 64, 3)))


@pytest.mark.parametrize("k", [(), (0,), (4, -1), ("a",), None])
def test_layout_rejects_bad_k(k):
    with pytest.raises(ConfigError):
        SignLayout(k)


@pytest.mark.parametrize("k", LAYOUTS)
def test_pack_unpack_roundtrip_and_zero_padding(k):
    layout = SignLayout(k)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((33, layout.num_coords)).astype(np.float32)
    x[0, :] = 0.0  # zero counts as positive
    codes = pack_signs(x, layout)
    assert codes.dtype == np.uint8 and codes.shape == (33, layout.nbytes)
    np.testing.assert_array_equal(unpack_signs(codes, layout), np.where(x >= 0, 1.0, -1.0))
    # Each module equals np.packbits(bitorder="little") of its own coordinates (FAISS's order).
    for c0, kk, b0, nb in zip(layout.coord_offsets, layout.k, layout.byte_offsets, layout.module_bytes):
        np.testing.assert_array_equal(
            codes[:, b0 : b0 + nb], np.packbits(x[:, c0 : c0 + kk] >= 0, axis=1, bitorder="little")
        )
    # Padding bits are written as zero.
    for kk, b0, nb in zip(layout.k, layout.byte_offsets, layout.module_bytes):
        if kk % 8:
            assert not np.any(codes[:, b0 + nb - 1] >> (kk % 8))


def test_scales_of_is_mean_abs_in_float16():
    layout = SignLayout((5, 64, 3))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((10, layout.num_coords)).astype(np.float32) * 3
    s = scales_of(x, layout)
    assert s.dtype == np.float16 and s.shape == (10, 3)
    expect = np.stack([np.abs(x[:, c0 : c0 + kk]).mean(axis=1) for c0, kk in zip(layout.coord_offsets, layout.k)], 1)
    np.testing.assert_array_equal(s, expect.astype(np.float32).astype(np.float16))


def test_pack_and_scales_reject_bad_input():
    layout = SignLayout((8, 8))
    with pytest.raises(ConfigError):
        pack_signs(np.zeros((2, 15), np.float32), layout)
    with pytest.raises(InputError):
        pack_signs(np.full((2, 16), np.nan, np.float32), layout)
    with pytest.raises(InputError):
        scales_of(np.full((2, 16), 1e6, np.float32), layout)  # beyond float16


def test_half_decoding_is_exact_for_every_fp16_value():
    bits = np.arange(1 << 16, dtype=np.uint16)
    expect = bits.view(np.float16).astype(np.float64)
    got = np.array([scan_mod._half_to_f64(b) for b in bits[::7]])
    np.testing.assert_array_equal(got, expect[::7])  # NaN == NaN under assert_array_equal


# ---------------------------------------------------------------------------------------------
# Exact scan
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", LAYOUTS)
@pytest.mark.parametrize("nq", [1, 3])
def test_scan_scores_matches_reference(k, nq):
    layout = SignLayout(k)
    rng = np.random.default_rng(3)
    codes, scales = random_store(layout, 150, rng)
    y = rng.standard_normal((nq, layout.num_coords)).astype(np.float32)
    ref = score_reference(codes, scales, y, layout)
    got = scan_scores(codes, scales, y, layout)
    assert got.dtype == np.float32 and got.shape == (nq, 150)
    assert_close(got, ref, score_scale(scales, y, layout), rtol=1e-5)


def test_scan_scores_nibble_tables(monkeypatch):
    # Large batches switch to nibble tables; force it on a small one.
    monkeypatch.setattr(scan_mod, "_BYTE_LUT_MAX_BYTES", 0)
    layout = SignLayout((13, 100, 64, 3, 512, 9, 70))
    rng = np.random.default_rng(4)
    codes, scales = random_store(layout, 90, rng)
    y = rng.standard_normal((2, layout.num_coords)).astype(np.float32)
    assert scan_mod._use_nibbles(layout, 2)
    assert_close(
        scan_scores(codes, scales, y, layout),
        score_reference(codes, scales, y, layout),
        score_scale(scales, y, layout),
        rtol=1e-5,
    )


@pytest.mark.parametrize("k", [(13, 100, 64, 3, 512, 9, 70), (64, 192, 128)])
def test_large_batches_use_the_query_vectorized_kernel(k):
    """nq >= 16 goes through groups of 64 queries (the last one padded), one pass per group."""
    layout = SignLayout(k)
    rng = np.random.default_rng(19)
    codes, scales = random_store(layout, 1100, rng)  # more than one block of rows
    y = rng.standard_normal((70, layout.num_coords)).astype(np.float32)
    got = scan_scores(codes, scales, y, layout)
    assert_close(got, score_reference(codes, scales, y, layout), score_scale(scales, y, layout), rtol=1e-5)
    rows = rng.choice(1100, size=40)
    np.testing.assert_array_equal(scan_scores(codes, scales, y, layout, rows=rows), got[:, rows])
    # Each query's scores agree with scoring it alone (another kernel: float32 rounding only).
    single = scan_scores(codes, scales, y[5], layout)[0]
    assert_close(got[5], single.astype(np.float64), score_scale(scales, y[5:6], layout), rtol=1e-6)


@pytest.mark.parametrize("k", [(13, 100, 64, 3, 512, 9, 70), (64, 192, 128)])
def test_parallel_and_serial_paths_agree(k, monkeypatch):
    """Small jobs run on the calling thread; large ones over blocks of rows in parallel."""
    layout = SignLayout(k)
    rng = np.random.default_rng(20)
    codes, scales = random_store(layout, 700, rng)
    y = rng.standard_normal((2, layout.num_coords)).astype(np.float32)
    serial_scores = scan_scores(codes, scales, y, layout)
    serial_top = scan_top_k(codes, scales, y, layout, 6, chunk_rows=300)
    monkeypatch.setattr(scan_mod, "_SERIAL_MAX_BYTES", 0)
    np.testing.assert_array_equal(scan_scores(codes, scales, y, layout), serial_scores)
    top = scan_top_k(codes, scales, y, layout, 6, chunk_rows=300)
    np.testing.assert_array_equal(top.largest_indices, serial_top.largest_indices)
    np.testing.assert_array_equal(top.smallest_scores, serial_top.smallest_scores)
    np.testing.assert_array_equal(top.largest_indices, top_by_exact(serial_scores, 6, True))


def test_scan_scores_batch_equals_single_queries():
    layout = SignLayout((13, 100, 64))
    rng = np.random.default_rng(5)
    codes, scales = random_store(layout, 200, rng)
    y = rng.standard_normal((4, layout.num_coords)).astype(np.float32)
    batch = scan_scores(codes, scales, y, layout)
    for q in range(4):
        np.testing.assert_array_equal(batch[q], scan_scores(codes, scales, y[q], layout)[0])


def test_float32_scales_and_readonly_codes():
    layout = SignLayout((100, 7))
    rng = np.random.default_rng(6)
    codes, scales = random_store(layout, 70, rng)
    y = rng.standard_normal((2, layout.num_coords)).astype(np.float32)
    ref = scan_scores(codes, scales, y, layout)
    np.testing.assert_array_equal(scan_scores(codes, scales.astype(np.float32), y, layout), ref)
    ro = codes.copy()
    ro.setflags(write=False)  # arrays read from Arrow/LanceDB are usually read-only
    np.testing.assert_array_equal(scan_scores(ro, scales, y, layout), ref)


def test_misaligned_codes_and_empty_store():
    layout = SignLayout((64, 192, 128))  # whole 64-bit words: the pre-scan reads aligned rows in place
    rng = np.random.default_rng(21)
    codes, scales = random_store(layout, 300, rng)
    buf = np.zeros(codes.nbytes + 1, dtype=np.uint8)
    shifted = np.frombuffer(buf.data, dtype=np.uint8, count=codes.nbytes, offset=1).reshape(codes.shape)
    shifted[...] = codes
    assert shifted.ctypes.data % 8 != 0
    y = rng.standard_normal((2, layout.num_coords)).astype(np.float32)
    a, b = scan_top_k(shifted, scales, y, layout, 5), scan_top_k(codes, scales, y, layout, 5)
    np.testing.assert_array_equal(a.largest_indices, b.largest_indices)
    np.testing.assert_array_equal(a.smallest_scores, b.smallest_scores)
    assert scan_scores(codes[:0], scales[:0], y, layout).shape == (2, 0)
    assert scan_top_k(codes[:0], scales[:0], y, layout, 5).largest_indices.shape == (2, 0)


@pytest.mark.parametrize("k", [(7,), (13, 100, 64, 3, 512, 9, 70), (64, 192, 128)])
def test_padding_bits_are_masked(k):
    """Garbage in the padding bits of a module's last byte changes no score.

    pack_signs writes them as 0, but the kernels do not rely on it: the lookup tables give padding
    coordinates weight 0, and the pre-scan's query bit planes are 0 there.
    """
    layout = SignLayout(k)
    rng = np.random.default_rng(7)
    codes, scales = random_store(layout, 120, rng)
    dirty = codes.copy()
    for kk, b0, nb in zip(layout.k, layout.byte_offsets, layout.module_bytes):
        if kk % 8:
            dirty[:, b0 + nb - 1] |= np.uint8((0xFF << (kk % 8)) & 0xFF)
    y = rng.standard_normal((2, layout.num_coords)).astype(np.float32)
    np.testing.assert_array_equal(scan_scores(dirty, scales, y, layout), scan_scores(codes, scales, y, layout))
    assert_close(score_reference(dirty, scales, y, layout), score_reference(codes, scales, y, layout), 1.0, 0.0)
    a, b = scan_top_k(dirty, scales, y, layout, 5), scan_top_k(codes, scales, y, layout, 5)
    np.testing.assert_array_equal(a.largest_indices, b.largest_indices)
    np.testing.assert_array_equal(a.smallest_scores, b.smallest_scores)


def test_rows_subset_equals_select_after_full_scan():
    layout = SignLayout((13, 100, 64, 3, 512, 9, 70))
    rng = np.random.default_rng(8)
    codes, scales = random_store(layout, 400, rng)
    y = rng.standard_normal((3, layout.num_coords)).astype(np.float32)
    full = scan_scores(codes, scales, y, layout)
    rows = rng.choice(400, size=57, replace=False)  # unsorted
    rows = np.concatenate([rows, rows[:3]])  # duplicates are scored again, in place
    np.testing.assert_array_equal(scan_scores(codes, scales, y, layout, rows=rows), full[:, rows])
    assert scan_scores(codes, scales, y, layout, rows=np.array([], dtype=np.int64)).shape == (3, 0)


def test_real_like_correlated_codes():
    """Codes built from a correlated Gaussian matrix (like projected gradients) via pack_signs and
    scales_of; compare with the float64 ``Σ_u s_u ⟨y_u, sign(x_u)⟩`` computed from ``x``."""
    rng = np.random.default_rng(9)
    layout = SignLayout((64, 100, 37, 96))  # K = 297
    n, K = 2000, layout.num_coords
    mix = rng.standard_normal((K, K)) / np.sqrt(K) + 0.3 * np.eye(K)
    x = rng.standard_normal((n, 40)) @ rng.standard_normal((40, K)) + rng.standard_normal((n, K)) @ mix
    x = (x * np.linspace(0.01, 3.0, K)).astype(np.float32)  # uneven coordinate scales
    codes, scales = pack_signs(x, layout), scales_of(x, layout)
    y = (x[:5] + 0.5 * rng.standard_normal((5, K))).astype(np.float32)  # queries correlated with rows
    sign = np.where(x >= 0, 1.0, -1.0)
    ref = np.zeros((5, n))
    for u, (c0, kk) in enumerate(zip(layout.coord_offsets, layout.k)):
        ref += (y[:, c0 : c0 + kk].astype(np.float64) @ sign[:, c0 : c0 + kk].T) * scales[:, u].astype(np.float64)
    scale = score_scale(scales, y, layout)
    assert_close(scan_scores(codes, scales, y, layout), ref, scale, rtol=1e-5)
    top = scan_top_k(codes, scales, y, layout, 10)
    for q in range(5):
        np.testing.assert_array_equal(np.sort(top.largest_indices[q]), np.sort(np.argsort(-ref[q])[:10]))
        np.testing.assert_array_equal(np.sort(top.smallest_indices[q]), np.sort(np.argsort(ref[q])[:10]))
    assert top.largest_indices[0, 0] == 0  # a query built from row 0 ranks row 0 first


# ---------------------------------------------------------------------------------------------
# Top-k
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", LAYOUTS)
@pytest.mark.parametrize("chunk_rows", [None, 37])
def test_top_k_equals_sorted_scan(k, chunk_rows):
    layout = SignLayout(k)
    rng = np.random.default_rng(10)
    n = 300
    codes, scales = random_store(layout, n, rng)
    y = rng.standard_normal((2, layout.num_coords)).astype(np.float32)
    scores = scan_scores(codes, scales, y, layout)
    top = scan_top_k(codes, scales, y, layout, 7, chunk_rows=chunk_rows)
    for largest, idx, val in (
        (True, top.largest_indices, top.largest_scores),
        (False, top.smallest_indices, top.smallest_scores),
    ):
        expect = top_by_exact(scores, 7, largest)
        np.testing.assert_array_equal(idx, expect)
        np.testing.assert_array_equal(val, np.take_along_axis(scores, expect, axis=1))
    # And against the float64 reference, away from near-ties.
    ref = score_reference(codes, scales, y, layout)
    for q in range(2):
        srt = np.sort(ref[q])[::-1]
        if srt[6] - srt[7] > 1e-3 * score_scale(scales, y, layout):
            np.testing.assert_array_equal(np.sort(top.largest_indices[q]), np.sort(np.argsort(-ref[q])[:7]))


def test_top_k_with_ties_orders_by_row_index():
    layout = SignLayout((64, 3))
    rng = np.random.default_rng(11)
    codes, scales = random_store(layout, 40, rng)
    codes = np.repeat(codes[:8], 5, axis=0)  # every score appears 5 times
    scales = np.repeat(scales[:8], 5, axis=0)
    y = rng.standard_normal((1, layout.num_coords)).astype(np.float32)
    scores = scan_scores(codes, scales, y, layout)
    for chunk in (None, 3, 7):
        top = scan_top_k(codes, scales, y, layout, 12, chunk_rows=chunk)
        np.testing.assert_array_equal(top.largest_indices, top_by_exact(scores, 12, True))
        np.testing.assert_array_equal(top.smallest_indices, top_by_exact(scores, 12, False))


def test_top_k_with_rows_filter_returns_store_indices():
    layout = SignLayout((13, 100, 64, 3, 512, 9, 70))
    rng = np.random.default_rng(12)
    codes, scales = random_store(layout, 500, rng)
    y = rng.standard_normal((2, layout.num_coords)).astype(np.float32)
    rows = np.sort(rng.choice(500, size=60, replace=False))
    top = scan_top_k(codes, scales, y, layout, 5, rows=rows[::-1], chunk_rows=16)
    sub = scan_scores(codes, scales, y, layout, rows=rows)
    np.testing.assert_array_equal(top.largest_indices, rows[top_by_exact(sub, 5, True)])
    np.testing.assert_array_equal(top.smallest_indices, rows[top_by_exact(sub, 5, False)])
    assert np.isin(top.largest_indices, rows).all()


def test_top_k_one_direction_and_clipping():
    layout = SignLayout((9,))
    rng = np.random.default_rng(13)
    codes, scales = random_store(layout, 6, rng)
    y = rng.standard_normal((1, 9)).astype(np.float32)
    top = scan_top_k(codes, scales, y, layout, 10, smallest=False)
    assert top.smallest_indices is None and top.smallest_scores is None
    assert top.largest_indices.shape == (1, 6)  # k clipped to the rows scanned
    np.testing.assert_array_equal(top.largest_indices, top_by_exact(scan_scores(codes, scales, y, layout), 6, True))
    empty = scan_top_k(codes, scales, y, layout, 3, rows=np.array([], dtype=np.int64))
    assert empty.largest_indices.shape == (1, 0)
    with pytest.raises(ConfigError):
        scan_top_k(codes, scales, y, layout, 0)
    with pytest.raises(ConfigError):
        scan_top_k(codes, scales, y, layout, 3, largest=False, smallest=False)


def test_top_k_hard_queries():
    """Queries that stress the quantized pre-scan: zero modules, huge dynamic range, one spike."""
    layout = SignLayout((64, 100, 7, 128))
    rng = np.random.default_rng(14)
    codes, scales = random_store(layout, 700, rng)
    y = rng.standard_normal((4, layout.num_coords)).astype(np.float32)
    y[0, :64] = 0.0  # an all-zero module (Δ = 0)
    y[1] *= np.logspace(-6, 3, layout.num_coords).astype(np.float32)  # 9 decades within modules
    y[2] = 0.0
    y[2, 70] = 1e4  # a single coordinate
    y[3] = 1e-30  # tiny, constant
    scores = scan_scores(codes, scales, y, layout)
    top = scan_top_k(codes, scales, y, layout, 9, chunk_rows=100)
    np.testing.assert_array_equal(top.largest_indices, top_by_exact(scores, 9, True))
    np.testing.assert_array_equal(top.smallest_indices, top_by_exact(scores, 9, False))


def prescan_forms():
    """The pre-scan kernel forms this host can run: bit planes always, VNNI where available."""
    return [False, True] if scan_mod._prescan_vnni() else [False]


def prescan(codes, scales, level, layout, rows, parallel=True):
    """Run the pre-scan kernel directly: ``(approx, bound)`` ``(nq, len(rows))``."""
    g = scan_mod._geometry(layout)
    store = scan_mod._store_args(codes, scales)
    nq = level.qarr.shape[0]
    approx = np.empty((nq, rows.shape[0]))
    bound = np.empty((nq, rows.shape[0]))
    kernel = scan_mod._bounded_kernel if parallel else scan_mod._bounded_kernel_serial
    kernel(store, scan_mod._level_args(g, level.qarr, level.c1, level.c0, level.err), rows, approx, bound)
    return approx, bound


@pytest.mark.parametrize("k", [(13, 100, 64, 3, 512, 9, 70), (64, 192, 128), (1, 1, 1, 8, 9), (700,)])
def test_prescan_bounds_contain_exact_scores(k):
    """Both pre-scan levels bracket the exact float32 score, for both kernel forms (VNNI and bit
    planes), serial and parallel, on rows read in place at any alignment (the last row of the
    buffer is copied), with a rows subset in random order."""
    layout = SignLayout(k)
    rng = np.random.default_rng(15)
    codes, scales = random_store(layout, 200, rng)
    y = rng.standard_normal((3, layout.num_coords)).astype(np.float32)
    exact = scan_scores(codes, scales, y, layout).astype(np.float64)
    buf = np.zeros(codes.nbytes + 3, dtype=np.uint8)
    shifted = np.frombuffer(buf.data, dtype=np.uint8, count=codes.nbytes, offset=3).reshape(codes.shape)
    shifted[...] = codes
    rows = np.arange(200, dtype=np.int64)
    sub = rng.permutation(200)[:77].astype(np.int64)
    sub[0] = 199  # the buffer's last row
    results = {}
    for vnni in prescan_forms():
        levels = scan_mod._quantize_queries(y, layout, levels=2, vnni=vnni)
        total = np.zeros_like(exact)
        for li, level in enumerate(levels):
            approx, bound = prescan(codes, scales, level, layout, rows)
            for store, parallel in ((shifted, True), (codes, False)):
                a2, b2 = prescan(store, scales, level, layout, rows, parallel)
                np.testing.assert_array_equal(a2, approx)
                np.testing.assert_array_equal(b2, bound)
            a3, b3 = prescan(codes, scales, level, layout, sub)
            np.testing.assert_array_equal(a3, approx[:, sub])
            np.testing.assert_array_equal(b3, bound[:, sub])
            total += approx
            assert np.all(np.abs(exact - total) <= bound)
            results[(vnni, li)] = total.copy()
        # The second level is much tighter than the first.
        assert bound.mean() < 0.05 * np.abs(exact).mean()
    for li in range(2):  # integer inner products: both forms give the same approximations
        if (True, li) in results:
            np.testing.assert_array_equal(results[(True, li)], results[(False, li)])


def test_batch_prescan_equals_single_query_prescan():
    """The VNNI batch kernel (pairs of rows x groups of 8 queries, the last group padded) gives
    each query the same bits as the one-query kernel, rows read in place or copied (last row)."""
    if not scan_mod._prescan_vnni():
        pytest.skip("needs AVX512-VNNI")
    layout = SignLayout((13, 100, 64, 3, 512, 9, 70))
    rng = np.random.default_rng(22)
    codes, scales = random_store(layout, 150, rng)
    y = rng.standard_normal((11, layout.num_coords)).astype(np.float32)
    g = scan_mod._geometry(layout)
    store = scan_mod._store_args(codes, scales)
    rows = np.concatenate([rng.permutation(150)[:70], [149, 3, 149 - 1]]).astype(np.int64)  # odd count, last row
    level = scan_mod._quantize_queries(y, layout, levels=1, vnni=True)[0]
    qgrp, c1g, c0g, errg = scan_mod._group_levels(level)
    assert qgrp.shape[0] == 2 and c1g.shape == (2, layout.num_modules, scan_mod._QUERY_SET)
    approx = np.empty((11, rows.shape[0]))
    bound = np.empty_like(approx)
    scan_mod._bounded_batch_kernel(store, scan_mod._level_args(g, qgrp, c1g, c0g, errg), rows, approx, bound)
    a1, b1 = prescan(codes, scales, level, layout, rows)
    np.testing.assert_array_equal(approx, a1)
    np.testing.assert_array_equal(bound, b1)
    exact = scan_scores(codes, scales, y, layout, rows=rows).astype(np.float64)
    assert np.all(np.abs(exact - approx) <= bound)


def adversarial_store(layout, rng):
    """Rows with ties, all-ones/all-zeros codes and fp16 scales at the extremes (max, subnormal, 0)."""
    n = 96
    codes, scales = random_store(layout, n, rng)
    codes[10:20] = codes[5]  # ties
    scales[10:20] = scales[5]
    codes[20:24] = 0xFF
    codes[24:28] = 0
    scales[30:34] = np.float16(65504.0)  # largest fp16
    scales[34:38] = np.float16(2.0**-24)  # smallest subnormal
    scales[38:42] = 0.0
    scales[42:46, ::2] = np.float16(1e-3)
    scales[42:46, 1::2] = np.float16(3e4)  # modules at very different scales within a row
    return codes, scales


def adversarial_queries(layout, rng):
    K = layout.num_coords
    y = rng.standard_normal((8, K)).astype(np.float32)
    y[0] = 1.0  # every coordinate equal: ties everywhere
    y[1] *= np.logspace(-30, 4, K).astype(np.float32)  # 34 decades
    y[2] = 0.0
    y[2, K // 2] = -3e4  # one coordinate
    y[3] = 1e-44  # float32 subnormals
    y[4] = 0.0  # all zero: every score 0
    y[5] = np.where(np.arange(K) % 2, 1e-6, 1e3)  # alternating magnitudes
    y[6] = rng.integers(-2, 3, K)  # small integers: many exact ties between rows
    return y


@pytest.mark.parametrize("k", [(13, 100, 64, 3, 512, 9, 70), (64, 192, 128), (1, 1, 1, 8, 9)])
def test_prescan_bounds_hold_on_adversarial_data(k):
    """|exact float32 score - approximation| <= bound for both levels, both kernel forms and the
    batch kernel, on ties, extreme fp16 scales and extreme queries."""
    layout = SignLayout(k)
    rng = np.random.default_rng(23)
    codes, scales = adversarial_store(layout, rng)
    y = adversarial_queries(layout, rng)
    exact = scan_scores(codes, scales, y, layout).astype(np.float64)
    assert np.isfinite(exact).all()
    rows = np.arange(codes.shape[0], dtype=np.int64)
    for vnni in prescan_forms():
        levels = scan_mod._quantize_queries(y, layout, levels=2, vnni=vnni)
        total = np.zeros_like(exact)
        for level in levels:
            approx, bound = prescan(codes, scales, level, layout, rows)
            total += approx
            assert np.all(np.abs(exact - total) <= bound)
        if vnni:
            g = scan_mod._geometry(layout)
            store = scan_mod._store_args(codes, scales)
            qgrp, c1g, c0g, errg = scan_mod._group_levels(levels[0])
            approx = np.empty_like(exact)
            bound = np.empty_like(exact)
            scan_mod._bounded_batch_kernel(store, scan_mod._level_args(g, qgrp, c1g, c0g, errg), rows, approx, bound)
            assert np.all(np.abs(exact - approx) <= bound)


@pytest.mark.parametrize("vnni", [False, True])
def test_top_k_adversarial(vnni, monkeypatch):
    """Top-k equals sorting the exact scores on adversarial data: ties (ordered by row index),
    extreme scales and queries, k >= rows, a rows subset, one query and a batch (either pre-scan
    form), small chunks."""
    if vnni and not scan_mod._prescan_vnni():
        pytest.skip("needs AVX512-VNNI")
    monkeypatch.setattr(scan_mod, "_PRESCAN_VNNI", vnni)
    layout = SignLayout((13, 100, 64, 3, 512, 9, 70))
    rng = np.random.default_rng(24)
    codes, scales = adversarial_store(layout, rng)
    y = adversarial_queries(layout, rng)
    scores = scan_scores(codes, scales, y, layout)
    for kk, rows, chunk in ((5, None, None), (12, None, 29), (200, None, None), (7, np.arange(5, 60, 2), 11)):
        sub = scores if rows is None else scores[:, rows]
        for yq, sq in ((y, sub), (y[6:7], sub[6:7])):
            top = scan_top_k(codes, scales, yq, layout, kk, rows=rows, chunk_rows=chunk)
            for idx, val, largest in (
                (top.largest_indices, top.largest_scores, True),
                (top.smallest_indices, top.smallest_scores, False),
            ):
                expect = top_by_exact(sq, kk, largest)
                got = idx if rows is None else np.searchsorted(rows, idx)
                np.testing.assert_array_equal(got, expect)
                np.testing.assert_array_equal(val, np.take_along_axis(sq, expect, axis=1))


def test_top_k_batch_forms_agree(monkeypatch):
    """A batch (two query groups, the last padded) gives the same top-k through the VNNI batch
    pre-scan and through bit planes, and equals sorting the exact scores."""
    layout = SignLayout((64, 192, 128))
    rng = np.random.default_rng(25)
    codes, scales = random_store(layout, 900, rng)
    y = rng.standard_normal((11, layout.num_coords)).astype(np.float32)
    scores = scan_scores(codes, scales, y, layout)
    results = []
    for vnni in prescan_forms():
        monkeypatch.setattr(scan_mod, "_PRESCAN_VNNI", vnni)
        top = scan_top_k(codes, scales, y, layout, 9, chunk_rows=250)
        np.testing.assert_array_equal(top.largest_indices, top_by_exact(scores, 9, True))
        np.testing.assert_array_equal(top.smallest_indices, top_by_exact(scores, 9, False))
        results.append(top)
    for other in results[1:]:
        np.testing.assert_array_equal(other.largest_scores, results[0].largest_scores)


@pytest.mark.parametrize("k", [(7,), (13, 100, 64, 3, 512, 9, 70), (64, 192, 128)])
def test_direct_exact_scores_equal_the_table_walk(k):
    """Rescoring straight from the query (table entries computed on the fly) gives the same bits
    as the byte-table walk of scan_scores, garbage padding bits included."""
    layout = SignLayout(k)
    rng = np.random.default_rng(26)
    codes, scales = random_store(layout, 80, rng)
    for kk, b0, nb in zip(layout.k, layout.byte_offsets, layout.module_bytes):
        if kk % 8:
            codes[::2, b0 + nb - 1] |= np.uint8((0xFF << (kk % 8)) & 0xFF)
    y = rng.standard_normal((3, layout.num_coords)).astype(np.float32)
    y[2] *= np.logspace(-20, 5, layout.num_coords).astype(np.float32)
    scores = scan_scores(codes, scales, y, layout)
    g = scan_mod._geometry(layout)
    store = scan_mod._store_args(codes, scales)
    yp = scan_mod._padded_queries(y, layout)
    todo = {0: rng.permutation(80)[:30], 2: np.arange(80)}
    qidx = np.array([0, 2, 2], dtype=np.int64)
    indptr = np.array([0, 30, 70, 110], dtype=np.int64)
    prow = np.concatenate([todo[0], todo[2]]).astype(np.int64)
    out = np.empty(prow.shape[0], dtype=np.float32)
    scan_mod._exact_direct_pairs(store, yp, g.boff, scan_mod.Pairs(qidx, indptr, prow), out)
    np.testing.assert_array_equal(out[:30], scores[0, todo[0]])
    np.testing.assert_array_equal(out[30:], scores[2])


def test_selection_helpers_match_numpy():
    rng = np.random.default_rng(27)
    a = rng.standard_normal(500).round(1)  # many ties
    b = rng.uniform(0, 0.5, 500)
    a[7] = np.nan
    for sign in (1.0, -1.0):
        key = sign * a - b
        for kk in (1, 5, 499, 600):
            expect = np.sort(key[~np.isnan(key)])[::-1][kk - 1] if kk <= 499 else -np.inf
            assert scan_mod._kth_lower_bound(a, b, sign, kk) == expect
        top = scan_mod._top_positions(a, sign, 10)
        vals = np.sort(sign * a[top])
        np.testing.assert_array_equal(vals, np.sort(np.sort((sign * a)[~np.isnan(a)])[::-1][:10]))
    pos, flags = scan_mod._reaching(a, b, 1.0, 0.5)
    up = a + b >= 1.0
    down = b - a >= 0.5
    np.testing.assert_array_equal(pos, np.flatnonzero(up | down))
    np.testing.assert_array_equal(flags, (up | 2 * down)[pos])
    assert scan_mod._reaching(a, b, np.inf, np.inf)[0].size == 0


def test_query_quantization_forms_agree():
    """The bit planes are the two's complement bits of the VNNI form's integers; the residual and
    the module sums match a plain numpy quantization."""
    layout = SignLayout((13, 100, 64, 3, 70))
    rng = np.random.default_rng(28)
    y = rng.standard_normal((3, layout.num_coords))
    y[1, 13:113] = 0.0  # an all-zero module
    q8, delta, qsum, resid, rsum = scan_mod._quantize_level(y, layout, True)
    planes = scan_mod._quantize_level(y, layout, False)[0]
    u8 = q8.view(np.uint8)
    nw = planes.shape[1] // 8
    for b in range(8):
        ref = np.packbits((u8 >> b) & 1, axis=1, bitorder="little").view("<u8").reshape(3, nw)
        np.testing.assert_array_equal(planes[:, b::8], ref)
    g = scan_mod._geometry(layout)
    starts = np.asarray(layout.coord_offsets)
    pos = 64 * g.word_start[:-1][g.module_of_coord] + (np.arange(layout.num_coords) - starts[g.module_of_coord])
    q = q8[:, pos].astype(np.float64)
    assert np.abs(q).max() <= 127 and np.count_nonzero(q8) == np.count_nonzero(q)
    assert np.all(delta[1, 1] == 0) and np.all(q[1, 13:113] == 0)
    np.testing.assert_allclose(resid, y - q * delta[:, g.module_of_coord], rtol=0, atol=1e-15)
    assert np.all(np.abs(resid) <= delta[:, g.module_of_coord] / 2 * (1 + 1e-12))
    np.testing.assert_array_equal(qsum, np.add.reduceat(q, starts, axis=1))
    np.testing.assert_allclose(rsum, np.add.reduceat(np.abs(resid), starts, axis=1), rtol=1e-12)


def test_prescan_form_detection(monkeypatch):
    """VNNI only when numba compiles for this CPU; a forced target CPU gets the bit planes. The
    8-byte code loads are flagged when they can pass a row's end."""
    import numba

    monkeypatch.setattr(scan_mod, "_PRESCAN_VNNI", None)
    monkeypatch.setattr(numba.config, "CPU_NAME", "generic")
    assert scan_mod._prescan_vnni() is False
    assert scan_mod._geometry(SignLayout((64, 192, 128))).reads_past_row is False
    assert scan_mod._geometry(SignLayout((7,))).reads_past_row is True
    assert scan_mod._geometry(SignLayout((64, 64, 8))).reads_past_row is True  # a 1-byte last module
    assert scan_mod._geometry(SignLayout((64, 8, 64))).reads_past_row is False  # 8 bytes follow the small one


# ---------------------------------------------------------------------------------------------
# torch path and input checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [(1,), (13, 100, 64, 3, 512, 9, 70)])
def test_torch_path_matches_reference(k):
    torch = pytest.importorskip("torch")
    layout = SignLayout(k)
    rng = np.random.default_rng(16)
    codes, scales = random_store(layout, 130, rng)
    y = rng.standard_normal((3, layout.num_coords)).astype(np.float32)
    got = scan_scores_torch(codes, scales, y, layout, "cpu", chunk_rows=40)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and tuple(got.shape) == (3, 130)
    assert_close(got.numpy(), score_reference(codes, scales, y, layout), score_scale(scales, y, layout), rtol=1e-5)
    got_t = scan_scores_torch(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(y), layout, "cpu")
    np.testing.assert_allclose(got_t.numpy(), got.numpy(), rtol=0, atol=1e-4 * score_scale(scales, y, layout))


def test_input_errors_say_what_is_wrong():
    layout = SignLayout((13, 5))
    rng = np.random.default_rng(17)
    codes, scales = random_store(layout, 10, rng)
    y = rng.standard_normal((1, 18)).astype(np.float32)
    with pytest.raises(ConfigError, match=r"\(n, 3\)"):
        scan_scores(codes[:, :2], scales, y, layout)
    with pytest.raises(InputError, match="uint8"):
        scan_scores(codes.astype(np.int16), scales, y, layout)
    with pytest.raises(ConfigError, match="scales"):
        scan_scores(codes, scales[:, :1], y, layout)
    with pytest.raises(ConfigError, match="K"):
        scan_scores(codes, scales, y[:, :17], layout)
    bad = y.copy()
    bad[0, 3] = np.nan
    with pytest.raises(InputError, match="NaN"):
        scan_top_k(codes, scales, bad, layout, 2)
    with pytest.raises(InputError, match="outside"):
        scan_scores(codes, scales, y, layout, rows=np.array([0, 10]))
    with pytest.raises(InputError):
        scan_scores(codes, scales, y, layout, rows=np.array([[0]]))
    with pytest.raises(ConfigError):
        scan_scores(codes, scales, y, object())


def test_accepts_other_layout_objects():
    """Any object with per-module sizes ``.k`` works (e.g. eogp_index.store.codecs.SignLayout)."""

    class Other:
        k = (13, 5)

    layout = SignLayout((13, 5))
    rng = np.random.default_rng(18)
    codes, scales = random_store(layout, 10, rng)
    y = rng.standard_normal((1, 18)).astype(np.float32)
    np.testing.assert_array_equal(scan_scores(codes, scales, y, Other()), scan_scores(codes, scales, y, layout))
