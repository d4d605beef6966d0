"""The check a segment makes before it serves a read: the objects the reader names are still the ones there.

A read may lead with *checks*, two pairs per object the reader expects, told apart from ranges by their negative
offsets: ``(-(base + 1), generation)`` and ``(-(size + 1), generation)``: the object's place in the segment, its
size, and the id of the put that wrote it, as the master said. The segment knows from each write's ticket which
put wrote which range (``engram_store.segment._generations``: non-overlapping entries, the latest writer of each
byte). A check passes when every entry that meets the object's bytes is that very object: a put that wrote any of
them since means the reader's placement is stale, and it gets no byte.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from ..errors import InvalidType


@njit(cache=True, nogil=True)
def _check_generations(pairs, bases, sizes, gens):
    # bases/sizes/gens: the segment's entries, sorted by base, not overlapping. Returns (check rows, bad check).
    R = pairs.shape[0]
    K = 0
    while K < R and pairs[K, 0] < 0:
        K += 1
    if K % 2:
        return K, K // 2  # malformed: a check without its size
    n = bases.shape[0]
    for k in range(K // 2):
        base = -pairs[2 * k, 0] - 1
        gen = pairs[2 * k, 1]
        size = -pairs[2 * k + 1, 0] - 1
        end = base + size
        lo, hi = 0, n
        while lo < hi:  # the first entry starting at or past the object's end
            mid = (lo + hi) >> 1
            if bases[mid] < end:
                lo = mid + 1
            else:
                hi = mid
        i = lo - 1
        while i >= 0 and bases[i] + sizes[i] > base:  # every entry that meets [base, end)
            if bases[i] != base or sizes[i] != size or gens[i] != gen:
                return K, k
            i -= 1
    return K, -1


def check_generations(pairs: np.ndarray, bases: np.ndarray, sizes: np.ndarray, gens: np.ndarray) -> tuple[int, int]:
    """``(rows, bad)`` for a read's ``pairs`` (int64 ``[R, 2]``): how many leading pairs are checks, and the index of
    the first check whose object another put has written over since, or -1. ``bases``, ``sizes``, ``gens`` (int64)
    are the segment's entries, sorted by base and not overlapping."""
    if pairs.dtype != np.int64 or pairs.ndim != 2 or pairs.shape[1] != 2:
        raise InvalidType(f"pairs: expected int64 [R, 2], got {pairs.dtype} {pairs.shape}")
    if pairs.shape[0] == 0 or pairs[0, 0] >= 0:
        return 0, -1  # no checks
    k, bad = _check_generations(pairs, bases, sizes, gens)
    return int(k), int(bad)


def check_pairs_for(bases: np.ndarray, sizes: np.ndarray, generations: np.ndarray) -> np.ndarray:
    """The leading check pairs a reader sends for objects at ``bases`` of ``sizes`` bytes written by puts
    ``generations`` (int64, equal lengths; objects whose generation is unknown, 0, are not checked)."""
    known = np.flatnonzero(generations != 0)
    checks = np.empty((2 * known.size, 2), dtype=np.int64)
    checks[0::2, 0] = -bases[known] - 1
    checks[1::2, 0] = -sizes[known] - 1
    checks[0::2, 1] = checks[1::2, 1] = generations[known]
    return checks
