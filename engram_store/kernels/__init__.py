"""Numba kernels for the hot paths, by topic: row planning and byte ranges (``_planning``), gathers and scatters
(``_gather``), sorting (``_sort``), the hot-row cache (``_cache``), the generation checks of reads
(``_generations``, ``_generations_table``), the raw read channel's round trips (``raw_io``).

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

Row-planning vocabulary, shared with ``engram_store.tables``:

* ``ids`` is an ``int64 [M, H]`` array: M token positions (B x L flattened), H heads.
* ``heads`` / ``order`` is an ``int64 [K]`` list of head indices to work on, in the order their rows are laid out.
* ``uniq`` holds, for each listed head in turn, the sorted distinct row ids of that head; ``head_starts[j]`` is
  where listed head ``j`` begins in ``uniq`` (``head_starts[K] == uniq.size``).
* ``inverse[m, h]`` is the position in ``uniq`` of row ``ids[m, h]`` (``-1`` for heads not listed).
* ``pairs`` is an ``int64 [R, 2]`` array of byte ranges ``(offset, length)``: the wire form of a range read.
"""
from __future__ import annotations

import numpy as np

from ._cache import cache_fill, cache_insert, cache_probe
from ._common import _UINT, PREFETCH_ROWS, readonly, word_shift
from ._generations import check_generations, check_pairs_for
from . import _generations_table as generation_table
from ._generations_table import UNKNOWN as TABLE_UNKNOWN
from ._generations_table import check_table
from ._gather import (
    RowSource,
    gather_pairs,
    gather_pairs_unchecked,
    gather_ranges,
    gather_rows,
    gather_rows_local,
    narrower,
    row_source,
    scatter_ranges,
    scatter_rows,
    scatter_rows_prepared,
)
from ._planning import (
    ReadPlan,
    check_pairs,
    check_ranges,
    direct_pairs,
    first_bad_row,
    plan_pieces,
    plan_reads,
    plan_unique_rows,
    rows_to_ranges,
)
from . import raw_io
from .raw_io import RAW_IO, SERVER_STATE_WORDS, direct_read_plan, read_direct, serve_params, serve_read

# The kernels themselves, for hot paths that validated their arguments once already (and for other kernels):
# every one of them trusts its caller, as its checked wrapper above does not.
from ._common import _prefetch as prefetch_hint  # noqa: E402  (an intrinsic: usable inside @njit kernels)
from ._gather import _gather_rows as gather_rows_unchecked  # noqa: E402
from ._gather import _scatter_rows as scatter_rows_unchecked  # noqa: E402
from ._planning import _direct_pairs as direct_pairs_unchecked  # noqa: E402
from ._planning import _first_bad_row as first_bad_row_unchecked  # noqa: E402
from ._planning import _plan_reads as plan_reads_unchecked  # noqa: E402
from ._interrupts import defer_interrupts_while_compiling, make_interrupt_safe  # noqa: E402

make_interrupt_safe()  # a Ctrl-C while a kernel loads must not leave LLVM's lock held (see _interrupts)
defer_interrupts_while_compiling()  # nor break the next compile: a kernel compiles whole, then the interrupt comes

__all__ = [
    "PREFETCH_ROWS", "RAW_IO", "ReadPlan", "RowSource", "cache_fill", "cache_insert", "cache_probe",
    "check_generations", "check_pairs", "check_pairs_for", "check_table", "TABLE_UNKNOWN",
    "check_ranges", "direct_pairs", "direct_read_plan", "first_bad_row", "gather_pairs", "gather_pairs_unchecked",
    "gather_ranges", "gather_rows", "gather_rows_local", "narrower", "plan_pieces", "plan_reads", "plan_unique_rows",
    "read_direct", "readonly", "row_source", "rows_to_ranges", "scatter_ranges", "scatter_rows",
    "scatter_rows_prepared", "serve_params", "serve_read", "warmup", "word_shift",
    "direct_pairs_unchecked", "first_bad_row_unchecked", "gather_rows_unchecked", "plan_reads_unchecked",
    "prefetch_hint", "scatter_rows_unchecked", "generation_table", "raw_io",
]


def warmup(word_sizes: tuple[int, ...] = (8, 4, 2, 1), cache: bool = True) -> None:
    """Compile (or load from the on-disk cache) the kernels of every path, for every word size given.

    Nothing needs this: kernels compile on first use. It is for deployment images and CI, so the first real
    call of any path pays nothing (``python -m engram_store.warmup``). ``cache=False`` skips the hot-row cache.
    """
    ids = np.array([[0, 1], [1, 1]], dtype=np.int64)
    heads = np.array([0, 1], dtype=np.int64)
    named = check_pairs_for(np.zeros(1, np.int64), np.ones(1, np.int64), np.full(1, 7, np.int64))
    check_generations(named, np.zeros(1, np.int64), np.ones(1, np.int64), np.full(1, 7, np.int64))
    check_table(readonly(np.array([0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 7], dtype=np.int64)), named)
    first_bad_row(ids, np.array([2, 2], dtype=np.int64))
    check_ranges(np.zeros(1, np.int64), np.zeros(1, np.int64), 1)
    uniq, starts, inverse = plan_unique_rows(ids, heads)
    rows_to_ranges(uniq, starts, np.zeros(2, dtype=np.int64), 8)
    plan = plan_reads(ids, heads, np.zeros(2, dtype=np.int64), 8)
    direct_pairs(ids, heads, np.zeros(2, dtype=np.int64), 8)
    if RAW_IO:  # the raw channel's round trips, on no socket: each returns at its first check or call
        from .raw_io import client_buffer
        read_direct(-1, ids, direct_read_plan(heads, np.zeros(2, np.int64), named), 8, 1,
                    client_buffer(0, 0, 0, 1.0), np.zeros(32, dtype=np.uint8))
        serve_read(-1, -1, -1, 0, -1, np.zeros(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8),
                   readonly(np.zeros(64, dtype=np.uint8)), np.zeros(0, dtype=np.int64),
                   serve_params(0, 0, 1, 1, 1, 1, 1.0, 1), np.zeros(SERVER_STATE_WORDS, dtype=np.int64))
    for word in word_sizes:
        segment = np.zeros(64 * word, dtype=np.uint8)
        out = np.zeros(4 * word, dtype=np.uint8)
        pairs = np.array([[0, word], [8 * word, word]], dtype=np.int64)
        gather_pairs(segment, pairs, out, 2 * word)
        check_pairs(readonly(segment), pairs)  # the raw read server's pairs are writable
        gather_pairs_unchecked(readonly(segment), pairs, out[:2 * word])
        plan_pieces(pairs, 2 * word, word)
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
