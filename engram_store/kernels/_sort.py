"""Sorting row ids: a stable LSD radix sort of positions by value (insertion sort for short columns)."""
from __future__ import annotations

import numpy as np
from numba import njit


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
