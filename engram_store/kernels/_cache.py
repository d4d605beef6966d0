"""The hot-row cache: a direct-mapped cache of rows.

``cache_keys[slot]`` holds the key (head << 40 | row) of the row stored in ``cache_rows[slot]`` (rows seen as
words), -1 when empty. A key's slot comes from a multiplicative hash, so hot rows of a Zipfian stream rarely evict
each other.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._common import _int64_1d, readonly
from ..errors import InvalidArgument

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
        raise InvalidArgument(f"rows / out_rows: expected rows like the cache's {cache_rows.shape[1:]} {cache_rows.dtype}, "
                         f"got {rows.shape} {rows.dtype} and {out_rows.shape} {out_rows.dtype}")
    if positions.size and (positions.min() < 0 or positions.max() >= min(keys.size, out_rows.shape[0])):
        raise InvalidArgument("positions: an index lies outside keys or out_rows")
    _cache_fill(readonly(keys), readonly(positions), readonly(rows), out_rows, cache_keys, cache_rows)


def cache_probe(keys: np.ndarray, cache_keys: np.ndarray, cache_rows: np.ndarray,
                out_rows: np.ndarray) -> tuple[np.ndarray, int]:
    """Copy the cached rows of ``keys`` into ``out_rows``; returns (hit mask, hit count)."""
    keys = _int64_1d(keys, "keys")
    if out_rows.shape[0] != keys.size or out_rows.shape[1:] != cache_rows.shape[1:] \
            or out_rows.dtype != cache_rows.dtype:
        raise InvalidArgument(f"out_rows: expected {keys.size} rows like the cache's {cache_rows.shape[1:]} "
                         f"{cache_rows.dtype}, got {out_rows.shape} {out_rows.dtype}")
    hit, hits = _cache_probe(readonly(keys), cache_keys, cache_rows, out_rows)
    return hit, int(hits)


def cache_insert(keys: np.ndarray, rows: np.ndarray, cache_keys: np.ndarray, cache_rows: np.ndarray) -> None:
    """Store ``rows`` under ``keys``, each in its slot (replacing whatever was there)."""
    keys = _int64_1d(keys, "keys")
    if rows.shape[0] != keys.size or rows.shape[1:] != cache_rows.shape[1:] or rows.dtype != cache_rows.dtype:
        raise InvalidArgument(f"rows: expected {keys.size} rows like the cache's {cache_rows.shape[1:]} "
                         f"{cache_rows.dtype}, got {rows.shape} {rows.dtype}")
    _cache_insert(readonly(keys), readonly(rows), cache_keys, cache_rows)
