"""Row planning and byte ranges: ids checked against their heads, distinct rows per head, rows merged into ranges.

See the package docstring for the vocabulary (``ids``, ``heads``/``order``, ``uniq``, ``inverse``, ``pairs``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ._common import _heads, _ids_2d, _int64_1d, readonly, word_shift
from ._sort import _minus_ones, _sort_positions
from ..errors import InvalidArgument


@njit(cache=True, nogil=True)
def _check_ranges(offsets, lengths, limit):
    for i in range(offsets.size):
        o = offsets[i]
        n = lengths[i]
        # Written so that no sum can overflow: o and n are both checked against limit before subtracting. (o > limit
        # is redundant: limit - o is then negative and n is not; it keeps the bound whole to the reader.)
        if o < 0 or n < 0 or o > limit or n > limit - o:
            return i
    return -1


def check_ranges(offsets: np.ndarray, lengths: np.ndarray, limit: int) -> int:
    """Index of the first range ``[offset, offset + length)`` not inside ``[0, limit)``, or -1 if all are."""
    offsets = _int64_1d(offsets, "offsets")
    lengths = _int64_1d(lengths, "lengths")
    if offsets.size != lengths.size:
        raise InvalidArgument(f"offsets and lengths must have the same size, got {offsets.size} and {lengths.size}")
    return int(_check_ranges(readonly(offsets), readonly(lengths), np.int64(limit)))


@njit(cache=True, nogil=True)
def _pairs_total(pairs, limit):
    # (index of the first range outside [0, limit) or -1, the ranges' byte total): one pass, before any copy.
    total = 0
    for i in range(pairs.shape[0]):
        o = pairs[i, 0]
        n = pairs[i, 1]
        if o < 0 or n < 0 or o > limit or n > limit - o:  # (o > limit is redundant, as in _check_ranges)
            return i, 0
        total += n
    return -1, total


def check_pairs(src: np.ndarray, pairs: np.ndarray) -> tuple[int, int]:
    """``(bad, total)``: the first range of ``pairs`` outside ``src`` (or -1) and the ranges' byte total."""
    bad, total = _pairs_total(pairs, src.size)
    return int(bad), int(total)


@njit(cache=True, nogil=True)
def _plan_pieces(pairs, piece_bytes, bounds, sizes):
    # Cut the ranges of pairs into pieces in order: a range of >= piece_bytes alone, the others greedily into
    # runs of at most piece_bytes. Piece j is ranges bounds[j]:bounds[j + 1] of sizes[j] bytes; returns the count.
    R = pairs.shape[0]
    k = 0
    bounds[0] = 0
    size = 0
    for i in range(R):
        n = pairs[i, 1]
        if n >= piece_bytes or size + n > piece_bytes:
            if i > bounds[k]:  # close the open run
                sizes[k] = size
                k += 1
                bounds[k] = i
            size = 0
        size += n
        if n >= piece_bytes:
            sizes[k] = size
            k += 1
            bounds[k] = i + 1
            size = 0
    if bounds[k] < R:
        sizes[k] = size
        k += 1
        bounds[k] = R
    return k


