"""FP8 rows with float32 block scales (not DeepSeek-V4.1's format): the e4m3fn table bit by bit, round trips,
and use through an EngramStore."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_model import (FP8_ROWS_F32_SCALES, FP8RowFormatF32Scales, dequantize_fp8_rows_f32_scales,
                          quantize_fp8_rows_f32_scales)
from engram_model._rows_format import E4M3_TABLE
from engram_store import EngramStore, EngramStoreConfig, InvalidArgument, InvalidType


def decode_e4m3fn(code: int) -> float:
    """An independent bit-level decoder of one float8 e4m3fn code."""
    sign = -1.0 if code >> 7 else 1.0
    exponent = (code >> 3) & 0b1111
    mantissa = code & 0b111
    if exponent == 0b1111 and mantissa == 0b111:
        return math.nan
    if exponent == 0:
        return sign * math.ldexp(mantissa, -9)  # 0.mmm x 2^-6
    return sign * math.ldexp(8 + mantissa, exponent - 10)  # 1.mmm x 2^(e-7)


def test_every_code_decodes_like_the_bit_layout():
    for code in range(256):
        expected = decode_e4m3fn(code)
        if math.isnan(expected):
            assert math.isnan(E4M3_TABLE[code]), code
        else:
            assert E4M3_TABLE[code] == expected, code
    assert np.nanmax(E4M3_TABLE) == 448.0 and E4M3_TABLE[0x01] == 2.0 ** -9


def test_a_row_worked_by_hand():
    fmt = FP8RowFormatF32Scales(values=4, block=2)
    row = np.zeros(fmt.row_bytes, dtype=np.uint8)
    row[:4] = [0x38, 0xB8, 0x7E, 0x01]  # 1.0, -1.0, 448, 2^-9
    row[4:] = np.array([0.5, 2.0], dtype="<f4").view(np.uint8)
    np.testing.assert_array_equal(dequantize_fp8_rows_f32_scales(row, fmt), [0.5, -0.5, 896.0, 2.0 ** -8])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([(256, 128), (16, 4), (8, 8)]), st.floats(1e-6, 1e6))
def test_round_trip_error_is_within_e4m3_precision(seed, shape, magnitude):
    values, block = shape
    fmt = FP8RowFormatF32Scales(values=values, block=block)
    x = (np.random.default_rng(seed).standard_normal((3, 2, values)) * magnitude).astype(np.float32)
    rows = quantize_fp8_rows_f32_scales(x, fmt)
    assert rows.shape == (3, 2, fmt.row_bytes) and rows.dtype == np.uint8
    y = dequantize_fp8_rows_f32_scales(rows, fmt)
    blocks_x = x.reshape(-1, block).astype(np.float64)
    blocks_y = y.reshape(-1, block).astype(np.float64)
    amax = np.abs(blocks_x).max(axis=1, keepdims=True)
    # Normal e4m3 values are 3-bit mantissas: relative error <= 2^-4; below the normal range the step is
    # 2^-9 of the scale (amax / 448).
    bound = np.maximum(np.abs(blocks_x) * 2.0 ** -4, amax / 448 * 2.0 ** -10) * (1 + 1e-6)
    assert (np.abs(blocks_y - blocks_x) <= bound).all()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 0x7E), min_size=128, max_size=128), st.integers(-10, 10))
def test_representable_values_round_trip_exactly(codes, power):
    # Values already on the e4m3 grid, with the block's largest at 448 x 2^power, come back unchanged.
    codes = list(codes)
    codes[0] = 0x7E
    x = (E4M3_TABLE[np.array(codes)] * np.float32(2.0 ** power)).astype(np.float32)
    x[1::2] *= -1
    fmt = FP8RowFormatF32Scales(128, 128)
    y = dequantize_fp8_rows_f32_scales(quantize_fp8_rows_f32_scales(x[None, :], fmt), fmt)
    np.testing.assert_array_equal(y[0], x)


def test_bad_arguments_are_named():
    with pytest.raises(InvalidType, match="rows: expected dtype uint8"):
        dequantize_fp8_rows_f32_scales(np.zeros((2, 264), dtype=np.int8))
    with pytest.raises(InvalidArgument, match="last axis of 264 bytes"):
        dequantize_fp8_rows_f32_scales(np.zeros((2, 260), dtype=np.uint8))
    with pytest.raises(InvalidArgument, match="multiple of block"):
        FP8RowFormatF32Scales(values=100, block=64)
    with pytest.raises(InvalidArgument, match="NaN or infinity"):
        quantize_fp8_rows_f32_scales(np.full((1, 256), np.inf, dtype=np.float32))
    with pytest.raises(InvalidType, match="floating-point"):
        quantize_fp8_rows_f32_scales(np.zeros((1, 256), dtype=np.int32))


@pytest.mark.timeout(120)
def test_fp8_tables_through_an_engram_store(embedded):
    fmt = FP8_ROWS_F32_SCALES
    sizes = [101, 103]
    rng = np.random.default_rng(5)
    dense = [rng.standard_normal((n, fmt.values)).astype(np.float32) for n in sizes]
    config = EngramStoreConfig(sizes, fmt.row_bytes, row_format="bytes")
    layer = EngramStore(3, config, embedded)
    layer.populate([quantize_fp8_rows_f32_scales(t, fmt) for t in dense])
    ids = np.stack([rng.integers(0, n, size=(2, 5)) for n in sizes], axis=-1)
    rows = layer.lookup(ids)
    assert rows.shape == (2, 5, 2, 264) and rows.dtype == np.uint8
    got = dequantize_fp8_rows_f32_scales(rows)
    for h in range(2):
        expected = dequantize_fp8_rows_f32_scales(quantize_fp8_rows_f32_scales(dense[h][ids[..., h]], fmt))
        np.testing.assert_array_equal(got[:, :, h], expected)
    layer.remove_from_store()
