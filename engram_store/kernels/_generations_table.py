"""The generation table a segment publishes in shared memory, for readers on its host that map its bytes.

Layout (int64 words): ``[seq, count, capacity, overflow, retired, 0, 0, 0]``, then ``capacity`` bases,
``capacity`` sizes and ``capacity`` generations, the first ``count`` of each in use (sorted by base, not
overlapping, as ``engram_store.segment._generations`` keeps them). ``retired`` is set on a table its segment no
longer keeps (it made a new file in its place): a reader that still maps it can tell nothing from it, and maps the
file anew. The segment bumps ``seq`` to an odd value before it changes
the arrays and to the next even value after (a seqlock): a reader checks the objects it names against one even
``seq``, gathers its rows, and reads ``seq`` again; the same value means no put claimed a range meanwhile (a put
claims its range before its first byte lands), so the rows it gathered are the named objects' own.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._generations import _check_generations
from ..errors import InvalidType

HEADER_WORDS = 8
SEQ, COUNT, CAPACITY, OVERFLOW, RETIRED = range(5)
#: check_table's answers besides a check's index: all named objects are there, or the table cannot tell now.
HOLDS = -1
UNKNOWN = -2


def table_words(capacity: int) -> int:
    return HEADER_WORDS + 3 * capacity


def header_problem(table: np.ndarray) -> str:
    """What is wrong with the header of a mapped generation ``table`` (int64 words), or "" when its capacity
    agrees with its size: a reader must never take a capacity or count from it that reaches past the mapping."""
    if table.size < HEADER_WORDS:
        return f"{table.size * 8} bytes, less than its {HEADER_WORDS * 8}-byte header"
    capacity, count = int(table[CAPACITY]), int(table[COUNT])
    if capacity < 0 or table_words(capacity) != table.size:
        return (f"its header says capacity {capacity} ({table_words(capacity) * 8} bytes with the header), but it "
                f"is {table.size * 8} bytes")
    if not 0 <= count <= capacity:
        return f"its header says {count} entries, outside its capacity {capacity}"
    return ""


@njit(cache=True, nogil=True)
def _check_table(table, checks):
    # (bad, seq): bad is HOLDS, the index of a failing check, or UNKNOWN (being written, or overflowed).
    for _ in range(1000):  # a writer holds the odd value for a few microseconds
        seq = table[SEQ]
        if seq & 1:
            continue
        if table[OVERFLOW] or table[RETIRED]:
            return UNKNOWN, seq
        n = table[COUNT]
        cap = table[CAPACITY]
        if n < 0 or n > cap or cap > (table.size - HEADER_WORDS) // 3:
            return UNKNOWN, seq  # a header that disagrees with the mapped size is never read past
        base = HEADER_WORDS
        _, bad = _check_generations(checks, table[base:base + n], table[base + cap:base + cap + n],
                                    table[base + 2 * cap:base + 2 * cap + n])
        if table[SEQ] == seq:
            return bad, seq
    return UNKNOWN, -1


def check_table(table: np.ndarray, checks: np.ndarray) -> tuple[int, int]:
    """``(bad, seq)`` for ``checks`` (pairs as ``kernels.check_pairs_for`` makes them) against a segment's
    published ``table`` (int64, read-only): ``bad`` is HOLDS (-1) when every named object is there, the index of
    the first that another put has written over, or UNKNOWN (-2) when the table cannot tell (it overflowed, or
was retired);
    ``seq`` is what to compare after the gather (``table[0]``)."""
    if table.dtype != np.int64 or table.ndim != 1 or table.size < HEADER_WORDS:
        raise InvalidType(f"table: expected an int64 generation table, got {table.dtype} {table.shape}")
    if checks.dtype != np.int64 or checks.ndim != 2 or checks.shape[1] != 2:
        raise InvalidType(f"checks: expected int64 [2K, 2], got {checks.dtype} {checks.shape}")
    bad, seq = _check_table(table, checks)
    return int(bad), int(seq)
