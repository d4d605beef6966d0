"""Gathers and scatters: byte ranges and rows moved as the widest words their offsets, sizes and addresses allow."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ._common import (
    PREFETCH_ROWS,
    _bytes_1d,
    _check_row_dtype,
    _flat_bytes,
    _heads,
    _ids_2d,
    _int64_1d,
    _out_3d,
    _prefetch,
    _words,
    readonly,
    word_shift,
)
from ._planning import _pairs, _pairs_shift, check_ranges
from ..errors import InvalidArgument, InvalidType


@njit(cache=True, nogil=True)
def _gather_pairs(src, pairs, shift, check_limit, out):
    # src, out: words of (1 << shift) bytes; pairs: int64 [R, 2] byte (offset, length). With check_limit >= 0
    # every range is checked against it first, and the first offender is returned before any byte moves.
    R = pairs.shape[0]
    if check_limit >= 0:
        for i in range(R):
            o = pairs[i, 0]
            n = pairs[i, 1]
            if o < 0 or n < 0 or o > check_limit or n > check_limit - o:
                return i
    pos = np.uint64(0)
    s = np.uint64(shift)
    for i in range(min(R, PREFETCH_ROWS)):
        _prefetch(src, np.uint64(pairs[i, 0]) >> s)
    for i in range(R):
        if i + PREFETCH_ROWS < R:
            _prefetch(src, np.uint64(pairs[i + PREFETCH_ROWS, 0]) >> s)
        o = np.uint64(pairs[i, 0]) >> s
        n = np.uint64(pairs[i, 1]) >> s
        for b in range(n):
            out[pos + np.uint64(b)] = src[o + np.uint64(b)]
        pos += n
    return -1


@njit(cache=True, nogil=True)
def _gather_pairs_any(src, pairs, out):
    # _gather_pairs on flat bytes, moving the widest words every offset, length and address allows.
    bits = np.int64(src.ctypes.data) | np.int64(out.ctypes.data)
    for i in range(pairs.shape[0]):
        bits |= pairs[i, 0] | pairs[i, 1]
    if bits % 8 == 0:
        return _gather_pairs(src[:src.size - src.size % 8].view(np.uint64), pairs, 3, -1,
                             out[:out.size - out.size % 8].view(np.uint64))
    if bits % 4 == 0:
        return _gather_pairs(src[:src.size - src.size % 4].view(np.uint32), pairs, 2, -1,
                             out[:out.size - out.size % 4].view(np.uint32))
    return _gather_pairs(src, pairs, 0, -1, out)


def gather_pairs(src: np.ndarray, pairs: np.ndarray, out: np.ndarray, total: int, checked: bool = False) -> int:
    """Copy the byte ranges ``pairs`` (int64 ``[R, 2]`` of offset, length) of ``src`` back to back into ``out``.

    The segment's read path: ``total`` is the ranges' byte total (``out`` must hold it); unless ``checked`` the
    ranges are checked against ``src`` first. Returns -1, or the index of the first range outside ``src``
    (nothing is copied then).
    """
    if out.size < total:
        raise InvalidArgument(f"out holds {out.size} bytes, the ranges total {total}")
    shift = _pairs_shift(pairs, src, out)
    return int(_gather_pairs(readonly(_words(src, shift)), readonly(pairs), np.int64(shift),
                             np.int64(-1 if checked else src.size), _words(out, shift)))


def gather_pairs_unchecked(src: np.ndarray, pairs: np.ndarray, out: np.ndarray) -> None:
    """Gather ``pairs`` that :func:`check_pairs` accepted into ``out`` (flat bytes, exactly their total)."""
    _gather_pairs_any(src, pairs, out)


def gather_ranges(src: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, out: np.ndarray,
                  ranges_checked: bool = False) -> int:
    """Copy ``src[offsets[i]:offsets[i] + lengths[i]]`` for every i, back to back, into ``out``.

    ``out`` must hold the ranges' total. The ranges are checked against ``src`` unless the caller says it
    did that already (``ranges_checked=True``, after its own :func:`check_ranges`). Returns the bytes written.
    """
    src = _bytes_1d(src, "src")
    out = _bytes_1d(out, "out")
    pairs = _pairs(offsets, lengths)
    total = int(pairs[:, 1].sum()) if pairs.size else 0
    if out.size < total:
        raise InvalidArgument(f"gather_ranges: out holds {out.size} bytes, the ranges total {total}")
    if gather_pairs(src, pairs, out, total, checked=ranges_checked) >= 0:
        raise InvalidArgument("gather_ranges: a range lies outside src")
    return total


@njit(cache=True, nogil=True)
def _scatter_pairs(src, dst, pairs, shift):
    # Inverse of _gather_pairs: back-to-back src words into dst at each pair's (offset, length), in bytes.
    pos = np.uint64(0)
    s = np.uint64(shift)
    for i in range(pairs.shape[0]):
        o = np.uint64(pairs[i, 0]) >> s
        n = np.uint64(pairs[i, 1]) >> s
        for b in range(n):
            dst[o + np.uint64(b)] = src[pos + np.uint64(b)]
        pos += n


def scatter_ranges(src: np.ndarray, dst: np.ndarray, dst_offsets: np.ndarray, lengths: np.ndarray) -> int:
    """Inverse of ``gather_ranges``: split back-to-back ``src`` bytes into ``dst[dst_offsets[i]:...]``."""
    src = _bytes_1d(src, "src")
    dst = _bytes_1d(dst, "dst")
    pairs = _pairs(dst_offsets, lengths, "dst_offsets")
    if check_ranges(pairs[:, 0].copy(), pairs[:, 1].copy(), dst.size) >= 0:
        raise InvalidArgument("scatter_ranges: a range lies outside dst")
    total = int(pairs[:, 1].sum()) if pairs.size else 0
    if src.size < total:
        raise InvalidArgument(f"scatter_ranges: src holds {src.size} bytes, the ranges total {total}")
    if not dst.flags.writeable:
        raise InvalidArgument("dst: expected a writable array")
    shift = _pairs_shift(pairs, src, dst)
    _scatter_pairs(readonly(_words(src, shift)), _words(dst, shift), readonly(pairs), np.int64(shift))
    return total


@njit(cache=True, nogil=True)
def _scatter_words(rows, inverse, heads, row_start, row_words, out):
    # rows: words of the rows back to back; out: words of [M, H, row] flattened.
    M, H = inverse.shape
    n_rows = rows.size // max(row_words, 1)
    for m in range(M):
        for j in range(heads.size):
            src = inverse[m, heads[j]] - row_start
            if src < 0 or src >= n_rows:
                return m * H + heads[j]
    W = np.uint64(row_words)
    ahead = max(1, -(-PREFETCH_ROWS // max(heads.size, 1)))  # positions ahead: about PREFETCH_ROWS rows
    for m in range(M):
        p = m + ahead
        for j in range(heads.size):
            h = heads[j]
            if p < M:
                _prefetch(rows, np.uint64(inverse[p, heads[j]] - row_start) * W)
            s = np.uint64(inverse[m, h] - row_start) * W
            d = np.uint64(m * H + h) * W
            for w in range(row_words):
                out[d + np.uint64(w)] = rows[s + np.uint64(w)]
    return -1


@njit(cache=True, nogil=True)
def _scatter_rows(rows, inverse, heads, row_start, row_bytes, out):
    # rows, out: flat bytes. The rows move as the widest words that the row size and both addresses allow.
    bits = np.int64(rows.ctypes.data) | np.int64(out.ctypes.data) | np.int64(row_bytes)
    if bits % 8 == 0:
        return _scatter_words(rows[:rows.size - rows.size % 8].view(np.uint64), inverse, heads, row_start,
                              row_bytes // 8, out.view(np.uint64))
    if bits % 4 == 0:
        return _scatter_words(rows[:rows.size - rows.size % 4].view(np.uint32), inverse, heads, row_start,
                              row_bytes // 4, out.view(np.uint32))
    return _scatter_words(rows, inverse, heads, row_start, row_bytes, out)


def scatter_rows(rows: np.ndarray, inverse: np.ndarray, heads: np.ndarray, row_start: int, out: np.ndarray) -> None:
    """``out[m, h] = rows[inverse[m, h] - row_start]`` for every position m and listed head h.

    ``rows`` and ``out`` share a dtype of any item size (float32, float16, raw bfloat16 bits, opaque bytes);
    the rows move as the widest words their size and alignment allow.
    """
    if not isinstance(rows, np.ndarray) or rows.ndim != 2:
        raise InvalidType(f"rows: expected a 2-D array, got {getattr(rows, 'dtype', type(rows).__name__)}")
    _check_row_dtype(rows, "rows")
    inverse = _ids_2d(inverse)
    M, H = inverse.shape
    out = _out_3d(out, M, H, rows.dtype)
    heads = _heads(heads, H)
    if rows.shape[1] != out.shape[2]:
        raise InvalidArgument(f"rows: expected {out.shape[2]} columns (embedding_dim), got {rows.shape[1]}")
    rows = np.ascontiguousarray(rows)
    row_bytes = rows.shape[1] * rows.dtype.itemsize
    bad = scatter_rows_prepared(_flat_bytes(rows), inverse, heads, int(row_start), row_bytes, _flat_bytes(out))
    if bad >= 0:
        m, h = divmod(int(bad), H)
        raise InvalidArgument(f"inverse[{m}, {h}] = {int(inverse[m, h])} falls outside the {rows.shape[0]} rows given "
                         f"(starting at {row_start})")


def scatter_rows_prepared(rows: np.ndarray, inverse: np.ndarray, heads: np.ndarray, row_start: int,
                          row_bytes: int, out: np.ndarray) -> int:
    """:func:`scatter_rows` on flat bytes (``rows``: received rows back to back, read-only; ``out``: a writable
    ``[M, H, row_bytes]`` flattened) for a caller that validated ``inverse`` and ``heads`` (read-only int64).
    Returns -1, or the flat index of a row that ``rows`` does not hold (nothing moved)."""
    return int(_scatter_rows(readonly(rows), readonly(inverse), readonly(heads), row_start, row_bytes, out))


class RowSource(NamedTuple):
    """Tables in one mapped segment, ready for :func:`gather_rows` (built once per placement)."""

    words: np.ndarray   # the segment (read-only) as words of 1 << shift bytes
    base: np.ndarray    # int64 [H]: where each head's table starts, in words (0 for heads not in this segment)
    heads: np.ndarray   # int64 [K]: the heads whose tables are here
    row_words: int      # words per row
    shift: int          # log2 of the word size


def row_source(segment: np.ndarray, base_bytes: np.ndarray, heads: np.ndarray, row_bytes: int) -> RowSource:
    """A :class:`RowSource` over ``segment`` (flat uint8) whose listed heads start at ``base_bytes[h]``.

    The word size is the widest that the row size, the table offsets and the segment address allow; an output
    buffer whose address is not a multiple of it is read through a narrower source (see :func:`gather_rows`).
    """
    segment = _bytes_1d(segment, "segment")
    base_bytes = _int64_1d(base_bytes, "base_bytes")
    heads = _int64_1d(heads, "heads")
    bits = row_bytes | segment.ctypes.data
    for h in heads.tolist():
        bits |= int(base_bytes[h])
    shift = word_shift(bits)
    return RowSource(readonly(_words(segment, shift)), readonly(base_bytes >> shift), readonly(heads),
                     row_bytes >> shift, shift)


def narrower(source: RowSource, shift: int) -> RowSource:
    """The same tables seen as narrower words (for an output buffer aligned to fewer bytes)."""
    if shift >= source.shift:
        return source
    flat = source.words.view(np.uint8)
    return RowSource(readonly(_words(flat, shift)), readonly(source.base << (source.shift - shift)), source.heads,
                     source.row_words << (source.shift - shift), shift)


@njit(cache=True, nogil=True)
def _gather_rows(src, base, ids, heads, row_words, m_lo, m_hi, check, out):
    # src: a mapped segment seen as words; base[h]: where head h's table starts in src (words); out: words of
    # [M, H, row] flattened. Rows m_lo..m_hi of ids, listed heads only. With check, a row outside src is
    # reported (flat index m * H + h) before anything moves.
    H = ids.shape[1]
    W = np.uint64(row_words)
    if check:
        limit = src.size - row_words
        for m in range(m_lo, m_hi):
            for j in range(heads.size):
                h = heads[j]
                v = ids[m, h]
                if v < 0 or base[h] < 0 or v > (limit - base[h]) // max(row_words, 1):
                    return m * H + h
    ahead = max(1, -(-PREFETCH_ROWS // max(heads.size, 1)))  # positions ahead: about PREFETCH_ROWS rows
    for m in range(m_lo, min(m_hi, m_lo + ahead)):
        for j in range(heads.size):
            h = heads[j]
            _prefetch(src, np.uint64(base[h]) + np.uint64(ids[m, h]) * W)
    for m in range(m_lo, m_hi):
        p = m + ahead
        for j in range(heads.size):
            h = heads[j]
            if p < m_hi:
                _prefetch(src, np.uint64(base[heads[j]]) + np.uint64(ids[p, heads[j]]) * W)
            s = np.uint64(base[h]) + np.uint64(ids[m, h]) * W
            d = np.uint64(m * H + h) * W
            for w in range(row_words):
                out[d + np.uint64(w)] = src[s + np.uint64(w)]
    return -1


def gather_rows(source: RowSource, ids: np.ndarray, out: np.ndarray, m_lo: int = 0, m_hi: int = -1,
                check: bool = True) -> int:
    """``out[m, h] = row ids[m, h] of head h`` for positions ``m_lo..m_hi`` and every head of ``source``.

    ``ids``: validated int64 ``[M, H]`` (C-contiguous, in each head's range); ``out``: the flat bytes of a
    writable ``[M, H, row_bytes]`` buffer, aligned to the source's word (see :func:`narrower`). With ``check``
    a row outside the mapped segment is refused before anything moves. Returns -1 or that row's flat index.
    """
    if m_hi < 0:
        m_hi = ids.shape[0]
    return int(_gather_rows(source.words, source.base, readonly(ids), source.heads, np.int64(source.row_words),
                            np.int64(m_lo), np.int64(m_hi), check, _words(out, source.shift)))


def gather_rows_local(segment: np.ndarray, base_elems: np.ndarray, ids: np.ndarray, heads: np.ndarray, dim: int,
                      out: np.ndarray) -> None:
    """``out[m, h] = segment[base_elems[h] + ids[m, h] * dim : ... + dim]`` for every m and listed head h.

    ``segment`` is a mapped segment seen as items of ``out``'s dtype; ``ids`` must already be checked against
    each head's row count (``first_bad_row``); a row outside the segment is refused before anything moves.
    """
    if not isinstance(segment, np.ndarray) or segment.ndim != 1:
        raise InvalidType(f"segment: expected a 1-D array, got {getattr(segment, 'dtype', type(segment).__name__)}")
    _check_row_dtype(segment, "segment")
    ids = _ids_2d(ids)
    M, H = ids.shape
    out = _out_3d(out, M, H, segment.dtype)
    heads = _heads(heads, H)
    base_elems = _int64_1d(base_elems, "base_elems")
    if base_elems.size != H:
        raise InvalidArgument(f"base_elems: expected {H} entries (one per head), got {base_elems.size}")
    if dim != out.shape[2]:
        raise InvalidArgument(f"dim: expected {out.shape[2]} (out's last axis), got {dim}")
    itemsize = segment.dtype.itemsize
    source = row_source(_flat_bytes(segment), base_elems * itemsize, heads, dim * itemsize)
    flat = _flat_bytes(out)
    source = narrower(source, word_shift(flat.ctypes.data | (1 << source.shift)))
    bad = gather_rows(source, ids, flat)
    if bad >= 0:
        m, h = divmod(int(bad), H)
        raise InvalidArgument(f"gather_rows_local: row ids[{m}, {h}] = {int(ids[m, h])} lies outside the mapped segment")
