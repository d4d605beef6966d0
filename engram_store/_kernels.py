"""Numba kernels for the hot paths: byte ranges, row planning, gathers and scatters.

Every kernel is compiled with ``cache=True`` (compiled once per machine, loaded from the cache afterwards) and
``nogil=True`` (so lookups running in worker threads overlap with each other and with the caller). Each kernel has
a thin Python wrapper that checks dtypes and shapes, because a Numba kernel given a wrong dtype either recompiles
silently or reads out of bounds. The wrappers check what the kernels cannot; the kernels check nothing twice.

Row-planning vocabulary, shared with ``_engram_store``:

* ``ids`` is an ``int64 [M, H]`` array: M token positions (B x L flattened), H heads.
* ``heads`` / ``order`` is an ``int64 [K]`` list of head indices to work on, in the order their rows are laid out.
* ``uniq`` holds, for each listed head in turn, the sorted distinct row ids of that head; ``head_starts[j]`` is
  where listed head ``j`` begins in ``uniq`` (``head_starts[K] == uniq.size``).
* ``inverse[m, h]`` is the position in ``uniq`` of row ``ids[m, h]`` (``-1`` for heads not listed).
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = [
    "check_ranges", "gather_ranges", "scatter_ranges", "first_bad_row", "plan_unique_rows", "rows_to_ranges",
    "scatter_rows", "gather_rows_local", "warmup",
]


# ---- byte ranges ------------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _check_ranges(offsets, lengths, limit):
    for i in range(offsets.size):
        o = offsets[i]
        n = lengths[i]
        # Written so that no sum can overflow: o and n are both checked against limit before subtracting.
        if o < 0 or n < 0 or o > limit or n > limit - o:
            return i
    return -1


@njit(cache=True, nogil=True)
def _gather_ranges(src, offsets, lengths, out):
    pos = 0
    for i in range(offsets.size):
        o = offsets[i]
        n = lengths[i]
        out[pos:pos + n] = src[o:o + n]
        pos += n
    return pos


@njit(cache=True, nogil=True)
def _scatter_ranges(src, dst, dst_offsets, lengths):
    pos = 0
    for i in range(dst_offsets.size):
        o = dst_offsets[i]
        n = lengths[i]
        dst[o:o + n] = src[pos:pos + n]
        pos += n
    return pos


def _int64_1d(a: np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.int64 or a.ndim != 1:
        raise TypeError(f"{name}: expected a 1-D int64 array, got {a.dtype} with shape {a.shape}")
    return np.ascontiguousarray(a)


def _bytes_1d(a: np.ndarray, name: str) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 1:
        raise TypeError(f"{name}: expected a 1-D uint8 array, got {getattr(a, 'dtype', type(a).__name__)} "
                        f"with shape {getattr(a, 'shape', None)}")
    return a


def check_ranges(offsets: np.ndarray, lengths: np.ndarray, limit: int) -> int:
    """Index of the first range ``[offset, offset + length)`` not inside ``[0, limit)``, or -1 if all are."""
    offsets = _int64_1d(offsets, "offsets")
    lengths = _int64_1d(lengths, "lengths")
    if offsets.size != lengths.size:
        raise ValueError(f"offsets and lengths must have the same size, got {offsets.size} and {lengths.size}")
    return int(_check_ranges(offsets, lengths, np.int64(limit)))


def gather_ranges(src: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> int:
    """Copy ``src[offsets[i]:offsets[i] + lengths[i]]`` for every i, back to back, into ``out``.

    The ranges must already be checked against ``src`` (``check_ranges``); ``out`` must hold their total.
    Returns the number of bytes written.
    """
    src = _bytes_1d(src, "src")
    out = _bytes_1d(out, "out")
    offsets = _int64_1d(offsets, "offsets")
    lengths = _int64_1d(lengths, "lengths")
    if offsets.size != lengths.size:
        raise ValueError(f"offsets and lengths must have the same size, got {offsets.size} and {lengths.size}")
    if check_ranges(offsets, lengths, src.size) >= 0:
        raise ValueError("gather_ranges: a range lies outside src")
    total = int(lengths.sum())
    if out.size < total:
        raise ValueError(f"gather_ranges: out holds {out.size} bytes, the ranges total {total}")
    return int(_gather_ranges(src, offsets, lengths, out))


def scatter_ranges(src: np.ndarray, dst: np.ndarray, dst_offsets: np.ndarray, lengths: np.ndarray) -> int:
    """Inverse of ``gather_ranges``: split back-to-back ``src`` bytes into ``dst[dst_offsets[i]:...]``."""
    src = _bytes_1d(src, "src")
    dst = _bytes_1d(dst, "dst")
    dst_offsets = _int64_1d(dst_offsets, "dst_offsets")
    lengths = _int64_1d(lengths, "lengths")
    if dst_offsets.size != lengths.size:
        raise ValueError(f"dst_offsets and lengths must have the same size, got {dst_offsets.size} and "
                         f"{lengths.size}")
    if check_ranges(dst_offsets, lengths, dst.size) >= 0:
        raise ValueError("scatter_ranges: a range lies outside dst")
    total = int(lengths.sum())
    if src.size < total:
        raise ValueError(f"scatter_ranges: src holds {src.size} bytes, the ranges total {total}")
    return int(_scatter_ranges(src, dst, dst_offsets, lengths))


# ---- row ids ----------------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _first_bad_row(ids, num_rows):
    M, H = ids.shape
    for m in range(M):
        for h in range(H):
            v = ids[m, h]
            if v < 0 or v >= num_rows[h]:
                return m * H + h
    return -1


@njit(cache=True, nogil=True)
def _plan_unique_rows(ids, heads):
    M = ids.shape[0]
    K = heads.size
    inverse = np.full(ids.shape, -1, dtype=np.int64)
    uniq = np.empty(M * K, dtype=np.int64)
    head_starts = np.zeros(K + 1, dtype=np.int64)
    col = np.empty(M, dtype=np.int64)
    u = 0
    for j in range(K):
        h = heads[j]
        for m in range(M):
            col[m] = ids[m, h]
        order = np.argsort(col, kind="mergesort")
        last = np.int64(0)
        for i in range(M):
            m = order[i]
            v = col[m]
            if i == 0 or v != last:
                uniq[u] = v
                u += 1
                last = v
            inverse[m, h] = u - 1
        head_starts[j + 1] = u
    return uniq[:u].copy(), head_starts, inverse


@njit(cache=True, nogil=True)
def _rows_to_ranges(rows, starts, base_offsets, row_bytes):
    n = rows.size
    offsets = np.empty(n, dtype=np.int64)
    lengths = np.empty(n, dtype=np.int64)
    range_head = np.empty(n, dtype=np.int64)
    r = -1
    for j in range(starts.size - 1):
        prev = np.int64(-2)
        for i in range(starts[j], starts[j + 1]):
            row = rows[i]
            if r >= 0 and range_head[r] == j and row == prev + 1:
                lengths[r] += row_bytes
            else:
                r += 1
                offsets[r] = base_offsets[j] + row * row_bytes
                lengths[r] = row_bytes
                range_head[r] = j
            prev = row
    r += 1
    return offsets[:r].copy(), lengths[:r].copy(), range_head[:r].copy()


@njit(cache=True, nogil=True)
def _scatter_rows(rows, inverse, heads, row_start, out):
    M = out.shape[0]
    D = out.shape[2]
    for m in range(M):
        for j in range(heads.size):
            h = heads[j]
            src = inverse[m, h] - row_start
            for d in range(D):
                out[m, h, d] = rows[src, d]


@njit(cache=True, nogil=True)
def _gather_rows_local(segment, base_elems, ids, heads, dim, out):
    M = out.shape[0]
    for m in range(M):
        for j in range(heads.size):
            h = heads[j]
            start = base_elems[h] + ids[m, h] * dim
            for d in range(dim):
                out[m, h, d] = segment[start + d]


def _ids_2d(ids: np.ndarray) -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 2:
        raise TypeError(f"ids: expected a 2-D int64 array [M, H], got {getattr(ids, 'dtype', type(ids).__name__)} "
                        f"with shape {getattr(ids, 'shape', None)}")
    return np.ascontiguousarray(ids)


def _heads(heads: np.ndarray, num_heads: int, name: str = "heads") -> np.ndarray:
    heads = _int64_1d(heads, name)
    if heads.size and (heads.min() < 0 or heads.max() >= num_heads):
        raise ValueError(f"{name}: head indices must lie in [0, {num_heads}), got {heads.min()}..{heads.max()}")
    if np.unique(heads).size != heads.size:
        raise ValueError(f"{name}: head indices must be distinct")
    return heads


def _out_3d(out: np.ndarray, M: int, H: int) -> np.ndarray:
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 3:
        raise TypeError(f"out: expected a 3-D float32 array [M, H, D], got "
                        f"{getattr(out, 'dtype', type(out).__name__)} with shape {getattr(out, 'shape', None)}")
    if out.shape[:2] != (M, H):
        raise ValueError(f"out: expected shape ({M}, {H}, D), got {out.shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out: must be a writable C-contiguous array")
    return out


def first_bad_row(ids: np.ndarray, num_rows: np.ndarray) -> int:
    """Flat index (``m * H + h``) of the first id outside ``[0, num_rows[h])``, or -1 if all are valid."""
    ids = _ids_2d(ids)
    num_rows = _int64_1d(num_rows, "num_rows")
    if num_rows.size != ids.shape[1]:
        raise ValueError(f"num_rows: expected {ids.shape[1]} entries (one per head), got {num_rows.size}")
    return int(_first_bad_row(ids, num_rows))


def plan_unique_rows(ids: np.ndarray, heads: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted distinct rows per listed head: ``(uniq, head_starts, inverse)`` (see the module docstring)."""
    ids = _ids_2d(ids)
    heads = _heads(heads, ids.shape[1])
    return _plan_unique_rows(ids, heads)


