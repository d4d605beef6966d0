"""Numba kernels for the hot paths: byte ranges, row planning, gathers and scatters.

Every kernel is compiled with ``cache=True`` (once per machine, loaded from the on-disk cache afterwards) and
``nogil=True`` (lookups in worker threads overlap with each other and with the caller). Compilation is lazy:
a kernel compiles the first time a path uses it, for the word size that path moves (see ``warmup`` to do it
ahead of time for deployment images). Kernels are written as explicit loops, which compile in a fraction of
the time slice assignment or ``np.argsort`` take.

Two habits make the copy loops fast:

* Positions are computed in ``uint64``. Numba wraps a negative signed index around (``a[-1]``), and the
  select that costs per element keeps LLVM from vectorising a copy whose start comes from data; an unsigned
  index needs no wraparound, and the row copy becomes a vector loop (3-4x faster on large tables).
* Bytes move as the widest word (8, 4, 2 or 1 bytes) that every offset, length and buffer address is a
  multiple of. Sources are always passed read-only and destinations writable, so each kernel has one
  signature per word size.

Each kernel has a thin Python wrapper that checks dtypes and shapes, because a Numba kernel given a wrong dtype
either recompiles silently or reads out of bounds. The kernels check values (bounds, distinct heads) in a first
pass before they move any byte and report the first offender, so a refused call writes nothing.

Row-planning vocabulary, shared with ``_engram_store``:

* ``ids`` is an ``int64 [M, H]`` array: M token positions (B x L flattened), H heads.
* ``heads`` / ``order`` is an ``int64 [K]`` list of head indices to work on, in the order their rows are laid out.
* ``uniq`` holds, for each listed head in turn, the sorted distinct row ids of that head; ``head_starts[j]`` is
  where listed head ``j`` begins in ``uniq`` (``head_starts[K] == uniq.size``).
* ``inverse[m, h]`` is the position in ``uniq`` of row ``ids[m, h]`` (``-1`` for heads not listed).
* ``pairs`` is an ``int64 [R, 2]`` array of byte ranges ``(offset, length)``: the wire form of a range read.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from llvmlite import binding as _llvm
from llvmlite import ir as _ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "check_ranges", "gather_ranges", "gather_pairs", "check_pairs", "gather_pairs_unchecked", "scatter_ranges",
    "first_bad_row", "plan_unique_rows", "rows_to_ranges", "plan_reads", "ReadPlan", "scatter_rows",
    "scatter_rows_prepared", "direct_pairs", "gather_rows_local", "RowSource", "row_source",
    "gather_rows", "word_shift", "readonly", "cache_probe", "cache_insert", "cache_fill", "warmup",
]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SHIFT = {1: 0, 2: 1, 4: 2, 8: 3}


# ---- prefetching -------------------------------------------------------------------------------------------------
#
# A gather of random rows from a large table waits on one cache and TLB miss per row; the CPU overlaps only the
# few misses its reorder window reaches. The gathers ask for the row PREFETCH_ROWS ahead to be fetched while they
# copy the current one (a hint: it never faults, whatever the address).

#: How many rows ahead the gathers prefetch (measured: 8-16 rows take a 64k-row gather from 2.6 GB of 4 KiB
#: pages from 7.6-10 ms to 6.2 ms; 32 is no better).
PREFETCH_ROWS = 16
_PREFETCH_NAME = "llvm.prefetch.p0" if _llvm.llvm_version_info[0] >= 15 else "llvm.prefetch.p0i8"


@intrinsic
def _prefetch(typingctx, arr, index):
    """Prefetch ``arr[index]`` for reading into every cache level (``llvm.prefetch``; no bounds check)."""
    if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i8p = _ir.IntType(8).as_pointer()
        i32 = _ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, _ir.FunctionType(_ir.VoidType(), [i8p, i32, i32, i32]),
                                            _PREFETCH_NAME)
        address = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)
        builder.call(fn, [address, i32(0), i32(3), i32(1)])  # read, keep in all levels, data cache
        return context.get_dummy_value()

    return types.void(arr, index), codegen


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
def _pairs_total(pairs, limit):
    # (index of the first range outside [0, limit) or -1, the ranges' byte total): one pass, before any copy.
    total = 0
    for i in range(pairs.shape[0]):
        o = pairs[i, 0]
        n = pairs[i, 1]
        if o < 0 or n < 0 or o > limit or n > limit - o:
            return i, 0
        total += n
    return -1, total


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


def check_pairs(src: np.ndarray, pairs: np.ndarray) -> tuple[int, int]:
    """``(bad, total)``: the first range of ``pairs`` outside ``src`` (or -1) and the ranges' byte total."""
    bad, total = _pairs_total(pairs, src.size)
    return int(bad), int(total)


