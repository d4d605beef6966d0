"""DeepSeek-V4.1's FP8 table rows: ``head_dim`` e4m3fn codes, then one e8m0 scale byte per 32 values.

The checkpoint stores ``layers.{L}.engram.embed.weight`` (float8 e4m3fn ``[rows, head_dim]``) and
``embed.scale`` (float8 e8m0 ``[rows, head_dim / 32]``); serving packs each row's codes and scale bytes
together, 264 bytes for head_dim 256. A value decodes to ``bf16(e4m3 * 2^(scale_byte - 127))``: the product is
exact in float32 (4 significant bits), so the bf16 rounding only bites below bf16's normal range, and products
of 2^128 and above overflow to infinity, as in the reference.

Decoding goes through one float32 table of every ``[scale byte, code]`` pair (256 KiB, built once), in a Numba
kernel (:func:`engram_model.v41._kernels.decode_rows`; the same table serves the fused gather of
:class:`engram_model.v41.V41Engram`). e8m0 byte 255 and e4m3 codes 0x7F/0xFF are NaN: rows holding them are
refused, naming the row.

These are not the float32-block-scale rows of :func:`engram_model.dequantize_fp8_rows_f32_scales`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engram_store.errors import InvalidArgument, InvalidType

from .._rows_format import E4M3_MAX, E4M3_TABLE, RowFormat, nearest_e4m3
from .._rows_format import round_bf16  # noqa: F401 (the V4.1 modules import it from here)
from . import _kernels
from ._config import FP8_BLOCK

#: e8m0 bias: scale byte s stands for 2^(s - 127); 255 is NaN.
E8M0_BIAS = 127


def _decode_table() -> np.ndarray:
    """float32 [256 scale bytes, 256 codes]: ``bf16(e4m3(code) * 2^(scale - 127))``; NaN for NaN inputs."""
    scales = np.ldexp(1.0, np.arange(256) - E8M0_BIAS)
    scales[255] = np.nan
    with np.errstate(over="ignore", invalid="ignore"):
        exact = (scales[:, None] * E4M3_TABLE[None, :].astype(np.float64)).astype(np.float32)  # exact or inf
    table = round_bf16(exact)
    table.flags.writeable = False
    return table


DECODE_TABLE = _decode_table()


#: The bf16 bits a NaN product gives in the engines' lookup (fp32 -> bf16 conversion of a NaN).
BF16_NAN = 0x7FFF


def _engine_bf16_table() -> np.ndarray:
    """uint16 [256 scale bytes, 256 codes]: the bf16 bits vLLM's lookup gives, ``bf16(float32(e4m3(code)) *
    float32 from the bits scale_byte << 23)``, rounded to nearest even. Unlike :data:`DECODE_TABLE`, scale byte 0
    is +0.0 and 255 is +infinity (the bits are the float32's exponent field), and NaN products are kept (BF16_NAN),
    not refused: the engines' gathers pass what the table holds."""
    scales = (np.arange(256, dtype=np.uint32) << 23).view(np.float32).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        exact = scales[:, None] * E4M3_TABLE[None, :].astype(np.float64)  # exact: a power of two times e4m3
        product = exact.astype(np.float32)                                   # one rounding, as fp32 multiply
    bits = product.view(np.uint32).astype(np.uint64)
    table = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16)
    table[np.isnan(product)] = BF16_NAN
    table.flags.writeable = False
    return table


ENGINE_BF16_TABLE = _engine_bf16_table()


def head_dim_of(row_bytes: int, name: str = "rows") -> int:
    """``head_dim`` of a packed row of ``row_bytes`` bytes (``row_bytes = head_dim * 33 / 32``)."""
    return RowFormat.blocks_of(row_bytes, FP8_BLOCK, name).values


def bad_row_message(name: str, rows: np.ndarray, flat_index: int, lead_shape: tuple[int, ...]) -> str:
    """Why row ``flat_index`` of ``rows`` (viewed ``[N, row_bytes]``) was refused, naming it by its index."""
    row = rows.reshape(-1, rows.shape[-1])[flat_index]
    head_dim = head_dim_of(rows.shape[-1])
    where = f" row {[int(i) for i in np.unravel_index(flat_index, lead_shape)]}" if lead_shape else ""
    scales = row[head_dim:]
    if (scales == 255).any():
        what = f"scale byte 255 (e8m0 NaN) in block {int(np.flatnonzero(scales == 255)[0])}"
    else:
        j = int(np.flatnonzero((row[:head_dim] & 0x7F) == 0x7F)[0])
        what = f"e4m3 NaN code 0x{int(row[j]):02X} at value {j}"
    return f"{name}:{where} holds {what}; the table is corrupt or not V4.1 FP8 rows"


