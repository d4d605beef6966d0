"""Numba kernels for the hot paths: byte ranges, row planning, gathers and scatters.

Every kernel is compiled with ``cache=True`` (compiled once per machine, loaded from the cache afterwards) and
``nogil=True`` (so lookups running in worker threads overlap with each other and with the caller). Each kernel has
a thin Python wrapper that checks dtypes and shapes, because a Numba kernel given a wrong dtype either recompiles
silently or reads out of bounds. The wrappers check types and shapes; the kernels check values (bounds,
distinct heads) in a first pass before they move any byte, and report the first offender, so a refused call
writes nothing and a valid one pays a few microseconds at most.

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
    "scatter_rows", "gather_rows_local", "cache_probe", "cache_insert", "cache_fill", "warmup",
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
    # Offsets and lengths count items of src's dtype. An explicit loop over 4- or 8-byte words beats slice
    # assignment several times over for the short ranges of embedding rows (64 - 256 bytes).
    pos = 0
    for i in range(offsets.size):
        o = offsets[i]
        n = lengths[i]
        for b in range(n):
            out[pos + b] = src[o + b]
        pos += n
    return pos


@njit(cache=True, nogil=True)
def _scatter_ranges(src, dst, dst_offsets, lengths):
    pos = 0
    for i in range(dst_offsets.size):
        o = dst_offsets[i]
        n = lengths[i]
        for b in range(n):
            dst[o + b] = src[pos + b]
        pos += n
    return pos


@njit(cache=True, nogil=True)
def _gather_ranges_bytes(src, offsets, lengths, out):
    pos = 0
    for i in range(offsets.size):
        o = offsets[i]
        n = lengths[i]
        out[pos:pos + n] = src[o:o + n]
        pos += n
    return pos


@njit(cache=True, nogil=True)
def _scatter_ranges_bytes(src, dst, dst_offsets, lengths):
    pos = 0
    for i in range(dst_offsets.size):
        o = dst_offsets[i]
        n = lengths[i]
        dst[o:o + n] = src[pos:pos + n]
        pos += n
    return pos


def _word_size(arrays: tuple[np.ndarray, ...], offsets: np.ndarray, lengths: np.ndarray) -> int:
    """The widest word (8, 4 or 1 bytes) that every offset, length and buffer address is a multiple of."""
    if offsets.size == 0:
        return 1
    bits = int(np.bitwise_or.reduce(offsets)) | int(np.bitwise_or.reduce(lengths))
    for a in arrays:
        bits |= a.ctypes.data
    return 8 if bits % 8 == 0 else 4 if bits % 4 == 0 else 1


def _words(a: np.ndarray, word: int) -> np.ndarray:
    """``a`` (uint8) seen as words; a ragged tail, which no aligned range can reach, is left out."""
    dtype = np.uint64 if word == 8 else np.uint32
    return a[:a.size - a.size % word].view(dtype)


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


def gather_ranges(src: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, out: np.ndarray,
                  ranges_checked: bool = False) -> int:
    """Copy ``src[offsets[i]:offsets[i] + lengths[i]]`` for every i, back to back, into ``out``.

    ``out`` must hold the ranges' total. The ranges are checked against ``src`` unless the caller says it
    did that already (``ranges_checked=True``, after its own :func:`check_ranges`). Returns the bytes written.
    """
    src = _bytes_1d(src, "src")
    out = _bytes_1d(out, "out")
    offsets = _int64_1d(offsets, "offsets")
    lengths = _int64_1d(lengths, "lengths")
    if offsets.size != lengths.size:
        raise ValueError(f"offsets and lengths must have the same size, got {offsets.size} and {lengths.size}")
    if not ranges_checked and check_ranges(offsets, lengths, src.size) >= 0:
        raise ValueError("gather_ranges: a range lies outside src")
    total = int(lengths.sum())
    if out.size < total:
        raise ValueError(f"gather_ranges: out holds {out.size} bytes, the ranges total {total}")
    word = _word_size((src, out), offsets, lengths)
    if word == 1:
        return int(_gather_ranges_bytes(src, offsets, lengths, out))
    return int(_gather_ranges(_words(src, word), offsets // word, lengths // word, _words(out, word))) * word


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
    word = _word_size((src, dst), dst_offsets, lengths)
    if word == 1:
        return int(_scatter_ranges_bytes(src, dst, dst_offsets, lengths))
    return int(_scatter_ranges(_words(src, word), _words(dst, word), dst_offsets // word, lengths // word)) * word


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
    # Per head: order the positions by row id (LSD radix sort on non-negative ids: linear in M, which matters
    # at L = 4096; a comparison sort for tiny or negative input), then walk the order to number distinct rows.
    M = ids.shape[0]
    K = heads.size
    inverse = np.full(ids.shape, -1, dtype=np.int64)
    uniq = np.empty(M * K, dtype=np.int64)
    head_starts = np.zeros(K + 1, dtype=np.int64)
    col = np.empty(M, dtype=np.int64)
    order = np.empty(M, dtype=np.int64)
    tmp = np.empty(M, dtype=np.int64)
    bits = 8 if M < 2048 else 11
    buckets = 1 << bits
    counts = np.empty(buckets + 1, dtype=np.int64)
    u = 0
    for j in range(K):
        h = heads[j]
        lo = np.int64(0)
        hi = np.int64(0)
        for m in range(M):
            v = ids[m, h]
            col[m] = v
            lo = min(lo, v)
            hi = max(hi, v)
            order[m] = m
        if lo < 0 or M < 64:
            order[:] = np.argsort(col)
        else:
            shift = 0
            while shift < 63 and (hi >> shift) > 0:
                counts[:] = 0
                for i in range(M):
                    counts[((col[order[i]] >> shift) & (buckets - 1)) + 1] += 1
                for d in range(buckets):
                    counts[d + 1] += counts[d]
                for i in range(M):
                    o = order[i]
                    d = (col[o] >> shift) & (buckets - 1)
                    tmp[counts[d]] = o
                    counts[d] += 1
                order, tmp = tmp, order
                shift += bits
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
            src = inverse[m, heads[j]] - row_start
            if src < 0 or src >= rows.shape[0]:
                return m * inverse.shape[1] + heads[j]
    for m in range(M):
        for j in range(heads.size):
            h = heads[j]
            src = inverse[m, h] - row_start
            for d in range(D):
                out[m, h, d] = rows[src, d]
    return -1


@njit(cache=True, nogil=True)
def _gather_rows_local(segment, base_elems, ids, heads, dim, out):
    M = out.shape[0]
    for m in range(M):
        for j in range(heads.size):
            h = heads[j]
            v = ids[m, h]
            if v < 0 or v >= segment.size // dim:
                return m * ids.shape[1] + h
            start = base_elems[h] + v * dim
            if start < 0 or start > segment.size - dim:
                return m * ids.shape[1] + h
    for m in range(M):
        for j in range(heads.size):
            h = heads[j]
            start = base_elems[h] + ids[m, h] * dim
            for d in range(dim):
                out[m, h, d] = segment[start + d]
    return -1


def _ids_2d(ids: np.ndarray) -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 2:
        raise TypeError(f"ids: expected a 2-D int64 array [M, H], got {getattr(ids, 'dtype', type(ids).__name__)} "
                        f"with shape {getattr(ids, 'shape', None)}")
    return np.ascontiguousarray(ids)


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
    heads = _int64_1d(heads, name)
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


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _as_words(a: np.ndarray, items: int, word: int) -> np.ndarray:
    """A C-contiguous array whose last axis holds ``items`` items, seen as words of ``word`` bytes."""
    return a.view(_UINT[word]) if a.dtype.itemsize != word or a.dtype.kind != "u" else a


def _row_word(itemsize: int, dim: int, *addresses: int, offsets: int = 0) -> int:
    """The widest word (8, 4, 2 bytes or the item itself) that rows of ``dim`` items can be copied in."""
    row_bytes = itemsize * dim
    bits = row_bytes | offsets * itemsize
    for a in addresses:
        bits |= a
    for word in (8, 4, 2):
        if word >= itemsize and bits % word == 0:
            return word
    return itemsize


def _check_row_dtype(a: np.ndarray, name: str) -> None:
    if a.dtype.itemsize not in _UINT or a.dtype.kind not in "uif":
        raise TypeError(f"{name}: expected rows of 1-, 2-, 4- or 8-byte numbers, got {a.dtype}")


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
    word = _row_word(rows.dtype.itemsize, rows.shape[1], rows.ctypes.data, out.ctypes.data)
    bad = _scatter_rows(_as_words(rows, rows.shape[1], word), inverse, heads, np.int64(row_start),
                        _as_words(out, out.shape[2], word))
    if bad >= 0:
        m, h = divmod(int(bad), H)
        raise ValueError(f"inverse[{m}, {h}] = {int(inverse[m, h])} falls outside the {rows.shape[0]} rows given "
                         f"(starting at {row_start})")


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
    word = _row_word(itemsize, dim, segment.ctypes.data, out.ctypes.data,
                     offsets=int(np.bitwise_or.reduce(base_elems)) if base_elems.size else 0)
    per = word // itemsize  # items per word
    words = segment[:segment.size - segment.size % per].view(_UINT[word])
    bad = _gather_rows_local(words, base_elems // per, ids, heads, np.int64(dim // per),
                             _as_words(out, dim, word))
    if bad >= 0:
        m, h = divmod(int(bad), H)
        raise ValueError(f"gather_rows_local: row ids[{m}, {h}] = {int(ids[m, h])} lies outside the mapped segment")


def local_gather_plan(segment: np.ndarray, base_elems: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Word views for repeated :func:`gather_rows_prepared` calls on one mapped segment.

    Returns ``(words, base_words, words_per_row, word)``: the segment seen as the widest words its rows of
    ``dim`` items and their table offsets allow (an output buffer must be ``word``-aligned to use them).
    """
    itemsize = segment.dtype.itemsize
    word = _row_word(itemsize, dim, segment.ctypes.data,
                     offsets=int(np.bitwise_or.reduce(base_elems)) if base_elems.size else 0)
    per = word // itemsize
    words = segment[:segment.size - segment.size % per].view(_UINT[word])
    return words, base_elems // per, dim // per, word