def gather_pairs_unchecked(src: np.ndarray, pairs: np.ndarray, out: np.ndarray) -> None:
    """Gather ``pairs`` that :func:`check_pairs` accepted into ``out`` (flat bytes, exactly their total)."""
    _gather_pairs_any(src, pairs, out)


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


def readonly(a: np.ndarray) -> np.ndarray:
    """``a`` itself if read-only, else a read-only view: kernels see every source with one type."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def word_shift(bits: int) -> int:
    """log2 of the widest word (8, 4, 2 or 1 bytes) that ``bits`` (an OR of offsets and sizes) is a multiple of."""
    return 3 if bits % 8 == 0 else 2 if bits % 4 == 0 else 1 if bits % 2 == 0 else 0


def _words(a: np.ndarray, shift: int) -> np.ndarray:
    """A flat uint8 array seen as words of ``1 << shift`` bytes; a ragged tail no aligned range reaches is left out."""
    if shift == 0:
        return a
    word = 1 << shift
    return a[:a.size - a.size % word].view(_UINT[word])


def _int64_1d(a: np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.int64 or a.ndim != 1:
        raise TypeError(f"{name}: expected a 1-D int64 array, got {a.dtype} with shape {a.shape}")
    return np.ascontiguousarray(a)


def _bytes_1d(a: np.ndarray, name: str) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 1:
        raise TypeError(f"{name}: expected a 1-D uint8 array, got {getattr(a, 'dtype', type(a).__name__)} "
                        f"with shape {getattr(a, 'shape', None)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a contiguous array")
    return a


def _pairs(offsets: np.ndarray, lengths: np.ndarray, off_name: str = "offsets") -> np.ndarray:
    offsets = _int64_1d(offsets, off_name)
    lengths = _int64_1d(lengths, "lengths")
    if offsets.size != lengths.size:
        raise ValueError(f"{off_name} and lengths must have the same size, got {offsets.size} and {lengths.size}")
    return np.stack((offsets, lengths), axis=1)


def _pairs_shift(pairs: np.ndarray, *arrays: np.ndarray) -> int:
    bits = int(np.bitwise_or.reduce(pairs, axis=None)) if pairs.size else 0
    for a in arrays:
        bits |= a.ctypes.data
    return word_shift(bits)


def check_ranges(offsets: np.ndarray, lengths: np.ndarray, limit: int) -> int:
    """Index of the first range ``[offset, offset + length)`` not inside ``[0, limit)``, or -1 if all are."""
    offsets = _int64_1d(offsets, "offsets")
    lengths = _int64_1d(lengths, "lengths")
    if offsets.size != lengths.size:
        raise ValueError(f"offsets and lengths must have the same size, got {offsets.size} and {lengths.size}")
    return int(_check_ranges(readonly(offsets), readonly(lengths), np.int64(limit)))


def gather_pairs(src: np.ndarray, pairs: np.ndarray, out: np.ndarray, total: int, checked: bool = False) -> int:
    """Copy the byte ranges ``pairs`` (int64 ``[R, 2]`` of offset, length) of ``src`` back to back into ``out``.

    The segment's read path: ``total`` is the ranges' byte total (``out`` must hold it); unless ``checked`` the
    ranges are checked against ``src`` first. Returns -1, or the index of the first range outside ``src``
    (nothing is copied then).
    """
    if out.size < total:
        raise ValueError(f"out holds {out.size} bytes, the ranges total {total}")
    shift = _pairs_shift(pairs, src, out)
    return int(_gather_pairs(readonly(_words(src, shift)), readonly(pairs), np.int64(shift),
                             np.int64(-1 if checked else src.size), _words(out, shift)))


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
        raise ValueError(f"gather_ranges: out holds {out.size} bytes, the ranges total {total}")
    if gather_pairs(src, pairs, out, total, checked=ranges_checked) >= 0:
        raise ValueError("gather_ranges: a range lies outside src")
    return total


def scatter_ranges(src: np.ndarray, dst: np.ndarray, dst_offsets: np.ndarray, lengths: np.ndarray) -> int:
    """Inverse of ``gather_ranges``: split back-to-back ``src`` bytes into ``dst[dst_offsets[i]:...]``."""
    src = _bytes_1d(src, "src")
    dst = _bytes_1d(dst, "dst")
    pairs = _pairs(dst_offsets, lengths, "dst_offsets")
    if check_ranges(pairs[:, 0].copy(), pairs[:, 1].copy(), dst.size) >= 0:
        raise ValueError("scatter_ranges: a range lies outside dst")
    total = int(pairs[:, 1].sum()) if pairs.size else 0
    if src.size < total:
        raise ValueError(f"scatter_ranges: src holds {src.size} bytes, the ranges total {total}")
    if not dst.flags.writeable:
        raise ValueError("dst: expected a writable array")
    shift = _pairs_shift(pairs, src, dst)
    _scatter_pairs(readonly(_words(src, shift)), _words(dst, shift), readonly(pairs), np.int64(shift))
    return total


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
def _sort_positions(col, order, tmp, counts):
    # Fill ``order`` with the positions of ``col`` sorted by value (stable). Insertion sort for short columns,
    # else an LSD radix sort on ``col - min`` as unsigned (linear in M, which matters at L = 4096; any span
    # of int64 values, negative ones included).
    M = col.size
    if M == 0:
        return order
    lo = col[0]
    hi = col[0]
    for m in range(M):
        order[m] = m
        lo = min(lo, col[m])
        hi = max(hi, col[m])
    if M < 64:
        for i in range(1, M):
            o = order[i]
            v = col[o]
            j = i - 1
            while j >= 0 and col[order[j]] > v:
                order[j + 1] = order[j]
                j -= 1
            order[j + 1] = o
        return order
    bits = 8 if M < 2048 else 11
    mask = np.uint64((1 << bits) - 1)
    span = np.uint64(hi) - np.uint64(lo)
    base = np.uint64(lo)
    shift = np.uint64(0)
    while shift < 64 and (span >> shift) > 0:
        for d in range(counts.size):
            counts[d] = 0
        for i in range(M):
            counts[np.int64(((np.uint64(col[order[i]]) - base) >> shift) & mask) + 1] += 1
        for d in range(counts.size - 1):
            counts[d + 1] += counts[d]
        for i in range(M):
            o = order[i]
            d = np.int64(((np.uint64(col[o]) - base) >> shift) & mask)
            tmp[counts[d]] = o
            counts[d] += 1
        order, tmp = tmp, order
        shift += np.uint64(bits)
    return order


@njit(cache=True, nogil=True)
def _minus_ones(M, H):
    a = np.empty((M, H), dtype=np.int64)
    for m in range(M):
        for h in range(H):
            a[m, h] = -1
    return a


@njit(cache=True, nogil=True)
def _plan_unique_rows(ids, heads):
    # Per listed head: order the positions by row id, then walk the order to number the distinct rows.
    M, H = ids.shape
    K = heads.size
    inverse = _minus_ones(M, H)
    uniq = np.empty(M * K, dtype=np.int64)
    head_starts = np.zeros(K + 1, dtype=np.int64)
    col = np.empty(M, dtype=np.int64)
    order = np.empty(M, dtype=np.int64)
    tmp = np.empty(M, dtype=np.int64)
    counts = np.empty((1 << (8 if M < 2048 else 11)) + 1, dtype=np.int64)
    u = 0
    for j in range(K):
        h = heads[j]
        for m in range(M):
            col[m] = ids[m, h]
        sorted_pos = _sort_positions(col, order, tmp, counts)
        for i in range(M):
            m = sorted_pos[i]
            v = col[m]
            if i == 0 or v != uniq[u - 1]:
                uniq[u] = v
                u += 1
            inverse[m, h] = u - 1
        head_starts[j + 1] = u
    return uniq, u, head_starts, inverse


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
    return offsets, lengths, range_head, r


@njit(cache=True, nogil=True)
def _plan_reads(ids, order, base, row_bytes):
    # Distinct rows per listed head (sorted), merged into byte ranges in one pass: returns
    # (pairs [R, 2], head_rows [K + 1], head_ranges [K + 1], inverse [M, H]); listed head j's rows are
    # uniq positions head_rows[j]:head_rows[j + 1], its ranges pairs[head_ranges[j]:head_ranges[j + 1]].
    M, H = ids.shape
    K = order.size
    inverse = _minus_ones(M, H)
    pairs = np.empty((M * K, 2), dtype=np.int64)
    head_rows = np.zeros(K + 1, dtype=np.int64)
    head_ranges = np.zeros(K + 1, dtype=np.int64)
    col = np.empty(M, dtype=np.int64)
    pos = np.empty(M, dtype=np.int64)
    tmp = np.empty(M, dtype=np.int64)
    counts = np.empty((1 << (8 if M < 2048 else 11)) + 1, dtype=np.int64)
    u = 0
    r = 0
    for j in range(K):
        h = order[j]
        for m in range(M):
            col[m] = ids[m, h]
        sorted_pos = _sort_positions(col, pos, tmp, counts)
        first = r
        last = np.int64(-2)
        for i in range(M):
            m = sorted_pos[i]
            v = col[m]
            if i == 0 or v != last:
                if r > first and v == last + 1:
                    pairs[r - 1, 1] += row_bytes  # the next row of the current range
                else:
                    pairs[r, 0] = base[j] + v * row_bytes
                    pairs[r, 1] = row_bytes
                    r += 1
                u += 1
                last = v
            inverse[m, h] = u - 1
        head_rows[j + 1] = u
        head_ranges[j + 1] = r
    return pairs, r, head_rows, head_ranges, inverse


@njit(cache=True, nogil=True)
def _direct_pairs(ids, heads, base, row_bytes):
    # One byte range per (m, listed head) in output order, no deduplication: the reply is the [M, K, row] rows of
    # those heads (the [M, H, row] output itself when every head is listed in order). base[k]: where listed head
    # heads[k]'s table starts.
    M = ids.shape[0]
    K = heads.size
    pairs = np.empty((M * K, 2), dtype=np.int64)
    i = 0
    for m in range(M):
        for k in range(K):
            pairs[i, 0] = base[k] + ids[m, heads[k]] * row_bytes
            pairs[i, 1] = row_bytes
            i += 1
    return pairs


def direct_pairs(ids: np.ndarray, heads: np.ndarray, base_offsets: np.ndarray, row_bytes: int) -> np.ndarray:
    """The byte ranges that read the rows of ``heads`` for every position of ``ids`` (validated int64 ``[M, H]``)
    in output order: ``int64 [M * K, 2]``, row ``m * K + k`` being row ``ids[m, heads[k]]`` of the table at byte
    ``base_offsets[k]``. No deduplication: the reply is ``[M, K, row_bytes]``."""
    heads = readonly(np.ascontiguousarray(heads, dtype=np.int64))
    base_offsets = readonly(np.ascontiguousarray(base_offsets, dtype=np.int64))
    if base_offsets.shape != heads.shape:
        raise ValueError(f"base_offsets: expected {heads.size} entries (one per listed head), got {base_offsets.size}")
    return _direct_pairs(readonly(ids), heads, base_offsets, np.int64(row_bytes))


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


def _ids_2d(ids: np.ndarray) -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 2:
        raise TypeError(f"ids: expected a 2-D int64 array [M, H], got {getattr(ids, 'dtype', type(ids).__name__)} "
                        f"with shape {getattr(ids, 'shape', None)}")
    return readonly(np.ascontiguousarray(ids))


@njit(cache=True, nogil=True)
def _heads_valid(heads, num_heads):
    seen = np.zeros(num_heads, dtype=np.bool_)
    for j in range(heads.size):
        h = heads[j]
        if h < 0 or h >= num_heads or seen[h]:
            return False
        seen[h] = True
    return True


def _heads(heads: np.ndarray, num_heads: int, name: str = "heads") -> np.ndarray:
    heads = readonly(_int64_1d(heads, name))
    if not _heads_valid(heads, num_heads):
        raise ValueError(f"{name}: expected distinct head indices in [0, {num_heads}), got {heads.tolist()[:16]}")
    return heads


def _out_3d(out: np.ndarray, M: int, H: int, dtype: np.dtype) -> np.ndarray:
    if not isinstance(out, np.ndarray) or out.dtype != dtype or out.ndim != 3:
        raise TypeError(f"out: expected a 3-D {dtype} array [M, H, D], got "
                        f"{getattr(out, 'dtype', type(out).__name__)} with shape {getattr(out, 'shape', None)}")
    if out.shape[:2] != (M, H):
        raise ValueError(f"out: expected shape ({M}, {H}, D), got {out.shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out: must be a writable C-contiguous array")
    return out


def _check_row_dtype(a: np.ndarray, name: str) -> None:
    if a.dtype.itemsize not in _UINT or a.dtype.kind not in "uif":
        raise TypeError(f"{name}: expected rows of 1-, 2-, 4- or 8-byte numbers, got {a.dtype}")


def _flat_bytes(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes as a flat uint8 array (no copy)."""
    return a.reshape(-1).view(np.uint8)


