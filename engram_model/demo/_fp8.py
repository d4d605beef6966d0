"""FP8 rows with float32 block scales, in NumPy: an opaque row format for ``row_format="bytes"`` tables.

A row of ``row_bytes = values + 4 * values / block`` bytes holds ``values`` float8 e4m3fn codes followed by one
float32 scale per block of ``block`` values (:data:`FP8_ROWS_F32_SCALES`: 256 values in two blocks of 128, 264
bytes). Store such tables in an ``EngramStore`` with ``row_format="bytes"`` and ``embedding_dim=row_bytes``;
:func:`dequantize_fp8_rows_f32_scales` turns looked-up rows into float32, :func:`quantize_fp8_rows_f32_scales`
makes them from float32.

This is **not** the row format of DeepSeek-V4.1's Engram tables, which are also 264 bytes for 256 values but
carry one e8m0 (power-of-two) scale byte per 32 values: see :func:`engram_model.v41.decode_fp8_rows`. The two
read each other's bytes as garbage, hence the explicit names.

e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal; no infinities; codes
0x7F and 0xFF are NaN; the largest finite value is 448.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engram_store.errors import InvalidArgument, InvalidType, is_int

from .._rows_format import E4M3_MAX, E4M3_TABLE, nearest_e4m3


@dataclass(frozen=True)
class FP8RowFormatF32Scales:
    """``values`` e4m3fn codes, then one float32 scale per ``block`` values (default: 256 values, block 128)."""

    values: int = 256
    block: int = 128

    def __post_init__(self) -> None:
        for name in ("values", "block"):
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise InvalidArgument(f"FP8RowFormatF32Scales.{name}: expected a positive integer, got {v!r}")
        if self.values % self.block:
            raise InvalidArgument(f"FP8RowFormatF32Scales: values ({self.values}) must be a multiple of block "
                                  f"({self.block})")

    @property
    def blocks(self) -> int:
        return self.values // self.block

    @property
    def row_bytes(self) -> int:
        return self.values + 4 * self.blocks


#: 256 e4m3fn values and two float32 scales (blocks of 128): 264-byte rows, not DeepSeek-V4.1's (see above).
FP8_ROWS_F32_SCALES = FP8RowFormatF32Scales()


def _check_rows(rows: np.ndarray, fmt: FP8RowFormatF32Scales) -> np.ndarray:
    if not isinstance(rows, np.ndarray):
        raise InvalidType(f"rows: expected a uint8 NumPy array [..., {fmt.row_bytes}], got {type(rows).__name__}")
    if rows.dtype != np.uint8:
        raise InvalidType(f"rows: expected dtype uint8 (opaque rows), got {rows.dtype}")
    if rows.ndim < 1 or rows.shape[-1] != fmt.row_bytes:
        raise InvalidArgument(f"rows: expected a last axis of {fmt.row_bytes} bytes ({fmt.values} FP8 values + "
                              f"{fmt.blocks} float32 scales), got shape {rows.shape}")
    return np.ascontiguousarray(rows)


def dequantize_fp8_rows_f32_scales(rows: np.ndarray, fmt: FP8RowFormatF32Scales = FP8_ROWS_F32_SCALES) -> np.ndarray:
    """float32 ``[..., values]`` from FP8-plus-scale rows ``uint8 [..., row_bytes]`` (e.g. an EngramStore lookup)."""
    rows = _check_rows(rows, fmt)
    lead = rows.shape[:-1]
    flat = rows.reshape(-1, fmt.row_bytes)
    values = E4M3_TABLE[flat[:, :fmt.values]].reshape(-1, fmt.blocks, fmt.block)
    scales = np.ascontiguousarray(flat[:, fmt.values:]).view("<f4").reshape(-1, fmt.blocks, 1)
    return (values * scales).reshape(*lead, fmt.values)


def quantize_fp8_rows_f32_scales(values: np.ndarray, fmt: FP8RowFormatF32Scales = FP8_ROWS_F32_SCALES) -> np.ndarray:
    """FP8-plus-scale rows ``uint8 [..., row_bytes]`` from float32 ``[..., values]``.

    Each block's scale is its largest magnitude / 448 (1 for an all-zero block), and each value is rounded to
    the nearest e4m3fn value (ties to even).
    """
    if not isinstance(values, np.ndarray):
        raise InvalidType(f"values: expected a float NumPy array [..., {fmt.values}], got {type(values).__name__}")
    if values.dtype.kind != "f":
        raise InvalidType(f"values: expected a floating-point dtype, got {values.dtype}")
    if values.ndim < 1 or values.shape[-1] != fmt.values:
        raise InvalidArgument(f"values: expected a last axis of {fmt.values}, got shape {values.shape}")
    if not np.isfinite(values).all():
        raise InvalidArgument("values: NaN or infinity cannot be quantised to e4m3fn rows")
    lead = values.shape[:-1]
    blocks = values.astype(np.float64).reshape(-1, fmt.blocks, fmt.block)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    scales = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    scaled = blocks / scales.astype(np.float64)
    codes = nearest_e4m3(np.abs(scaled)) | np.where(scaled < 0, 0x80, 0).astype(np.uint8)
    out = np.empty((blocks.shape[0], fmt.row_bytes), dtype=np.uint8)
    out[:, :fmt.values] = codes.reshape(-1, fmt.values)
    out[:, fmt.values:] = scales.reshape(-1, fmt.blocks).astype("<f4").view(np.uint8)
    return out.reshape(*lead, fmt.row_bytes)
