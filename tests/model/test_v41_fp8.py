"""V4.1 FP8 rows (e4m3 codes + e8m0 scale bytes per 32 values): every (scale, code) pair against a bit-level
decoder, the row layout, encode/decode round trips, and refusals that name the row."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_model.v41 import decode_fp8_rows, encode_fp8_rows
from engram_store import InvalidArgument, InvalidType


def e4m3(code: int) -> float:
    """One float8 e4m3fn code, from its bits."""
    sign = -1.0 if code >> 7 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * math.ldexp(mantissa, -9)
    return sign * math.ldexp(8 + mantissa, exponent - 10)


def bf16(v: float) -> float:
    """Round an exactly known value to bfloat16, ties to even: 8 significant bits, subnormals below 2^-126."""
    if v == 0 or math.isnan(v):
        return v
    exponent = max(math.frexp(abs(v))[1] - 1, -126)
    quantum = math.ldexp(1.0, exponent - 7)
    r = round(v / quantum) * quantum  # round() ties to even; v / quantum is exact
    return math.copysign(math.inf, v) if abs(r) >= math.ldexp(1.0, 128) else r


def reference_decode(rows: np.ndarray) -> np.ndarray:
    head_dim = rows.shape[-1] // 33 * 32
    flat = rows.reshape(-1, rows.shape[-1])
    out = np.empty((flat.shape[0], head_dim), dtype=np.float32)
    for i, row in enumerate(flat):
        for j in range(head_dim):
            out[i, j] = bf16(e4m3(int(row[j])) * math.ldexp(1.0, int(row[head_dim + j // 32]) - 127))
    return out.reshape(*rows.shape[:-1], head_dim)


def test_every_scale_and_code_pair():
    scale, code = np.meshgrid(np.arange(255, dtype=np.uint8), np.arange(256, dtype=np.uint8), indexing="ij")
    ok = (code & 0x7F) != 0x7F
    scale, code = scale[ok], code[ok]
    # Rows of head_dim 32 (one scale byte each): the codes of one scale byte fill rows that share it.
    got = []
    for s in range(255):
        codes = code[scale == s]
        block = np.zeros((codes.size + 31) // 32 * 32, dtype=np.uint8)
        block[:codes.size] = codes
        r = np.concatenate([block.reshape(-1, 32), np.full((block.size // 32, 1), s, np.uint8)], axis=1)
        dec = decode_fp8_rows(r).ravel()[:codes.size]
        expected = np.array([bf16(e4m3(int(c)) * math.ldexp(1.0, s - 127)) for c in codes], dtype=np.float32)
        np.testing.assert_array_equal(dec, expected, err_msg=f"scale byte {s}")
        got.append(dec)
    table = np.concatenate(got)
    assert np.isinf(table).any() and (table[np.isfinite(table)] != 0).any()
    assert np.isinf(decode_fp8_rows(np.array([[0x7E] + [0] * 31 + [254]], np.uint8))[0, 0])  # 448 * 2^127


def test_layout_and_a_row_by_hand():
    row = np.zeros(66, dtype=np.uint8)  # head_dim 64: 64 codes, then 2 scale bytes
    row[[0, 1, 31, 32, 63]] = [0x38, 0xB8, 0x7E, 0x01, 0x40]  # 1.0, -1.0, 448, 2^-9, 2.0
    row[64:] = [127 - 3, 127 + 2]  # values 0..31 scaled by 2^-3, 32..63 by 2^2
    out = decode_fp8_rows(row)
    assert out.shape == (64,) and out.dtype == np.float32
    np.testing.assert_array_equal(out[[0, 1, 31, 32, 63]], [0.125, -0.125, 56.0, 2.0 ** -7, 8.0])
    assert (out[2:31] == 0).all()
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, size=(2, 3, 264), dtype=np.uint8)
    rows[..., :256] &= 0xF7  # no NaN codes (clears a mantissa bit)
    rows[..., 256:] = rng.integers(100, 150, size=(2, 3, 8))
    np.testing.assert_array_equal(decode_fp8_rows(rows), reference_decode(rows))
    np.testing.assert_array_equal(decode_fp8_rows(rows[:, ::2]), reference_decode(rows[:, ::2]))  # non-contiguous


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), head_dim=st.sampled_from([32, 64, 256]), magnitude=st.floats(1e-6, 1e6),
       lead=st.sampled_from([(1,), (3, 2), (5,)]))
def test_encode_decode_round_trip(seed, head_dim, magnitude, lead):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((*lead, head_dim)) * magnitude * rng.random((*lead, 1))).astype(np.float32)
    x[..., rng.integers(0, head_dim)] = 0.0
    rows = encode_fp8_rows(x)
    assert rows.shape == (*lead, head_dim + head_dim // 32) and rows.dtype == np.uint8
    y = decode_fp8_rows(rows)
    blocks_x = x.reshape(-1, 32).astype(np.float64)
    scales = np.ldexp(1.0, rows[..., head_dim:].astype(np.int64).reshape(-1, 1) - 127)
    amax = np.abs(blocks_x).max(axis=1, keepdims=True)
    nonzero = amax[:, 0] > 0
    # The smallest power-of-two scale that fits the block's largest value into e4m3's range.
    assert (amax <= 448 * scales).all() and (amax[nonzero] > 224 * scales[nonzero]).all()
    # Normal e4m3 values carry 3 mantissa bits (relative error <= 2^-4); the subnormal step is 2^-9 * scale.
    err = np.abs(y.reshape(-1, 32) - blocks_x)
    assert (err <= np.maximum(np.abs(blocks_x) * 2.0 ** -4, scales * 2.0 ** -10)).all()
    # Decoded values are on the grid: encoding them again gives them back exactly.
    np.testing.assert_array_equal(decode_fp8_rows(encode_fp8_rows(y)), y)


def test_ties_go_to_the_even_code():
    x = np.zeros(32, dtype=np.float32)
    x[:4] = [448.0, 1.0625, 1.1875, -1.0625]  # scale 2^0; 1.0625 halfway 1.0|1.125, 1.1875 halfway 1.125|1.25
    rows = encode_fp8_rows(x)
    assert rows[32] == 127
    np.testing.assert_array_equal(rows[:4], [0x7E, 0x38, 0x3A, 0xB8])
    np.testing.assert_array_equal(encode_fp8_rows(np.zeros((1, 32), np.float32))[0, 32], 127)


def test_refusals_name_the_row():
    rows = np.zeros((2, 3, 264), dtype=np.uint8)
    rows[1, 2, 256 + 5] = 255
    with pytest.raises(InvalidArgument, match=r"row \[1, 2\] holds scale byte 255 \(e8m0 NaN\) in block 5"):
        decode_fp8_rows(rows)
    rows[1, 2, 256 + 5] = 0
    rows[0, 1, 17] = 0xFF
    with pytest.raises(InvalidArgument, match=r"row \[0, 1\] holds e4m3 NaN code 0xFF at value 17"):
        decode_fp8_rows(rows)
    with pytest.raises(InvalidType, match="rows: expected dtype uint8"):
        decode_fp8_rows(rows.astype(np.int8))
    with pytest.raises(InvalidType, match="rows: expected a uint8 NumPy array"):
        decode_fp8_rows([[0] * 33])
    with pytest.raises(InvalidArgument, match="multiple of 33, e.g. 264 for head_dim 256\\), got 260"):
        decode_fp8_rows(np.zeros((1, 260), dtype=np.uint8))
    x = np.ones((2, 64), dtype=np.float32)
    x[1, 3] = np.nan
    with pytest.raises(InvalidArgument, match=r"values: row \[1\] holds NaN or infinity"):
        encode_fp8_rows(x)
    with pytest.raises(InvalidArgument, match="positive multiple of 32"):
        encode_fp8_rows(np.ones((2, 48), dtype=np.float32))
    with pytest.raises(InvalidType, match="floating-point"):
        encode_fp8_rows(np.ones((2, 32), dtype=np.int32))