def first_bad_row(ids: np.ndarray, num_rows: np.ndarray) -> int:
    """Flat index (``m * H + h``) of the first id outside ``[0, num_rows[h])``, or -1 if all are valid."""
    ids = _ids_2d(ids)
    num_rows = _int64_1d(num_rows, "num_rows")
    if num_rows.size != ids.shape[1]:
        raise ValueError(f"num_rows: expected {ids.shape[1]} entries (one per head), got {num_rows.size}")
    return int(_first_bad_row(ids, readonly(num_rows)))


def plan_unique_rows(ids: np.ndarray, heads: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted distinct rows per listed head: ``(uniq, head_starts, inverse)`` (see the module docstring)."""
    ids = _ids_2d(ids)
    heads = _heads(heads, ids.shape[1])
    uniq, u, head_starts, inverse = _plan_unique_rows(ids, heads)
    return uniq[:u], head_starts, inverse


def rows_to_ranges(rows: np.ndarray, starts: np.ndarray, base_offsets: np.ndarray,
                   row_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte ranges covering sorted distinct ``rows``, adjacent rows of one head merged into one range.

    ``rows[starts[j]:starts[j + 1]]`` are the rows of the j-th head, whose table begins at byte
    ``base_offsets[j]``. Returns ``(offsets, lengths, range_head)``; reading the ranges back to back yields
    exactly the rows in ``rows`` order.
    """
    rows = readonly(_int64_1d(rows, "rows"))
    starts = readonly(_int64_1d(starts, "starts"))
    base_offsets = readonly(_int64_1d(base_offsets, "base_offsets"))
    if starts.size != base_offsets.size + 1:
        raise ValueError(f"starts: expected {base_offsets.size + 1} entries (heads + 1), got {starts.size}")
    if starts.size and (starts[0] != 0 or starts[-1] != rows.size or np.any(np.diff(starts) < 0)):
        raise ValueError(f"starts: expected a non-decreasing array from 0 to {rows.size}")
    if row_bytes <= 0:
        raise ValueError(f"row_bytes: expected a positive byte count, got {row_bytes}")
    offsets, lengths, range_head, r = _rows_to_ranges(rows, starts, base_offsets, np.int64(row_bytes))
    return offsets[:r], lengths[:r], range_head[:r]


class ReadPlan(NamedTuple):
    """The reads of a remote lookup (see :func:`plan_reads`)."""

    pairs: np.ndarray        # int64 [R, 2]: byte (offset, length) in each head's segment, head by head
    head_rows: np.ndarray    # int64 [K + 1]: listed head j's distinct rows are positions head_rows[j]:[j + 1]
    head_ranges: np.ndarray  # int64 [K + 1]: its ranges are pairs[head_ranges[j]:head_ranges[j + 1]]
    inverse: np.ndarray      # int64 [M, H]: position of row ids[m, h] among all distinct rows (-1: not listed)


def plan_reads(ids: np.ndarray, order: np.ndarray, base_offsets: np.ndarray, row_bytes: int,
               checked: bool = False) -> ReadPlan:
    """Distinct rows of each listed head, merged into byte ranges, in one pass (the remote lookup's plan).

    ``order`` lists heads in the order their rows go out (grouped by server); ``base_offsets[j]`` is where
    head ``order[j]``'s table starts in its segment. Reading ``pairs`` back to back yields each distinct row
    once, head by head, rows ascending. ``checked=True``: the caller built ``ids`` (int64, C-contiguous,
    non-negative) and ``order`` itself; the wrapper checks nothing.
    """
    if not checked:
        ids = _ids_2d(ids)
        order = _heads(order, ids.shape[1], "order")
        base_offsets = readonly(_int64_1d(base_offsets, "base_offsets"))
        if base_offsets.size != order.size:
            raise ValueError(f"base_offsets: expected {order.size} entries (one per listed head), "
                             f"got {base_offsets.size}")
        if row_bytes <= 0:
            raise ValueError(f"row_bytes: expected a positive byte count, got {row_bytes}")
    pairs, r, head_rows, head_ranges, inverse = _plan_reads(ids, order, base_offsets, np.int64(row_bytes))
    return ReadPlan(pairs[:r], head_rows, head_ranges, inverse)


def scatter_rows(rows: np.ndarray, inverse: np.ndarray, heads: np.ndarray, row_start: int, out: np.ndarray) -> None:
    """``out[m, h] = rows[inverse[m, h] - row_start]`` for every position m and listed head h.

    ``rows`` and ``out`` share a dtype of any item size (float32, float16, raw bfloat16 bits, opaque bytes);
    the rows move as the widest words their size and alignment allow.
    """
    if not isinstance(rows, np.ndarray) or rows.ndim != 2:
        raise TypeError(f"rows: expected a 2-D array, got {getattr(rows, 'dtype', type(rows).__name__)}")
    _check_row_dtype(rows, "rows")
    inverse = _ids_2d(inverse)
    M, H = inverse.shape
    out = _out_3d(out, M, H, rows.dtype)
    heads = _heads(heads, H)
    if rows.shape[1] != out.shape[2]:
        raise ValueError(f"rows: expected {out.shape[2]} columns (embedding_dim), got {rows.shape[1]}")
    rows = np.ascontiguousarray(rows)
    row_bytes = rows.shape[1] * rows.dtype.itemsize
    bad = scatter_rows_prepared(_flat_bytes(rows), inverse, heads, int(row_start), row_bytes, _flat_bytes(out))
    if bad >= 0:
        m, h = divmod(int(bad), H)
        raise ValueError(f"inverse[{m}, {h}] = {int(inverse[m, h])} falls outside the {rows.shape[0]} rows given "
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
        raise TypeError(f"segment: expected a 1-D array, got {getattr(segment, 'dtype', type(segment).__name__)}")
    _check_row_dtype(segment, "segment")
    ids = _ids_2d(ids)
    M, H = ids.shape
    out = _out_3d(out, M, H, segment.dtype)
    heads = _heads(heads, H)
    base_elems = _int64_1d(base_elems, "base_elems")
    if base_elems.size != H:
        raise ValueError(f"base_elems: expected {H} entries (one per head), got {base_elems.size}")
    if dim != out.shape[2]:
        raise ValueError(f"dim: expected {out.shape[2]} (out's last axis), got {dim}")
    itemsize = segment.dtype.itemsize
    source = row_source(_flat_bytes(segment), base_elems * itemsize, heads, dim * itemsize)
    flat = _flat_bytes(out)
    source = narrower(source, word_shift(flat.ctypes.data | (1 << source.shift)))
    bad = gather_rows(source, ids, flat)
    if bad >= 0:
        m, h = divmod(int(bad), H)
        raise ValueError(f"gather_rows_local: row ids[{m}, {h}] = {int(ids[m, h])} lies outside the mapped segment")


# ---- the hot-row cache --------------------------------------------------------------------------------------
#
# A direct-mapped cache of rows: ``cache_keys[slot]`` holds the key (head << 40 | row) of the row stored in
# ``cache_rows[slot]`` (rows seen as words), -1 when empty. A key's slot comes from a multiplicative hash, so
# hot rows of a Zipfian stream rarely evict each other.

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True, nogil=True)
def _slot(key, n_slots):
    return np.int64((np.uint64(key) * _GOLDEN) >> np.uint64(20)) % n_slots


@njit(cache=True, nogil=True)
def _cache_probe(keys, cache_keys, cache_rows, out_rows):
    hits = 0
    hit = np.zeros(keys.size, dtype=np.bool_)
    n = cache_keys.size
    W = cache_rows.shape[1]
    for i in range(keys.size):
        s = _slot(keys[i], n)
        if cache_keys[s] == keys[i]:
            for w in range(W):
                out_rows[i, w] = cache_rows[s, w]
            hit[i] = True
            hits += 1
    return hit, hits


@njit(cache=True, nogil=True)
def _cache_insert(keys, rows, cache_keys, cache_rows):
    n = cache_keys.size
    W = cache_rows.shape[1]
    for i in range(keys.size):
        s = _slot(keys[i], n)
        cache_keys[s] = keys[i]
        for w in range(W):
            cache_rows[s, w] = rows[i, w]


@njit(cache=True, nogil=True)
def _cache_fill(keys, positions, rows, out_rows, cache_keys, cache_rows):
    n = cache_keys.size
    W = cache_rows.shape[1]
    for i in range(positions.size):
        p = positions[i]
        s = _slot(keys[p], n)
        cache_keys[s] = keys[p]
        for w in range(W):
            v = rows[i, w]
            out_rows[p, w] = v
            cache_rows[s, w] = v


def cache_fill(keys: np.ndarray, positions: np.ndarray, rows: np.ndarray, out_rows: np.ndarray,
               cache_keys: np.ndarray, cache_rows: np.ndarray) -> None:
    """``out_rows[positions[i]] = rows[i]`` and cache each row under ``keys[positions[i]]``, in one pass."""
    keys = _int64_1d(keys, "keys")
    positions = _int64_1d(positions, "positions")
    if rows.shape[0] != positions.size or rows.shape[1:] != cache_rows.shape[1:] or rows.dtype != cache_rows.dtype \
            or out_rows.shape[1:] != cache_rows.shape[1:] or out_rows.dtype != cache_rows.dtype:
        raise ValueError(f"rows / out_rows: expected rows like the cache's {cache_rows.shape[1:]} {cache_rows.dtype}, "
                         f"got {rows.shape} {rows.dtype} and {out_rows.shape} {out_rows.dtype}")
    if positions.size and (positions.min() < 0 or positions.max() >= min(keys.size, out_rows.shape[0])):
        raise ValueError("positions: an index lies outside keys or out_rows")
    _cache_fill(readonly(keys), readonly(positions), readonly(rows), out_rows, cache_keys, cache_rows)


def cache_probe(keys: np.ndarray, cache_keys: np.ndarray, cache_rows: np.ndarray,
                out_rows: np.ndarray) -> tuple[np.ndarray, int]:
    """Copy the cached rows of ``keys`` into ``out_rows``; returns (hit mask, hit count)."""
    keys = _int64_1d(keys, "keys")
    if out_rows.shape[0] != keys.size or out_rows.shape[1:] != cache_rows.shape[1:] \
            or out_rows.dtype != cache_rows.dtype:
        raise ValueError(f"out_rows: expected {keys.size} rows like the cache's {cache_rows.shape[1:]} "
                         f"{cache_rows.dtype}, got {out_rows.shape} {out_rows.dtype}")
    hit, hits = _cache_probe(readonly(keys), cache_keys, cache_rows, out_rows)
    return hit, int(hits)


def cache_insert(keys: np.ndarray, rows: np.ndarray, cache_keys: np.ndarray, cache_rows: np.ndarray) -> None:
    """Store ``rows`` under ``keys``, each in its slot (replacing whatever was there)."""
    keys = _int64_1d(keys, "keys")
    if rows.shape[0] != keys.size or rows.shape[1:] != cache_rows.shape[1:] or rows.dtype != cache_rows.dtype:
        raise ValueError(f"rows: expected {keys.size} rows like the cache's {cache_rows.shape[1:]} "
                         f"{cache_rows.dtype}, got {rows.shape} {rows.dtype}")
    _cache_insert(readonly(keys), readonly(rows), cache_keys, cache_rows)


# ---- compilation ------------------------------------------------------------------------------------------------

def warmup(word_sizes: tuple[int, ...] = (8, 4, 2, 1), cache: bool = True) -> None:
    """Compile (or load from the on-disk cache) the kernels of every path, for every word size given.

    Nothing needs this: kernels compile on first use. It is for deployment images and CI, so the first real
    call of any path pays nothing (``python -m engram_store.warmup``). ``cache=False`` skips the hot-row cache.
    """
    ids = np.array([[0, 1], [1, 1]], dtype=np.int64)
    heads = np.array([0, 1], dtype=np.int64)
    first_bad_row(ids, np.array([2, 2], dtype=np.int64))
    check_ranges(np.zeros(1, np.int64), np.zeros(1, np.int64), 1)
    uniq, starts, inverse = plan_unique_rows(ids, heads)
    rows_to_ranges(uniq, starts, np.zeros(2, dtype=np.int64), 8)
    plan = plan_reads(ids, heads, np.zeros(2, dtype=np.int64), 8)
    direct_pairs(ids, heads, np.zeros(2, dtype=np.int64), 8)
    for word in word_sizes:
        segment = np.zeros(64 * word, dtype=np.uint8)
        out = np.zeros(4 * word, dtype=np.uint8)
        pairs = np.array([[0, word], [8 * word, word]], dtype=np.int64)
        gather_pairs(segment, pairs, out, 2 * word)
        check_pairs(readonly(segment), pairs)  # the raw read server's pairs are writable
        gather_pairs_unchecked(readonly(segment), pairs, out[:2 * word])
        scatter_ranges(out, segment, pairs[:, 0].copy(), pairs[:, 1].copy())
        source = row_source(segment, np.array([0, 16 * word], dtype=np.int64), heads, word)
        gather_rows(source, ids, np.zeros(4 * word, dtype=np.uint8))
        scatter_rows_prepared(out, plan.inverse, heads, 0, word, np.zeros(4 * word, dtype=np.uint8))
        if cache:
            cache_keys = np.full(8, -1, dtype=np.int64)
            cache_rows = np.zeros((8, 2), dtype=_UINT[word])
            got = np.zeros((2, 2), dtype=_UINT[word])
            keys = np.arange(2, dtype=np.int64)
            cache_probe(keys, cache_keys, cache_rows, got)
            cache_insert(keys, got, cache_keys, cache_rows)
            cache_fill(keys, keys, got, np.empty_like(got), cache_keys, cache_rows)