def rows_to_ranges(rows: np.ndarray, starts: np.ndarray, base_offsets: np.ndarray,
                   row_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte ranges covering sorted distinct ``rows``, adjacent rows of one head merged into one range.

    ``rows[starts[j]:starts[j + 1]]`` are the rows of the j-th head, whose table begins at byte
    ``base_offsets[j]``. Returns ``(offsets, lengths, range_head)``; reading the ranges back to back yields
    exactly the rows in ``rows`` order.
    """
    rows = _int64_1d(rows, "rows")
    starts = _int64_1d(starts, "starts")
    base_offsets = _int64_1d(base_offsets, "base_offsets")
    if starts.size != base_offsets.size + 1:
        raise ValueError(f"starts: expected {base_offsets.size + 1} entries (heads + 1), got {starts.size}")
    if starts.size and (starts[0] != 0 or starts[-1] != rows.size or np.any(np.diff(starts) < 0)):
        raise ValueError(f"starts: expected a non-decreasing array from 0 to {rows.size}")
    if row_bytes <= 0:
        raise ValueError(f"row_bytes: expected a positive byte count, got {row_bytes}")
    return _rows_to_ranges(rows, starts, base_offsets, np.int64(row_bytes))


def scatter_rows(rows: np.ndarray, inverse: np.ndarray, heads: np.ndarray, row_start: int, out: np.ndarray) -> None:
    """``out[m, h] = rows[inverse[m, h] - row_start]`` for every position m and listed head h."""
    if not isinstance(rows, np.ndarray) or rows.dtype != np.float32 or rows.ndim != 2:
        raise TypeError(f"rows: expected a 2-D float32 array, got {getattr(rows, 'dtype', None)}")
    inverse = _ids_2d(inverse)
    M, H = inverse.shape
    out = _out_3d(out, M, H)
    heads = _heads(heads, H)
    if rows.shape[1] != out.shape[2]:
        raise ValueError(f"rows: expected {out.shape[2]} columns (embedding_dim), got {rows.shape[1]}")
    if M and heads.size:
        sel = inverse[:, heads] - row_start
        if sel.min() < 0 or sel.max() >= rows.shape[0]:
            raise ValueError(f"inverse: row positions {sel.min()}..{sel.max()} fall outside the {rows.shape[0]} "
                             "rows given")
    _scatter_rows(rows, inverse, heads, np.int64(row_start), out)


def gather_rows_local(segment: np.ndarray, base_elems: np.ndarray, ids: np.ndarray, heads: np.ndarray, dim: int,
                      out: np.ndarray) -> None:
    """``out[m, h] = segment[base_elems[h] + ids[m, h] * dim : ... + dim]`` for every m and listed head h.

    ``segment`` is a mapped float32 segment; ``ids`` must already be checked against each head's row count
    (``first_bad_row``), and each head's table must lie inside the segment.
    """
    if not isinstance(segment, np.ndarray) or segment.dtype != np.float32 or segment.ndim != 1:
        raise TypeError(f"segment: expected a 1-D float32 array, got {getattr(segment, 'dtype', None)}")
    ids = _ids_2d(ids)
    M, H = ids.shape
    out = _out_3d(out, M, H)
    heads = _heads(heads, H)
    base_elems = _int64_1d(base_elems, "base_elems")
    if base_elems.size != H:
        raise ValueError(f"base_elems: expected {H} entries (one per head), got {base_elems.size}")
    if dim != out.shape[2]:
        raise ValueError(f"dim: expected {out.shape[2]} (out's last axis), got {dim}")
    if M and heads.size:
        first = base_elems[heads] + ids[:, heads].min(axis=0) * dim
        last = base_elems[heads] + (ids[:, heads].max(axis=0) + 1) * dim
        if first.min() < 0 or last.max() > segment.size:
            raise ValueError("gather_rows_local: a row lies outside the mapped segment")
    _gather_rows_local(segment, base_elems, ids, heads, np.int64(dim), out)


# ---- compilation ------------------------------------------------------------------------------------------------

def warmup() -> None:
    """Compile (or load from the on-disk cache) every kernel, so the first real call pays nothing."""
    src = np.arange(64, dtype=np.uint8)
    off = np.array([0, 8], dtype=np.int64)
    ln = np.array([4, 4], dtype=np.int64)
    out = np.empty(8, dtype=np.uint8)
    check_ranges(off, ln, src.size)
    gather_ranges(src, off, ln, out)
    scatter_ranges(out, src, off, ln)
    ids = np.array([[0, 1], [1, 1]], dtype=np.int64)
    heads = np.array([0, 1], dtype=np.int64)
    first_bad_row(ids, np.array([2, 2], dtype=np.int64))
    uniq, starts, inverse = plan_unique_rows(ids, heads)
    rows_to_ranges(uniq, starts, np.zeros(2, dtype=np.int64), 8)
    rows = np.zeros((uniq.size, 2), dtype=np.float32)
    out3 = np.empty((2, 2, 2), dtype=np.float32)
    scatter_rows(rows, inverse, heads, 0, out3)
    segment = np.zeros(16, dtype=np.float32)
    gather_rows_local(segment, np.array([0, 8], dtype=np.int64), ids, heads, 2, out3)
    # Mapped segments and received frames are read-only arrays, a separate specialisation for Numba.
    src.flags.writeable = False
    segment.flags.writeable = False
    rows.flags.writeable = False
    gather_ranges(src, off, ln, out)
    scatter_ranges(src[:8], out, np.array([0], dtype=np.int64), np.array([8], dtype=np.int64))
    scatter_rows(rows, inverse, heads, 0, out3)
    gather_rows_local(segment, np.array([0, 8], dtype=np.int64), ids, heads, 2, out3)