def gather_rows_prepared(words: np.ndarray, base_words: np.ndarray, ids: np.ndarray, heads: np.ndarray,
                         words_per_row: int, out_words: np.ndarray) -> int:
    """:func:`gather_rows_local` for a caller that built ``words``/``base_words`` with :func:`local_gather_plan`
    and already validated ``ids`` (int64 ``[M, H]``, C-contiguous, in range) and ``out_words``.

    The hot path of a local-direct lookup: no Python-side checks (the kernel still refuses a row outside
    the segment, before it moves anything). Returns -1, or the flat index of such a row.
    """
    return int(_gather_rows_local(words, base_words, ids, heads, np.int64(words_per_row), out_words))


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
    _cache_fill(keys, positions, rows, out_rows, cache_keys, cache_rows)


def cache_probe(keys: np.ndarray, cache_keys: np.ndarray, cache_rows: np.ndarray,
                out_rows: np.ndarray) -> tuple[np.ndarray, int]:
    """Copy the cached rows of ``keys`` into ``out_rows``; returns (hit mask, hit count)."""
    keys = _int64_1d(keys, "keys")
    if out_rows.shape[0] != keys.size or out_rows.shape[1:] != cache_rows.shape[1:] \
            or out_rows.dtype != cache_rows.dtype:
        raise ValueError(f"out_rows: expected {keys.size} rows like the cache's {cache_rows.shape[1:]} "
                         f"{cache_rows.dtype}, got {out_rows.shape} {out_rows.dtype}")
    hit, hits = _cache_probe(keys, cache_keys, cache_rows, out_rows)
    return hit, int(hits)