def plan_pieces(pairs: np.ndarray, total: int, piece_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut the ranges of ``pairs`` (int64 ``[R, 2]``, byte lengths summing to ``total``) into pieces, in order:
    each range of ``piece_bytes`` or more is a piece of its own, the others run together into pieces of at most
    ``piece_bytes``. Returns ``(bounds, sizes)``: piece j is ``pairs[bounds[j]:bounds[j + 1]]`` of ``sizes[j]``
    bytes (how the raw read channel streams a large reply through two fixed piece buffers)."""
    if piece_bytes <= 0:
        raise InvalidArgument(f"piece_bytes: expected > 0, got {piece_bytes}")
    # At most total // piece_bytes lone ranges; a run closed by an overflow holds more than piece_bytes together
    # with the piece after it, and every byte is in at most two such sums: fewer than 2 * total / piece_bytes.
    most = min(pairs.shape[0], 3 * (total // piece_bytes) + 3)
    bounds = np.empty(most + 1, dtype=np.int64)
    sizes = np.empty(max(most, 1), dtype=np.int64)
    k = _plan_pieces(pairs, piece_bytes, bounds, sizes)
    return bounds[:k + 1], sizes[:k]


def _pairs(offsets: np.ndarray, lengths: np.ndarray, off_name: str = "offsets") -> np.ndarray:
    offsets = _int64_1d(offsets, off_name)
    lengths = _int64_1d(lengths, "lengths")
    if offsets.size != lengths.size:
        raise InvalidArgument(f"{off_name} and lengths must have the same size, got {offsets.size} and {lengths.size}")
    return np.stack((offsets, lengths), axis=1)


def _pairs_shift(pairs: np.ndarray, *arrays: np.ndarray) -> int:
    bits = int(np.bitwise_or.reduce(pairs, axis=None)) if pairs.size else 0
    for a in arrays:
        bits |= a.ctypes.data
    return word_shift(bits)


@njit(cache=True, nogil=True)
def _first_bad_row(ids, num_rows):
    M, H = ids.shape
    for m in range(M):
        for h in range(H):
            v = ids[m, h]
            if v < 0 or v >= num_rows[h]:
                return m * H + h
    return -1


def first_bad_row(ids: np.ndarray, num_rows: np.ndarray) -> int:
    """Flat index (``m * H + h``) of the first id outside ``[0, num_rows[h])``, or -1 if all are valid."""
    ids = _ids_2d(ids)
    num_rows = _int64_1d(num_rows, "num_rows")
    if num_rows.size != ids.shape[1]:
        raise InvalidArgument(f"num_rows: expected {ids.shape[1]} entries (one per head), got {num_rows.size}")
    return int(_first_bad_row(ids, readonly(num_rows)))


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


def plan_unique_rows(ids: np.ndarray, heads: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted distinct rows per listed head: ``(uniq, head_starts, inverse)`` (see the module docstring)."""
    ids = _ids_2d(ids)
    heads = _heads(heads, ids.shape[1])
    uniq, u, head_starts, inverse = _plan_unique_rows(ids, heads)
    return uniq[:u], head_starts, inverse


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
        raise InvalidArgument(f"starts: expected {base_offsets.size + 1} entries (heads + 1), got {starts.size}")
    if starts.size and (starts[0] != 0 or starts[-1] != rows.size or np.any(np.diff(starts) < 0)):
        raise InvalidArgument(f"starts: expected a non-decreasing array from 0 to {rows.size}")
    if row_bytes <= 0:
        raise InvalidArgument(f"row_bytes: expected a positive byte count, got {row_bytes}")
    offsets, lengths, range_head, r = _rows_to_ranges(rows, starts, base_offsets, np.int64(row_bytes))
    return offsets[:r], lengths[:r], range_head[:r]


class ReadPlan(NamedTuple):
    """The reads of a remote lookup (see :func:`plan_reads`)."""

    pairs: np.ndarray        # int64 [R, 2]: byte (offset, length) in each head's segment, head by head
    head_rows: np.ndarray    # int64 [K + 1]: listed head j's distinct rows are positions head_rows[j]:[j + 1]
    head_ranges: np.ndarray  # int64 [K + 1]: its ranges are pairs[head_ranges[j]:head_ranges[j + 1]]
    inverse: np.ndarray      # int64 [M, H]: position of row ids[m, h] among all distinct rows (-1: not listed)


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
            raise InvalidArgument(f"base_offsets: expected {order.size} entries (one per listed head), "
                             f"got {base_offsets.size}")
        if row_bytes <= 0:
            raise InvalidArgument(f"row_bytes: expected a positive byte count, got {row_bytes}")
    pairs, r, head_rows, head_ranges, inverse = _plan_reads(ids, order, base_offsets, np.int64(row_bytes))
    return ReadPlan(pairs[:r], head_rows, head_ranges, inverse)


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
        raise InvalidArgument(f"base_offsets: expected {heads.size} entries (one per listed head), got {base_offsets.size}")
    return _direct_pairs(readonly(ids), heads, base_offsets, np.int64(row_bytes))
