"""One-bit storage: bit order, scale optimality, bytes per example."""

import math

import numpy as np
import pytest

from eogp_index.config import bytes_per_module, k_for_budget
from eogp_index.errors import ConfigError
from eogp_index.store.codecs import SignLayout, decode, encode, pack_signs, scales_of, unpack_signs


def test_bit_order_is_lsb_first_per_module_with_fresh_byte():
    layout = SignLayout((3, 9))
    x = np.array([[1.0, -1.0, 2.0, -1, -1, -1, -1, -1, -1, -1, -1, 5.0]], np.float32)
    codes = pack_signs(x, layout)
    # module 0: coords 0 and 2 positive -> bits 0 and 2 -> 0b101; module 1 starts at byte 1:
    # its coordinate 8 (the 9th) is positive -> byte 2, bit 0.
    assert codes.tolist() == [[0b101, 0, 0b1]]
    assert layout.nbytes == 3 and layout.byte_offsets == (0, 1)


def test_pack_unpack_roundtrip_and_zero_is_positive():
    rng = np.random.default_rng(0)
    layout = SignLayout((1, 7, 64, 65))
    x = rng.standard_normal((10, layout.num_coords)).astype(np.float32)
    x[0, 0] = 0.0
    signs = unpack_signs(pack_signs(x, layout), layout)
    assert np.array_equal(signs, np.where(x >= 0, 1.0, -1.0))


def test_fp16_scale_is_the_least_squares_optimum():
    rng = np.random.default_rng(1)
    layout = SignLayout((33,))
    x = rng.standard_normal((1, 33)).astype(np.float32) * 3
    s = float(scales_of(x, layout)[0, 0])
    b = np.sign(x)
    grid = np.linspace(0, 2 * s, 20001)
    errors = ((x - grid[:, None] * b) ** 2).sum(axis=1)
    assert abs(grid[errors.argmin()] - s) <= 2 * s / 20000 + abs(s - np.abs(x).mean())
    assert s == pytest.approx(np.abs(x).mean(), rel=1e-3)  # FP16 rounding only


def test_bytes_per_example_matches_the_paper_formula():
    ks = (256, 100, 2048, 1)
    layout = SignLayout(ks)
    expected = sum(math.ceil(k / 8) + 2 for k in ks)
    assert layout.bytes_per_example("1bit") == expected
    enc = encode(np.ones((4, sum(ks)), np.float32), layout, "1bit")
    assert enc.signs.nbytes + enc.scales.nbytes == 4 * expected
    assert layout.bytes_per_example("fp16") == 2 * sum(ks)
    assert bytes_per_module(2048, "1bit") == 258  # the paper's Table 4 figure per module


def test_budget_gives_largest_fitting_k():
    k = k_for_budget(12, num_modules=48, precision="1bit")  # GPT-2's 48 modules at 12 KB
    assert 48 * (math.ceil(k / 8) + 2) <= 12 * 1024 < 48 * (math.ceil((k + 8) / 8) + 2)
    with pytest.raises(ConfigError, match="too few"):
        k_for_budget(0.05, num_modules=48, precision="1bit")


def test_decode_is_scale_times_sign():
    layout = SignLayout((5, 3))
    x = np.array([[1, -2, 3, -4, 5, 0.5, 0.5, -0.5]], np.float32)
    approx = decode(encode(x, layout, "1bit"), layout)
    np.testing.assert_allclose(approx[0, :5], np.sign(x[0, :5]) * 3.0, rtol=1e-3)
    np.testing.assert_allclose(approx[0, 5:], np.sign(x[0, 5:]) * 0.5, rtol=1e-3)