def cache_insert(keys: np.ndarray, rows: np.ndarray, cache_keys: np.ndarray, cache_rows: np.ndarray) -> None:
    """Store ``rows`` under ``keys``, each in its slot (replacing whatever was there)."""
    keys = _int64_1d(keys, "keys")
    if rows.shape[0] != keys.size or rows.shape[1:] != cache_rows.shape[1:] or rows.dtype != cache_rows.dtype:
        raise ValueError(f"rows: expected {keys.size} rows like the cache's {cache_rows.shape[1:]} "
                         f"{cache_rows.dtype}, got {rows.shape} {rows.dtype}")
    _cache_insert(keys, rows, cache_keys, cache_rows)


# ---- compilation ------------------------------------------------------------------------------------------------

def warmup() -> None:
    """Compile (or load from the on-disk cache) every kernel, so the first real call pays nothing."""
    src = np.arange(64, dtype=np.uint8)
    off = np.array([0, 8], dtype=np.int64)
    out = np.empty(16, dtype=np.uint8)
    check_ranges(off, off, src.size)
    for n in (1, 4, 8):  # byte, 4-byte and 8-byte word specialisations
        ln = np.array([n, n], dtype=np.int64)
        gather_ranges(src, off, ln, out)
        scatter_ranges(out, src, off, ln)
    ids = np.array([[0, 1], [1, 1]], dtype=np.int64)
    heads = np.array([0, 1], dtype=np.int64)
    first_bad_row(ids, np.array([2, 2], dtype=np.int64))
    uniq, starts, inverse = plan_unique_rows(ids, heads)
    rows_to_ranges(uniq, starts, np.zeros(2, dtype=np.int64), 8)
    # Rows move as 8-, 4-, 2- or 1-byte words; mapped segments and received frames are read-only arrays, a
    # separate specialisation for Numba. Compile every combination now.
    for dtype, dim in ((np.float32, 2), (np.float32, 1), (np.float16, 1), (np.uint8, 1)):
        for writeable in (True, False):
            segment = np.zeros(16, dtype=dtype)
            rows = np.zeros((uniq.size, dim), dtype=dtype)
            segment.flags.writeable = rows.flags.writeable = writeable
            out3 = np.empty((2, 2, dim), dtype=dtype)
            scatter_rows(rows, inverse, heads, 0, out3)
            gather_rows_local(segment, np.array([0, 8], dtype=np.int64), ids, heads, dim, out3)
    src.flags.writeable = False
    for n in (1, 4, 8):
        ln = np.array([n, n], dtype=np.int64)
        gather_ranges(src, off, ln, out)
        scatter_ranges(src[:16], out, off, ln)
    for word in (np.uint8, np.uint32, np.uint64):
        cache_keys = np.full(8, -1, dtype=np.int64)
        cache_rows = np.zeros((8, 2), dtype=word)
        keys = np.arange(2, dtype=np.int64)
        got = np.empty((2, 2), dtype=word)
        cache_probe(keys, cache_keys, cache_rows, got)
        cache_insert(keys, got, cache_keys, cache_rows)
        out_rows = np.empty_like(got)
        got.flags.writeable = False  # rows received from a segment
        cache_insert(keys, got, cache_keys, cache_rows)
        cache_fill(keys, keys, got, out_rows, cache_keys, cache_rows)
