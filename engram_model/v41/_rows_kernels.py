"""Numba kernels of :class:`engram_model.v41.V41Rows`: V4.1 table rows gathered into the engines' buffers.

Ids are rows of a layer's one table (column c's rows start at ``offsets[c]``; ``offsets[cols]`` is the table's
size), ``-1`` for padding. The forms, as the engines lay them out:

* packed (vLLM's uint8 lookup, Mooncake's rows): ``out[t, j]`` = the 264 bytes of the row ``ids[t, head_start + j]``;
* bf16 (vLLM's bf16 lookup, ``_engram_lookup_kernel``): ``out[t, j, k]`` = the bf16 bits of
  ``float32(e4m3 code k) * float32(bits scale_byte << 23)`` through a ``[scale byte, code]`` table of them;
* split (SGLang's ``EngramRowStager._gather``): ``codes[i]`` = the row's 256 e4m3 bytes, ``scales[i]`` its 8 e8m0
  bytes, for flat ids.

As in vLLM's kernel, a ``[T, cols]`` form reads the columns ``head_start .. head_start + part`` of each token (a
head shard; columns past the last give zeros) and gives zeros for every id outside the shard's rows
``[offsets[head_start], offsets[head_start + part])``. An id inside them is read from the column that holds it,
whichever slot it came in (ids from a hasher always sit in their own column: that is the first guess).

Each form has two kernels: one gathers from the tables in this host's memory (one span of it holding every
column's table, column c's first byte at ``base[c]``), prefetching the rows ahead so that their misses overlap; one
rearranges rows already read into a staging array ``[S, row_bytes]``
(``src[slot]`` the staging row of each output slot, -1 for zeros), which :func:`plan_window` and
:func:`plan_flat` plan. Ids are checked by :func:`first_bad_window` and :func:`first_bad_flat` before anything is
written.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engram_store.kernels import PREFETCH_ROWS, prefetch_hint

#: Rows whose cache lines are touched together before they are copied (their misses overlap).
TOUCH_AHEAD = 32
#: Values per e8m0 scale byte.
BLOCK = 32


@njit(inline="always")
def _column_of(g, hint, offsets):
    # The column holding table row g (0 <= g < offsets[-1]): the hint if it does, else a binary search.
    cols = offsets.shape[0] - 1
    if 0 <= hint < cols and offsets[hint] <= g < offsets[hint + 1]:
        return hint
    lo, hi = 0, cols
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if offsets[mid] <= g:
            lo = mid
        else:
            hi = mid
    return lo


@njit(inline="always")
def _window(offsets, head_start, part):
    # The shard's rows [v0, v1): columns head_start .. head_start + part, cut at the last column.
    cols = offsets.shape[0] - 1
    return offsets[min(head_start, cols)], offsets[min(head_start + part, cols)]


@njit(cache=True, nogil=True)
def first_bad_window(ids, offsets, head_start, part):
    """The flat index ``t * cols + c`` of the first id of the window's columns that is neither -1 nor a row of the
    table (``0 <= id < offsets[-1]``), else -1. ids int32/int64 [T, cols]."""
    T, cols = ids.shape
    total = offsets[cols]
    for t in range(T):
        for c in range(head_start, min(head_start + part, cols)):
            g = ids[t, c]
            if g < -1 or g >= total:
                return t * cols + c
    return -1


@njit(cache=True, nogil=True)
def first_bad_flat(ids, offsets):
    """The index of the first id that is neither -1 nor a row of the table, else -1. ids int32/int64 [N]."""
    total = offsets[offsets.shape[0] - 1]
    for i in range(ids.shape[0]):
        if ids[i] < -1 or ids[i] >= total:
            return i
    return -1


@njit(inline="always")
def _bf16_row(src, at, dst, lut, head_dim):
    # The packed row at src[at:] (uint8 [head_dim + head_dim // 32]) -> dst uint16 [head_dim] bf16 bits, one table
    # row per scale byte. (Decoding the codes arithmetically, a shift of the exponent per block, measured slower:
    # its selects for subnormal, zero and NaN codes cost more than a load from a 512-byte table row.)
    for b in range(head_dim // BLOCK):
        row = lut[src[at + np.uint64(head_dim + b)]]
        for k in range(b * BLOCK, (b + 1) * BLOCK):
            dst[k] = row[src[at + np.uint64(k)]]


@njit(inline="always")
def _row_at(base, offsets, g, hint, row_bytes):
    # The byte offset in the span of table row g (inside the window), reading it from the column that holds it.
    c = _column_of(g, hint, offsets)
    return np.uint64(base[c]) + np.uint64(g - offsets[c]) * np.uint64(row_bytes)


@njit(inline="always")
def _prefetch_row(span, at, row_bytes):
    for b in range(0, row_bytes, 64):
        prefetch_hint(span, at + np.uint64(b))
    prefetch_hint(span, at + np.uint64(row_bytes - 1))


# ---- from this host's memory ------------------------------------------------------------------------------
#
# The tables are one read-only uint8 ``span`` of this host's memory (every column's table inside it, column c's
# first row at byte ``base[c]``; memory between the tables is never touched). Positions are uint64, so the row
# copies compile to vector loops (a signed index costs a wraparound select per byte).

NONE = np.uint64(0xFFFFFFFFFFFFFFFF)


@njit(cache=True, nogil=True)
def window_from_span(span, base, offsets, ids, head_start, t0, t1, row_bytes, lut, out):
    """Tokens t0..t1 of a ``[T, cols]`` form: out uint8 [T, part, row_bytes] (packed; lut unused) or uint16
    [T, part, head_dim] (bf16 bits through lut uint16 [256, 256]). Ids checked first (first_bad_window)."""
    part = out.shape[1]
    cols = offsets.shape[0] - 1
    v0, v1 = _window(offsets, head_start, part)
    head_dim = row_bytes // (BLOCK + 1) * BLOCK
    packed = out.shape[2] == row_bytes  # else bf16: head_dim values
    ahead = max(1, -(-PREFETCH_ROWS // part))  # tokens ahead: about PREFETCH_ROWS rows
    for t in range(t0, min(t1, t0 + ahead)):
        _prefetch_token(span, base, offsets, ids, head_start, part, v0, v1, row_bytes, t)
    for t in range(t0, t1):
        if t + ahead < t1:
            _prefetch_token(span, base, offsets, ids, head_start, part, v0, v1, row_bytes, t + ahead)
        for j in range(part):
            c = head_start + j
            g = ids[t, c] if c < cols else -1
            dst = out[t, j]
            if g < v0 or g >= v1:
                for k in range(dst.shape[0]):
                    dst[k] = 0
                continue
            at = _row_at(base, offsets, g, c, row_bytes)
            if packed:
                for k in range(row_bytes):
                    dst[k] = span[at + np.uint64(k)]
            else:
                _bf16_row(span, at, dst, lut, head_dim)


@njit(inline="always")
def _prefetch_token(span, base, offsets, ids, head_start, part, v0, v1, row_bytes, t):
    for j in range(part):
        c = head_start + j
        if c < offsets.shape[0] - 1:
            g = ids[t, c]
            if v0 <= g < v1:
                _prefetch_row(span, _row_at(base, offsets, g, c, row_bytes), row_bytes)


@njit(cache=True, nogil=True)
def split_from_span(span, base, offsets, ids, i0, i1, codes, scales):
    """Flat ids i0..i1 into codes uint8 [N, head_dim] and scales uint8 [N, head_dim // 32]; -1 gives zeros.
    Ids checked first (first_bad_flat). The column guess for id i is ``i % cols`` (ids flattened from
    ``[T, cols]``)."""
    cols = offsets.shape[0] - 1
    head_dim = codes.shape[1]
    nblk = scales.shape[1]
    row_bytes = head_dim + nblk
    for i in range(i0, min(i1, i0 + PREFETCH_ROWS)):
        if ids[i] >= 0:
            _prefetch_row(span, _row_at(base, offsets, ids[i], i % cols, row_bytes), row_bytes)
    for i in range(i0, i1):
        p = i + PREFETCH_ROWS
        if p < i1 and ids[p] >= 0:
            _prefetch_row(span, _row_at(base, offsets, ids[p], p % cols, row_bytes), row_bytes)
        g = ids[i]
        if g < 0:
            codes[i, :] = 0
            scales[i, :] = 0
            continue
        at = _row_at(base, offsets, g, i % cols, row_bytes)
        dc = codes[i]
        for k in range(head_dim):
            dc[k] = span[at + np.uint64(k)]
        at += np.uint64(head_dim)
        ds = scales[i]
        for k in range(nblk):
            ds[k] = span[at + np.uint64(k)]


# ---- through a staging read -------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def plan_window(ids, offsets, head_start, part, col_head, num_heads):
    """Where each slot ``t * part + j`` of a ``[T, cols]`` form is read from, for a source that reads ``[M, H]``
    per-head ids (EngramStore.lookup_into). Returns (store_ids int64 [M, H], src int64 [T * part]): src is the
    staging row ``m * H + h`` of each slot, -1 for zeros.

    col_head int64 [cols]: the EngramStore head holding column c (-1: none; every column an id of the window's rows
    lies in is held). An id in its own column is read at m = t, so a whole layer's rows land in slot order; ids of
    another column are read in rows after the first T; unused entries read row 0 (once per head, for nothing).
    """
    T = ids.shape[0]
    cols = offsets.shape[0] - 1
    v0, v1 = _window(offsets, head_start, part)
    extra = np.zeros(num_heads, dtype=np.int64)
    for t in range(T):  # first pass: how many rows of other columns each head reads
        for j in range(part):
            c = head_start + j
            g = ids[t, c] if c < cols else -1
            if v0 <= g < v1:
                cc = _column_of(g, c, offsets)
                if cc != c:
                    extra[col_head[cc]] += 1
    store_ids = np.zeros((T + extra.max(), num_heads), dtype=np.int64)
    src = np.empty(T * part, dtype=np.int64)
    extra[:] = 0
    for t in range(T):
        for j in range(part):
            c = head_start + j
            g = ids[t, c] if c < cols else -1
            s = t * part + j
            if not v0 <= g < v1:
                src[s] = -1
                continue
            cc = _column_of(g, c, offsets)
            h = col_head[cc]
            m = t
            if cc != c:
                m = T + extra[h]
                extra[h] += 1
            store_ids[m, h] = g - offsets[cc]
            src[s] = m * num_heads + h
    return store_ids, src


@njit(cache=True, nogil=True)
def plan_flat(ids, offsets, col_head, num_heads):
    """:func:`plan_window` for the split form's flat ids [N] (slot i): each head reads its ids in order (the
    column guess for id i is ``i % cols``); -1 gives zeros."""
    N = ids.shape[0]
    cols = offsets.shape[0] - 1
    counts = np.zeros(num_heads, dtype=np.int64)
    column = np.empty(N, dtype=np.int64)
    for i in range(N):
        if ids[i] >= 0:
            column[i] = _column_of(ids[i], i % cols, offsets)
            counts[col_head[column[i]]] += 1
    store_ids = np.zeros((max(counts.max(), 1), num_heads), dtype=np.int64)
    src = np.empty(N, dtype=np.int64)
    counts[:] = 0
    for i in range(N):
        if ids[i] < 0:
            src[i] = -1
            continue
        c = column[i]
        h = col_head[c]
        store_ids[counts[h], h] = ids[i] - offsets[c]
        src[i] = counts[h] * num_heads + h
        counts[h] += 1
    return store_ids, src


@njit(cache=True, nogil=True)
def window_from_staging(staged, src, lut, out):
    """A ``[T, cols]`` form from staged rows uint8 [S, row_bytes]: slot ``t * part + j`` of out (uint8
    [T, part, row_bytes] packed, or uint16 [T, part, head_dim] bf16 bits through lut) from ``staged[src[slot]]``,
    zeros where src is -1."""
    T, part = out.shape[0], out.shape[1]
    row_bytes = staged.shape[1]
    head_dim = row_bytes // (BLOCK + 1) * BLOCK
    packed = out.shape[2] == row_bytes  # else bf16: head_dim values
    for t in range(T):
        for j in range(part):
            dst = out[t, j]
            r = src[t * part + j]
            if r < 0:
                dst[:] = 0
            elif packed:
                row = staged[r]
                for k in range(row_bytes):
                    dst[k] = row[k]
            else:
                _bf16_row(staged[r], np.uint64(0), dst, lut, head_dim)


@njit(cache=True, nogil=True)
def split_from_staging(staged, src, codes, scales):
    """The split form from staged rows: codes[i], scales[i] from ``staged[src[i]]``, zeros where src is -1."""
    head_dim = codes.shape[1]
    nblk = scales.shape[1]
    for i in range(src.shape[0]):
        r = src[i]
        if r < 0:
            codes[i, :] = 0
            scales[i, :] = 0
            continue
        row = staged[r]
        for k in range(head_dim):
            codes[i, k] = row[k]
        for k in range(nblk):
            scales[i, k] = row[head_dim + k]


@njit(cache=True, nogil=True)
def zero_slots(src, out):
    """Zero the slots of out [T, part, width] whose src is -1 (rows read straight into out in slot order)."""
    part = out.shape[1]
    for s in range(src.shape[0]):
        if src[s] < 0:
            t, j = divmod(s, part)
            out[t, j, :] = 0
