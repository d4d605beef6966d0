"""Numba kernels of the row gathers a model family gives the serving engines (:mod:`engram_model._rows_gather`).

A layer's one table is cut into columns (hash heads): column ``c`` holds the table's rows ``offsets[c] ..
offsets[c + 1]`` (``offsets[cols]`` is the rows the columns hold). Ids are rows of that one table, flat (an
engine's ``[T, cols]`` flattened, or ids of any shape); ``-1`` is padding. A call reads the ids inside a window of
rows ``[v0, v1)`` (a rank's contiguous row range, or a head shard's columns) and gives zeros for every other id, as
the engines' kernels do for rows another rank owns.

The output slots: slot ``i = t * width + j`` holds the row of ``ids[t * cols + first + j]`` (zeros where ``first +
j >= cols``): ``first = 0, width = cols`` makes slot i the row of ``ids[i]`` (ids of any shape); a head shard's
``[T, part]`` slots of ``[T, cols]`` ids take ``first = head_start, width = part``. The id of slot i is most likely
in its own column ``first + j``: the first guess. The forms of a slot:

* raw: ``out`` uint8 ``[N, row_bytes]``, the row's bytes as stored (e4m3 codes, bf16 bits, codes then block
  scales);
* coded: ``out`` uint16 ``[N, values]``, each of the row's ``values`` one-byte codes through ``lut`` (uint16
  ``[256]``: e4m3 code -> bf16 bits, as an engine's ``.to(bfloat16)`` of an fp8 tensor);
* scaled: ``out`` uint16 ``[N, values]`` from rows of codes then one scale byte per block of ``values // blocks``
  codes: code k through ``lut[its block's scale byte]`` (uint16 ``[256, 256]``, e.g. DeepSeek-V4.1's e4m3 codes
  times e8m0 scales as vLLM's bf16 lookup);
* split: ``codes`` uint8 ``[N, values]`` and ``scales`` uint8 ``[N, blocks]``, the row's codes and its scale bytes
  (SGLang's staging of V4.1 rows).

Each form has two kernels: one gathers from the tables in this host's memory (one read-only span holding every
column's table: row g of column c at ``delta[c] + g * row_items``; raw rows a word at a time where the tables and
``out`` allow), asking for the row ``AHEAD`` slots on as it copies each, with three hints a row (measured on rows
never read before, 160-byte rows of a 0.6 GiB table, on 4 KiB and on 2 MiB pages: 0.66-0.71x the time of a burst of
16 rows' hints a burst ahead, and 0.34-0.71x torch's own gather, where the bursts took 0.54-1.09x: what counts is
how few instructions each row costs, see :func:`prefetch_row`; the forms that decode through a lut ask for a burst
of rows a burst ahead instead, see ``_coded_rows``); one lays out rows already read into a staging array
``[S, row_bytes]`` (``src[i]`` the staging row of slot i, -1 for zeros), which :func:`plan_window` plans for a
source that reads ``[M, H]`` per-head ids (``lookup_into``).
:func:`first_bad` and :func:`first_bad_window` check the ids before anything is written;
:func:`checked_rows_from_span` checks them and gathers in one call (a decode step's one dispatch).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from engram_store.kernels import prefetch_hint


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


#: Slots ahead of the copy whose rows are asked for (measured: 4 and 8 alike, 16 a little slower).
AHEAD = 8


def line_items(span):
    """A cache line's worth of ``span``'s items, a constant where a kernel compiles (``span.itemsize`` is read at
    run time: a division a row measured twice as slow)."""
    return np.uint64(64 // span.itemsize)


@overload(line_items, inline="always")
def _line_items(span):
    items = np.uint64(64 // (span.dtype.bitwidth // 8))
    return lambda span: items


def same_items(span, out):
    """Whether ``out``'s items are ``span``'s size (the raw form), a constant where a kernel compiles: the other
    form's loop is left out (measured: with both in the loop, a decode step's gather took a third longer)."""
    return span.itemsize == out.itemsize


@overload(same_items, inline="always")
def _same_items(span, out):
    same = span.dtype.bitwidth == out.dtype.bitwidth
    return lambda span, out: same


@njit
def prefetch_row(span, at, line, last):
    # Three hints for the row at span[at:]: its first item, ``line`` items on (line_items), its last item (``last``
    # items on). On 160-byte rows that is every line the row touches, or three of four; longer rows leave lines to
    # the CPU's own prefetchers. A hint more per row, a loop over the row's lines or a division measured 15-100%
    # slower: each row's instructions count, as fewer of them let the CPU's reorder window reach more rows' misses.
    # (A plain function: LLVM inlines it. Numba's own inlining, of this or of the loop around it, measured 1.5x
    # slower.)
    prefetch_hint(span, at)
    prefetch_hint(span, at + line)
    prefetch_hint(span, at + last)


@njit
def prefetch_first(span, where, n, line, last):
    # The rows of the first AHEAD slots, before the copies begin (a plain function too, as prefetch_row).
    for j in range(min(AHEAD, n)):
        if where[j] != OUTSIDE:
            prefetch_row(span, where[j], line, last)


@njit(inline="always")
def prefetch_lines(span, at, row_items):
    # Every cache line of the row of row_items items at span[at:] (the bursts' hints).
    step = max(1, 64 // span.itemsize)
    for b in range(0, row_items, step):
        prefetch_hint(span, at + np.uint64(b))
    prefetch_hint(span, at + np.uint64(row_items - 1))


@njit(inline="always")
def prefetch_burst(span, where, a, b, row_items):
    # The rows of slots a..b (of where's), before they are copied.
    for j in range(a, min(b, where.shape[0])):
        if where[j] != OUTSIDE:
            prefetch_lines(span, where[j], row_items)


@njit(inline="always")
def burst_of(width):
    # The slots of a burst: a token's slots, at least 16.
    return max(width, 16)


@njit(cache=True, nogil=True)
def first_bad(ids, total):
    """The index of the first id that is neither -1 nor a row the columns hold (``0 <= id < total``), else -1.
    ids int32/int64 [N]."""
    for i in range(ids.shape[0]):
        if ids[i] < -1 or ids[i] >= total:
            return i
    return -1


@njit(cache=True, nogil=True)
def first_bad_window(ids, total, first, width):
    """The flat index ``t * cols + c`` of the first id of the slots' columns ``first .. first + width`` (cut at the
    last) that is neither -1 nor below ``total``, else -1. ids int32/int64 [T, cols]."""
    T, cols = ids.shape
    for t in range(T):
        for c in range(first, min(first + width, cols)):
            g = ids[t, c]
            if g < -1 or g >= total:
                return t * cols + c
    return -1


# ---- from this host's memory ------------------------------------------------------------------------------
#
# Positions are uint64, so the row copies compile to vector loops (a signed index costs a wraparound select per
# byte). Memory between the tables in the span is never touched: every id is checked against the columns first.


#: Codes per scale byte of the block-scaled rows the kernels know at compile time (DeepSeek-V4.1's e8m0 blocks).
SCALE_BLOCK = 32
#: The place of a slot whose id is outside the window: it reads zeros.
OUTSIDE = np.uint64(0xFFFFFFFFFFFFFFFF)


@njit(cache=True, nogil=True)
def places(delta, offsets, ids, first, width, v0, v1, i0, i1, row_items):
    """Where the rows of slots i0..i1 are in the span (uint64 ``[i1 - i0]``; :data:`OUTSIDE` for ids outside
    [v0, v1)): row g of column c at ``delta[c] + g * row_items``. A pass of its own, so the copy's loop stays tight
    (measured: finding the column inside it made the gather twice as slow)."""
    cols = offsets.shape[0] - 1
    out = np.empty(i1 - i0, dtype=np.uint64)
    t = i0 // width
    j = i0 - t * width  # slot i's token and place, counted along (no division a row)
    for s in range(i1 - i0):
        c = first + j  # the column guess
        g = ids[t * cols + c] if c < cols else -1
        if v0 <= g < v1:
            if not offsets[c] <= g < offsets[c + 1]:
                c2 = column_of(g, c, offsets)
                out[s] = np.uint64(delta[c2] + g * row_items)
            else:
                out[s] = np.uint64(delta[c] + g * row_items)
        else:
            out[s] = OUTSIDE
        j += 1
        if j == width:
            j = 0
            t += 1
    return out


@njit(cache=True, nogil=True)
def rows_from_span(span, delta, offsets, ids, first, width, v0, v1, i0, i1, row_items, lut, out):
    """Slots i0..i1 from the span, zeros outside [v0, v1); row g of column c is at ``delta[c] + g * row_items`` in
    the span. Raw where ``out`` has the span's items (``[N, row_items]``: uint8 bytes, or uint64 words over a uint64
    span; lut unused), else coded: out uint16 ``[N, values]``, each code of the row through lut (uint16 [256]; a
    uint8 span). Ids checked first (first_bad)."""
    _span_rows(span, delta, offsets, ids, first, width, v0, v1, i0, i1, row_items, lut, out)


@njit(cache=True, nogil=True)
def checked_rows_from_span(span, delta, offsets, ids, total, v0, v1, row_items, lut, out):
    """:func:`first_bad` and then, where every id is good, :func:`rows_from_span` of every slot (slot i the row of
    ``ids[i]``), in one call: a decode step's gather is one dispatch. Returns the first bad id's index (nothing
    written), else -1."""
    for i in range(ids.shape[0]):
        if ids[i] < -1 or ids[i] >= total:
            return i
    cols = offsets.shape[0] - 1
    _span_rows(span, delta, offsets, ids, 0, cols, v0, v1, 0, ids.shape[0], row_items, lut, out)
    return -1


@njit(inline="always")
def _span_rows(span, delta, offsets, ids, first, width, v0, v1, i0, i1, row_items, lut, out):
    where = places(delta, offsets, ids, first, width, v0, v1, i0, i1, row_items)
    if same_items(span, out):  # known when the kernel compiles: one or the other is left
        _raw_rows(span, where, i0, row_items, out)
    else:
        _coded_rows(span, where, i0, row_items, width, lut, out)


#: The row size in bytes whose copy compiles with its length known: DeepSeek-V4.1's packed rows. A copy of a known
#: length is straight vector moves, with no loop and no check of the two arrays' overlap: fewer instructions a row,
#: so the CPU's reorder window holds more rows' misses (measured: a decode step's gather of 264-byte rows from 2 MiB
#: pages 1.25x faster). Not PLE's: its 160-byte rows gained nothing and its 320-byte rows took up to 1.6x as long
#: (measured against the loop, in one run each). Other sizes take the loop.
KNOWN_ROW_BYTES = 264


@njit
def _raw_rows(span, where, i0, row_items, out):
    # The raw form: each row asked for AHEAD slots before it is copied; V4.1's row size as a constant (see
    # KNOWN_ROW_BYTES: that branch is _raw_copy compiled with its length).
    per = 64 // line_items(span)  # bytes an item (a constant where the kernel compiles)
    if row_items * per == KNOWN_ROW_BYTES:
        _raw_copy(span, where, i0, KNOWN_ROW_BYTES // per, out)
    else:
        _raw_copy(span, where, i0, row_items, out)


@njit(inline="always")
def _raw_copy(span, where, i0, row_items, out):
    # (Numba's inlining, so a constant row_items reaches the copy: LLVM's own, of a plain function, measured none.)
    n, items = where.shape[0], out.shape[1]
    line, last = line_items(span), np.uint64(row_items - 1)
    prefetch_first(span, where, n, line, last)
    for j in range(n):
        if j + AHEAD < n and where[j + AHEAD] != OUTSIDE:  # (written out: as a function, measured 1.4x slower)
            prefetch_row(span, where[j + AHEAD], line, last)
        at = where[j]
        dst = out[i0 + j]
        if at == OUTSIDE:
            for k in range(items):
                dst[k] = 0
        else:
            for k in range(row_items):
                dst[k] = span[at + np.uint64(k)]


@njit
def _coded_rows(span, where, i0, row_items, width, lut, out):
    # The coded form, a lut load per code: bursts of rows asked for a burst ahead (measured: each row AHEAD slots
    # ahead took 1.3-1.8x as long here, where a row's decoding, not its misses, fills the CPU's reorder window).
    n, items = where.shape[0], out.shape[1]
    step = burst_of(width)
    prefetch_burst(span, where, 0, step, row_items)
    for j0 in range(0, n, step):
        prefetch_burst(span, where, j0 + step, j0 + 2 * step, row_items)  # rows ahead, while these are decoded
        for j in range(j0, min(j0 + step, n)):
            at = where[j]
            dst = out[i0 + j]
            if at == OUTSIDE:
                for k in range(items):
                    dst[k] = 0
            else:
                for k in range(items):
                    dst[k] = lut[span[at + np.uint64(k)]]


@njit(inline="always")
def scaled_row(src, at, dst, lut, blocks):
    # The row at src[at:] (codes [values], then a scale byte per block) -> dst uint16 [values], one lut row per
    # scale byte. (Decoding e4m3 arithmetically, a shift of the exponent per block, measured slower: its selects
    # for subnormal, zero and NaN codes cost more than a load from a 512-byte lut row.)
    values = dst.shape[0]
    if values == blocks * SCALE_BLOCK:  # DeepSeek-V4.1's blocks: a known trip count (measured: 30% faster)
        for b in range(blocks):
            row = lut[src[at + np.uint64(values + b)]]
            for k in range(b * SCALE_BLOCK, (b + 1) * SCALE_BLOCK):
                dst[k] = row[src[at + np.uint64(k)]]
        return
    block = values // blocks
    for b in range(blocks):
        row = lut[src[at + np.uint64(values + b)]]
        for k in range(b * block, (b + 1) * block):
            dst[k] = row[src[at + np.uint64(k)]]


@njit(cache=True, nogil=True)
def scaled_from_span(span, delta, offsets, ids, first, width, v0, v1, i0, i1, row_bytes, lut, out):
    """Slots i0..i1 in the scaled form (out uint16 [N, values], lut uint16 [256, 256]) from a uint8 span, zeros
    outside [v0, v1). Ids checked first."""
    where = places(delta, offsets, ids, first, width, v0, v1, i0, i1, row_bytes)
    n, blocks = where.shape[0], row_bytes - out.shape[1]
    step = burst_of(width)  # (a lut load per code, as the coded form: bursts)
    prefetch_burst(span, where, 0, step, row_bytes)
    for j0 in range(0, n, step):
        prefetch_burst(span, where, j0 + step, j0 + 2 * step, row_bytes)
        for j in range(j0, min(j0 + step, n)):
            at = where[j]
            if at == OUTSIDE:
                out[i0 + j, :] = 0
            else:
                scaled_row(span, at, out[i0 + j], lut, blocks)


@njit(cache=True, nogil=True)
def split_from_span(span, delta, offsets, ids, first, width, v0, v1, i0, i1, row_bytes, codes, scales):
    """Slots i0..i1 in the split form (codes uint8 [N, values], scales uint8 [N, blocks]) from a uint8 span, zeros
    outside [v0, v1). Ids checked first."""
    where = places(delta, offsets, ids, first, width, v0, v1, i0, i1, row_bytes)
    values, blocks = codes.shape[1], scales.shape[1]
    if values == 256 and blocks == 8:  # DeepSeek-V4.1's rows, their lengths known (see KNOWN_ROW_BYTES)
        _split_copy(span, where, i0, 256, 8, codes, scales)
    else:
        _split_copy(span, where, i0, values, blocks, codes, scales)


@njit(inline="always")
def _split_copy(span, where, i0, values, blocks, codes, scales):
    n = where.shape[0]
    line, last = line_items(span), np.uint64(values + blocks - 1)
    prefetch_first(span, where, n, line, last)
    for j in range(n):
        if j + AHEAD < n and where[j + AHEAD] != OUTSIDE:  # (written out: as a function, measured 1.4x slower)
            prefetch_row(span, where[j + AHEAD], line, last)
        at = where[j]
        dc, ds = codes[i0 + j], scales[i0 + j]
        if at == OUTSIDE:
            dc[:] = 0
            ds[:] = 0
            continue
        for k in range(values):
            dc[k] = span[at + np.uint64(k)]
        at += np.uint64(values)
        for k in range(blocks):
            ds[k] = span[at + np.uint64(k)]


# ---- through a staging read -------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def plan_window(ids, offsets, first, width, n, v0, v1, col_head, num_heads):
    """Where each of ``n`` slots is read from, for a source that reads ``[M, H]`` per-head ids
    (EngramStore.lookup_into). Returns (store_ids int64 [M, H], src int64 [n]): src is the staging row
    ``m * H + h`` of slot i, -1 for zeros (ids outside [v0, v1), -1).

    Slot ``i = t * width + j`` holds ``ids[t * cols + first + j]`` (-1 past the last column), whose own column is
    ``first + j``. col_head int64 [cols]: the EngramStore head holding column c (-1: none; every column an id of
    the window lies in is held). An id in its own column is read at its token's ``m = t``, so a whole step's rows
    land in slot order; ids of another column are read in rows after the first ``ceil(n / width)``; unused
    entries read row 0 (once per head, for nothing). The slots are walked token by token (no division a slot: at a
    decode step's 1,536 slots the divisions were a third of the plan)."""
    cols = offsets.shape[0] - 1
    T = -(-n // width)
    extra = np.zeros(num_heads, dtype=np.int64)
    for t in range(T):  # first pass: how many rows of other columns each head reads
        for j in range(min(width, n - t * width)):
            c = first + j
            g = ids[t * cols + c] if c < cols else -1
            if v0 <= g < v1:
                home = column_of(g, c, offsets)
                if home != c:
                    extra[col_head[home]] += 1
    store_ids = np.zeros((max(T + extra.max(), 1), num_heads), dtype=np.int64)
    src = np.empty(n, dtype=np.int64)
    extra[:] = 0
    for t in range(T):
        for j in range(min(width, n - t * width)):
            i, c = t * width + j, first + j
            g = ids[t * cols + c] if c < cols else -1
            if not v0 <= g < v1:
                src[i] = -1
                continue
            home = column_of(g, c, offsets)
            h = col_head[home]
            m = t
            if home != c:
                m = T + extra[h]
                extra[h] += 1
            store_ids[m, h] = g - offsets[home]
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
def scaled_from_staging(staged, src, lut, out):
    """The scaled form (out uint16 [N, values], lut uint16 [256, 256]) from ``staged[src[i]]``, zeros where src is
    -1."""
    blocks = staged.shape[1] - out.shape[1]
    for i in range(src.shape[0]):
        if src[i] < 0:
            out[i, :] = 0
        else:
            scaled_row(staged[src[i]], np.uint64(0), out[i], lut, blocks)


@njit(cache=True, nogil=True)
def split_from_staging(staged, src, codes, scales):
    """The split form (codes [N, values], scales [N, blocks]) from ``staged[src[i]]``, zeros where src is -1."""
    values, blocks = codes.shape[1], scales.shape[1]
    for i in range(src.shape[0]):
        r = src[i]
        if r < 0:
            codes[i, :] = 0
            scales[i, :] = 0
            continue
        row = staged[r]
        for k in range(values):
            codes[i, k] = row[k]
        for k in range(blocks):
            scales[i, k] = row[values + k]


@njit(cache=True, nogil=True)
def zero_slots(src, out):
    """Zero the slots of out [N, width] whose src is -1 (rows read straight into out in slot order)."""
    for i in range(src.shape[0]):
        if src[i] < 0:
            out[i, :] = 0
