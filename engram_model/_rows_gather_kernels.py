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
column's table, column c's first byte at ``base[c]``), prefetching rows ahead so that their misses overlap; one
lays out rows already read into a staging array ``[S, row_bytes]`` (``src[i]`` the staging row of slot i, -1 for
zeros), which :func:`plan_window` plans for a source that reads ``[M, H]`` per-head ids (``lookup_into``).
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
def row_at(base, offsets, g, hint, row_bytes):
    # The byte offset in the span of table row g, read from the column that holds it.
    c = column_of(g, hint, offsets)
    return np.uint64(base[c]) + np.uint64(g - offsets[c]) * np.uint64(row_bytes)


@njit(inline="always")
def prefetch_row(span, at, row_bytes):
    for b in range(0, row_bytes, 64):
        prefetch_hint(span, at + np.uint64(b))
    prefetch_hint(span, at + np.uint64(row_bytes - 1))


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


@njit(cache=True, nogil=True)
def rows_from_span(span, base, offsets, ids, v0, v1, i0, i1, row_bytes, lut, out):
    """Slots i0..i1 of flat ids: out uint8 [N, row_bytes] (raw; lut unused) or uint16 [N, values] (coded through
    lut uint16 [256]); ids outside [v0, v1) give zeros. Ids checked first (first_bad)."""
    cols = offsets.shape[0] - 1
    raw = out.shape[1] == row_bytes and out.itemsize == 1
    for i in range(i0, min(i1, i0 + PREFETCH_ROWS)):
        if v0 <= ids[i] < v1:
            prefetch_row(span, row_at(base, offsets, ids[i], i % cols, row_bytes), row_bytes)
    for i in range(i0, i1):
        p = i + PREFETCH_ROWS
        if p < i1 and v0 <= ids[p] < v1:
            prefetch_row(span, row_at(base, offsets, ids[p], p % cols, row_bytes), row_bytes)
        g = ids[i]
        dst = out[i]
        if g < v0 or g >= v1:
            for k in range(dst.shape[0]):
                dst[k] = 0
            continue
        at = row_at(base, offsets, g, i % cols, row_bytes)
        if raw:
            for k in range(row_bytes):
                dst[k] = span[at + np.uint64(k)]
        else:
            for k in range(dst.shape[0]):
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
