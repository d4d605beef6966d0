"""Numba kernels of the row gathers a model family gives the serving engines (:mod:`engram_model._rows_gather`).

A layer's one table is cut into columns (hash heads): column ``c`` holds the table's rows ``offsets[c] ..
offsets[c + 1]`` (``offsets[cols]`` is the rows the columns hold). Ids are rows of that one table, flat ``[N]``
(an engine's ``[T, cols]`` flattened: slot ``i``'s id is most likely in column ``i % cols``, the first guess);
``-1`` is padding. A call reads the ids inside a window of rows ``[v0, v1)`` (a rank's contiguous row range, or
a head shard's columns) and gives zeros for every other id, as the engines' kernels do for rows another rank owns.

Two forms of an output slot:

* raw: ``out`` uint8 ``[N, row_bytes]``, the row's bytes as stored (e4m3 codes, bf16 bits, codes then block
  scales);
* coded: ``out`` uint16 ``[N, values]``, each of the row's ``values`` one-byte codes through ``lut`` (uint16
  ``[256]``: e4m3 code -> bf16 bits, as an engine's ``.to(bfloat16)`` of an fp8 tensor).

Each form has two kernels: one gathers from the tables in this host's memory (one read-only span holding every
column's table: row g of column c at ``delta[c] + g * row_items``; raw rows a word at a time where the tables and
``out`` allow), prefetching rows ahead so that their misses overlap; one lays out rows already read into a
staging array ``[S, row_bytes]`` (``src[i]`` the staging row of slot i, -1 for zeros), which :func:`plan_window`
plans for a source that reads ``[M, H]`` per-head ids (``lookup_into``).
:func:`first_bad` checks the ids before anything is written.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engram_store.kernels import PREFETCH_ROWS, prefetch_hint


@njit(inline="always")
def column_of(g, hint, offsets):
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
def prefetch_row(span, at, row_items):
    # Every cache line of the row of row_items items at span[at:].
    step = max(1, 64 // span.itemsize)
    for b in range(0, row_items, step):
        prefetch_hint(span, at + np.uint64(b))
    prefetch_hint(span, at + np.uint64(row_items - 1))


@njit(cache=True, nogil=True)
def first_bad(ids, total):
    """The index of the first id that is neither -1 nor a row the columns hold (``0 <= id < total``), else -1.
    ids int32/int64 [N]."""
    for i in range(ids.shape[0]):
        if ids[i] < -1 or ids[i] >= total:
            return i
    return -1


# ---- from this host's memory ------------------------------------------------------------------------------
#
# Positions are uint64, so the row copies compile to vector loops (a signed index costs a wraparound select per
# byte). Memory between the tables in the span is never touched: every id is checked against the columns first.


#: The place of a slot whose id is outside the window: it reads zeros.
OUTSIDE = np.uint64(0xFFFFFFFFFFFFFFFF)


@njit(cache=True, nogil=True)
def places(delta, offsets, ids, v0, v1, i0, i1, row_items):
    """Where the rows of slots i0..i1 are in the span (uint64 ``[i1 - i0]``; :data:`OUTSIDE` for ids outside
    [v0, v1)): row g of column c at ``delta[c] + g * row_items``. A pass of its own, so the copy's loop stays tight
    (measured: finding the column inside it made the gather twice as slow)."""
    cols = offsets.shape[0] - 1
    out = np.empty(i1 - i0, dtype=np.uint64)
    c = i0 % cols  # the column guess of slot i, counted along (no division a row)
    for j in range(i1 - i0):
        g = ids[i0 + j]
        if v0 <= g < v1:
            if not offsets[c] <= g < offsets[c + 1]:
                c2 = column_of(g, c, offsets)
                out[j] = np.uint64(delta[c2] + g * row_items)
            else:
                out[j] = np.uint64(delta[c] + g * row_items)
        else:
            out[j] = OUTSIDE
        c = c + 1 if c + 1 < cols else 0
    return out


@njit(cache=True, nogil=True)
def rows_from_span(span, delta, offsets, ids, v0, v1, i0, i1, row_items, lut, out):
    """Slots i0..i1 of flat ids from the span, zeros outside [v0, v1); row g of column c is at ``delta[c] + g *
    row_items`` in the span. Raw where ``out`` has the span's items (``[N, row_items]``: uint8 bytes, or uint64
    words over a uint64 span; lut unused), else coded: out uint16 ``[N, values]``, each code of the row through lut
    (uint16 [256]; a uint8 span). Ids checked first (first_bad)."""
    raw = out.itemsize == span.itemsize  # known when the kernel compiles: one loop or the other is left
    where = places(delta, offsets, ids, v0, v1, i0, i1, row_items)
    n, width = where.shape[0], out.shape[1]
    for j in range(min(n, PREFETCH_ROWS)):
        if where[j] != OUTSIDE:
            prefetch_row(span, where[j], row_items)
    for j in range(n):
        p = j + PREFETCH_ROWS
        if p < n and where[p] != OUTSIDE:
            prefetch_row(span, where[p], row_items)
        at = where[j]
        dst = out[i0 + j]
        if at == OUTSIDE:
            for k in range(width):
                dst[k] = 0
        elif raw:
            for k in range(row_items):
                dst[k] = span[at + np.uint64(k)]
        else:
            for k in range(width):
                dst[k] = lut[span[at + np.uint64(k)]]


# ---- through a staging read -------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def plan_window(ids, offsets, v0, v1, col_head, num_heads):
    """Where each slot of flat ids is read from, for a source that reads ``[M, H]`` per-head ids
    (EngramStore.lookup_into). Returns (store_ids int64 [M, H], src int64 [N]): src is the staging row
    ``m * H + h`` of slot i, -1 for zeros (ids outside [v0, v1), -1).

    col_head int64 [cols]: the EngramStore head holding column c (-1: none; every column an id of the window lies
    in is held). An id in its own column (``i % cols``) is read at ``m = i // cols``, so a whole ``[T, cols]``
    step's rows land in slot order; ids of another column are read in rows after the first ``ceil(N / cols)``;
    unused entries read row 0 (once per head, for nothing)."""
    N = ids.shape[0]
    cols = offsets.shape[0] - 1
    T = -(-N // cols)
    extra = np.zeros(num_heads, dtype=np.int64)
    for i in range(N):  # first pass: how many rows of other columns each head reads
        g = ids[i]
        if v0 <= g < v1:
            c = column_of(g, i % cols, offsets)
            if c != i % cols:
                extra[col_head[c]] += 1
    store_ids = np.zeros((max(T + extra.max(), 1), num_heads), dtype=np.int64)
    src = np.empty(N, dtype=np.int64)
    extra[:] = 0
    for i in range(N):
        g = ids[i]
        if not v0 <= g < v1:
            src[i] = -1
            continue
        c = column_of(g, i % cols, offsets)
        h = col_head[c]
        m = i // cols
        if c != i % cols:
            m = T + extra[h]
            extra[h] += 1
        store_ids[m, h] = g - offsets[c]
        src[i] = m * num_heads + h
    return store_ids, src


@njit(cache=True, nogil=True)
def rows_from_staging(staged, src, lut, out):
    """Slot i of out (uint8 [N, row_bytes] raw, or uint16 [N, values] coded through lut) from ``staged[src[i]]``
    (uint8 [S, row_bytes]), zeros where src is -1."""
    row_bytes = staged.shape[1]
    raw = out.shape[1] == row_bytes and out.itemsize == 1
    for i in range(src.shape[0]):
        dst = out[i]
        r = src[i]
        if r < 0:
            for k in range(dst.shape[0]):
                dst[k] = 0
        elif raw:
            row = staged[r]
            for k in range(row_bytes):
                dst[k] = row[k]
        else:
            row = staged[r]
            for k in range(dst.shape[0]):
                dst[k] = lut[row[k]]


@njit(cache=True, nogil=True)
def zero_slots(src, out):
    """Zero the slots of out [N, width] whose src is -1 (rows read straight into out in slot order)."""
    for i in range(src.shape[0]):
        if src[i] < 0:
            out[i, :] = 0
