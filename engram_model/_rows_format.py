"""RowFormat: how one row of a model's n-gram table is stored, the description every model family shares.

A row holds ``values`` numbers, each stored as a ``codes`` item (``"e4m3"``: one float8 e4m3fn byte; ``"bf16"``:
two bytes of bfloat16 bits), and its scales are one of three kinds:

    "block"   one e8m0 byte (a power of two) per ``block`` values, after the codes, in the row itself
    "table"   one scale for the whole table: not in the rows (the checkpoint keeps it with the layer's weights)
    "none"    the codes are the values

The released tables::

    DeepSeek-V4.1           RowFormat(256, "e4m3", "block", 32)   256 codes + 8 scale bytes   264 B
    Qwen4-Exp, FP8 export   RowFormat(160, "e4m3", "table")       160 codes                   160 B
    Qwen4-Exp, bf16         RowFormat(160, "bf16")                160 bf16 values             320 B

In an :class:`~engram_store.EngramStore` a row is opaque bytes (``row_format="bytes"``, ``embedding_dim =
row_bytes``) except bf16 rows without scales, which are ``row_format="bfloat16"`` rows of ``values`` items, so a
lookup fills an engine's bf16 tensor in place (:meth:`RowFormat.store_config`). Every table kind (in-process
arrays, ``local_dir``, ``disk_dir`` and its row caches, store segments, head shards) carries any row size.

:func:`decode_rows` turns rows without block scales into float32 holding bf16 values (a table-scaled e4m3 value
is ``bf16(e4m3 * bf16(scale))``, as transformers' ``FP8Embedding`` computes it in a bf16 model); block-scaled rows
have their own decoder, :func:`engram_model.v41.decode_fp8_rows`. :meth:`RowFormat.first_bad_row` finds rows a
loader must refuse (NaN codes, e8m0 byte 255, bf16 NaN or infinity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from engram_store import EngramStoreConfig
from engram_store.errors import InvalidArgument, InvalidType, describe, is_int

#: The largest finite e4m3fn value (1 sign bit, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 is
#: subnormal; no infinities; codes 0x7F and 0xFF are NaN).
E4M3_MAX = 448.0


def _e4m3_table() -> np.ndarray:
    """float32 value of every e4m3fn code (index = code)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    value = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6, (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    value = sign * value
    value[(codes & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


E4M3_TABLE = _e4m3_table()
# The finite non-negative values in increasing order (codes 0x00..0x7E are already sorted by value).
_POSITIVE = E4M3_TABLE[:0x7F].astype(np.float64)


def nearest_e4m3(magnitude: np.ndarray) -> np.ndarray:
    """Codes (0..0x7E) of the e4m3fn values nearest to ``magnitude`` (>= 0, saturated), ties to the even code."""
    m = np.minimum(magnitude, E4M3_MAX)
    upper = np.clip(np.searchsorted(_POSITIVE, m, side="left"), 0, _POSITIVE.size - 1)
    lower = np.maximum(upper - 1, 0)
    d_low = m - _POSITIVE[lower]
    d_up = _POSITIVE[upper] - m
    take_upper = (d_up < d_low) | ((d_up == d_low) & (upper % 2 == 0))
    return np.where(take_upper, upper, lower).astype(np.uint8)


#: Bytes of one stored value, by code.
CODE_BYTES = {"e4m3": 1, "bf16": 2}
SCALE_KINDS = ("block", "table", "none")
#: e8m0 byte that stands for NaN.
E8M0_NAN = 255


def round_bf16(x: Any) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32; NaN stays NaN."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, rounded)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) widened exactly to float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class RowFormat:
    """The bytes of one table row (see the module docstring). Frozen and hashable."""

    values: int
    codes: str = "e4m3"
    scale: str = "none"
    # Values per e8m0 scale byte where scale == "block"; 0 otherwise.
    block: int = 0

    def __post_init__(self) -> None:
        if not is_int(self.values) or self.values < 1:
            raise InvalidArgument(f"values: expected an integer >= 1, got {describe(self.values)}")
        if self.codes not in CODE_BYTES:
            raise InvalidArgument(f"codes: expected one of {sorted(CODE_BYTES)}, got {describe(self.codes)}")
        if self.scale not in SCALE_KINDS:
            raise InvalidArgument(f"scale: expected one of {list(SCALE_KINDS)}, got {describe(self.scale)}")
        if self.codes == "bf16" and self.scale != "none":
            raise InvalidArgument(f"scale: bf16 rows carry no scales (expected 'none'), got {self.scale!r}")
        if self.scale == "block":
            if not is_int(self.block) or self.block < 1 or self.values % self.block:
                raise InvalidArgument(f"block: expected a divisor of values = {self.values} (values per scale "
                                      f"byte), got {describe(self.block)}")
        elif self.block != 0:
            raise InvalidArgument(f"block: only block scales have a block size (scale={self.scale!r}), got "
                                  f"{describe(self.block)}")
        object.__setattr__(self, "values", int(self.values))
        object.__setattr__(self, "block", int(self.block))

    @property
    def code_bytes(self) -> int:
        """Bytes of the row's codes."""
        return self.values * CODE_BYTES[self.codes]

    @property
    def scale_bytes(self) -> int:
        """Bytes of the row's own scales (block scales only; a table's scale is not in its rows)."""
        return self.values // self.block if self.scale == "block" else 0

    @property
    def row_bytes(self) -> int:
        return self.code_bytes + self.scale_bytes

    @property
    def store_row_format(self) -> str:
        """The EngramStore ``row_format`` of these rows: ``"bfloat16"`` for bf16 rows, else ``"bytes"``."""
        return "bfloat16" if self.codes == "bf16" else "bytes"

    @property
    def store_dim(self) -> int:
        """The EngramStore ``embedding_dim``: bf16 items, or bytes."""
        return self.values if self.codes == "bf16" else self.row_bytes

    @property
    def dtype(self) -> np.dtype:
        """The NumPy dtype of a row's items as the store returns them (uint16 bf16 bits, or uint8 bytes)."""
        return np.dtype(np.uint16 if self.codes == "bf16" else np.uint8)

    def store_config(self, sizes: Sequence[int]) -> EngramStoreConfig:
        """The EngramStore layout of a table of these rows, one head per entry of ``sizes``."""
        return EngramStoreConfig([int(n) for n in sizes], self.store_dim, row_format=self.store_row_format)

    @classmethod
    def blocks_of(cls, row_bytes: int, block: int, name: str = "rows") -> "RowFormat":
        """The e4m3 block-scaled format whose rows are ``row_bytes`` long (``values * (block + 1) / block``)."""
        if not is_int(row_bytes) or row_bytes <= 0 or row_bytes % (block + 1):
            raise InvalidArgument(f"{name}: expected a last axis of head_dim + head_dim // {block} bytes (a multiple "
                                  f"of {block + 1}, e.g. {256 + 256 // block} for head_dim 256), got {row_bytes}")
        return cls(row_bytes // (block + 1) * block, "e4m3", "block", block)

    def first_bad_row(self, rows: np.ndarray) -> int:
        """Index of the first row of ``rows`` (``[N, store_dim]`` of :attr:`dtype`) a table must not hold: an e4m3
        NaN code (0x7F, 0xFF), an e8m0 scale byte 255, a bf16 NaN or infinity; -1 if none."""
        if self.codes == "bf16":
            bad = ((rows & 0x7F80) == 0x7F80).any(axis=1)
        else:
            bad = ((rows[:, :self.values] & 0x7F) == 0x7F).any(axis=1)
            if self.scale == "block":
                bad |= (rows[:, self.values:] == E8M0_NAN).any(axis=1)
        hit = np.flatnonzero(bad)
        return int(hit[0]) if hit.size else -1

    def why_bad(self, row: np.ndarray) -> str:
        """What :meth:`first_bad_row` found in ``row``."""
        if self.codes == "bf16":
            j = int(np.flatnonzero((row & 0x7F80) == 0x7F80)[0])
            return f"bf16 {'infinity' if row[j] & 0x7F == 0 else 'NaN'} 0x{int(row[j]):04X} at value {j}"
        codes = np.flatnonzero((row[:self.values] & 0x7F) == 0x7F)
        if codes.size:
            return f"e4m3 NaN code 0x{int(row[codes[0]]):02X} at value {int(codes[0])}"
        return f"e8m0 scale byte 255 (NaN) in block {int(np.flatnonzero(row[self.values:] == E8M0_NAN)[0])}"

    def __str__(self) -> str:
        scales = {"block": f" + {self.scale_bytes} e8m0 scale bytes", "table": ", one scale per table",
                  "none": ""}[self.scale]
        return f"{self.values} {self.codes} values{scales} ({self.row_bytes} B)"


def decode_rows(rows: Any, fmt: RowFormat, table_scale: float | None = None) -> np.ndarray:
    """Rows of ``fmt`` (``[..., store_dim]`` as a lookup returns them) -> float32 ``[..., values]`` holding bf16
    values: bf16 rows widened, e4m3 rows of a table-scaled format ``bf16(e4m3 * bf16(table_scale))``."""
    if not isinstance(fmt, RowFormat):
        raise InvalidType(f"fmt: expected a RowFormat, got {type(fmt).__name__}")
    if fmt.scale == "block":
        raise InvalidArgument(f"fmt: {fmt} has block scales; decode them with engram_model.v41.decode_fp8_rows")
    if not isinstance(rows, np.ndarray) or rows.dtype != fmt.dtype:
        raise InvalidType(f"rows: expected a {fmt.dtype} NumPy array [..., {fmt.store_dim}] ({fmt}), got "
                          f"{getattr(rows, 'dtype', type(rows).__name__)}")
    if rows.ndim < 1 or rows.shape[-1] != fmt.store_dim:
        raise InvalidArgument(f"rows: expected a last axis of {fmt.store_dim} ({fmt}), got shape {rows.shape}")
    if fmt.codes == "bf16":
        if table_scale is not None:
            raise InvalidArgument(f"table_scale: bf16 rows have no scale, got {describe(table_scale)}")
        return bf16_bits_to_float32(rows)
    if fmt.scale == "table":
        if table_scale is None or not np.isfinite(table_scale):
            raise InvalidArgument(f"table_scale: expected the table's finite scale (weight_scale), got "
                                  f"{describe(table_scale)}")
        scale = round_bf16(np.float32(table_scale))
        return round_bf16(E4M3_TABLE[rows] * scale)
    return E4M3_TABLE[rows]