def decode_fp8_rows(rows: Any) -> np.ndarray:
    """Packed rows uint8 ``[..., head_dim + head_dim // 32]`` -> float32 ``[..., head_dim]`` (bf16-exact values)."""
    if not isinstance(rows, np.ndarray):
        raise InvalidType(f"rows: expected a uint8 NumPy array [..., row_bytes], got {type(rows).__name__}")
    if rows.dtype != np.uint8:
        raise InvalidType(f"rows: expected dtype uint8 (packed FP8 rows), got {rows.dtype}")
    if rows.ndim < 1:
        raise InvalidArgument(f"rows: expected at least one axis [..., row_bytes], got shape {rows.shape}")
    head_dim = head_dim_of(rows.shape[-1])
    lead = rows.shape[:-1]
    flat = np.ascontiguousarray(rows).reshape(-1, rows.shape[-1])
    out = np.empty((flat.shape[0], head_dim), dtype=np.float32)
    bad = _kernels.decode_rows(flat, DECODE_TABLE, head_dim, out)
    if bad >= 0:
        raise InvalidArgument(bad_row_message("rows", flat, int(bad), lead))
    return out.reshape(*lead, head_dim)


def encode_fp8_rows(values: Any) -> np.ndarray:
    """float ``[..., head_dim]`` -> packed rows uint8 ``[..., head_dim + head_dim // 32]``.

    Each block of 32 values gets the smallest power-of-two scale ``2^k`` with ``max|x| <= 448 * 2^k`` (k in
    [-127, 127]; 2^0 for an all-zero block), and each value the e4m3fn code nearest to ``x / 2^k`` (ties to the
    even code). Decoding gives back every value already on that grid; others are within e4m3's precision.
    """
    if not isinstance(values, np.ndarray):
        raise InvalidType(f"values: expected a float NumPy array [..., head_dim], got {type(values).__name__}")
    if values.dtype.kind != "f":
        raise InvalidType(f"values: expected a floating-point dtype, got {values.dtype}")
    if values.ndim < 1 or values.shape[-1] == 0 or values.shape[-1] % FP8_BLOCK:
        raise InvalidArgument(f"values: expected a last axis that is a positive multiple of {FP8_BLOCK} "
                              f"(head_dim), got shape {values.shape}")
    lead, head_dim = values.shape[:-1], values.shape[-1]
    x = values.astype(np.float64).reshape(-1, head_dim)
    finite = np.isfinite(x).all(axis=1)
    if not finite.all():
        row = int(np.flatnonzero(~finite)[0])
        where = [int(i) for i in np.unravel_index(row, lead)] if lead else []
        raise InvalidArgument(f"values: row {where} holds NaN or infinity, which e4m3 rows cannot encode")
    blocks = x.reshape(x.shape[0], -1, FP8_BLOCK)                               # (N, head_dim / 32, 32)
    amax = np.abs(blocks).max(axis=-1)                                            # (N, blocks)
    with np.errstate(divide="ignore"):
        k = np.ceil(np.log2(amax / E4M3_MAX))
    k = np.where(amax > 0, k, 0.0)
    k += amax > np.ldexp(E4M3_MAX, k.astype(np.int64))                            # fix log2's rounding, both ways
    k -= (amax > 0) & (amax <= np.ldexp(E4M3_MAX, k.astype(np.int64) - 1))
    k = np.clip(k, -E8M0_BIAS, E8M0_BIAS).astype(np.int64)
    scaled = blocks / np.ldexp(1.0, k)[..., None]
    codes = nearest_e4m3(np.abs(scaled)) | np.where(scaled < 0, 0x80, 0).astype(np.uint8)
    out = np.empty((x.shape[0], head_dim + head_dim // FP8_BLOCK), dtype=np.uint8)
    out[:, :head_dim] = codes.reshape(x.shape[0], head_dim)
    out[:, head_dim:] = (k + E8M0_BIAS).astype(np.uint8)
    return out.reshape(*lead, out.shape[-1])
