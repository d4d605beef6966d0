"""Reference caches for ``bench_cache_policy.py``: an exact LRU and the first-touch bound, over a row stream.

A stream is ``keys`` int64 ``[T, C]``: at step t (one token) the C columns' rows, already made dense
(``0 <= key < n_keys``). Lookups go out a batch of ``batch`` tokens at a time, as a serving step's do: a row
missed twice in one batch misses twice (the cache is filled after the batch's reads), whatever the policy.
Hits are counted from token ``start`` on, per column. Tested against ``collections.OrderedDict`` in
``tests/disk/test_cache_policy_sim.py``.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def lru_hits(keys, n_keys, capacity, batch, start):
    """Per-column hits of an exact LRU of ``capacity`` rows (a doubly linked list over dense keys)."""
    T, C = keys.shape
    prev = np.full(n_keys, -1, np.int64)
    nxt = np.full(n_keys, -1, np.int64)
    held = np.zeros(n_keys, np.bool_)
    head = -1
    tail = -1
    size = 0
    hits = np.zeros(C, np.int64)
    pending = np.empty(batch * C, np.int64)
    for a in range(0, T, batch):
        b = min(a + batch, T)
        n_pending = 0
        for t in range(a, b):
            for c in range(C):
                x = keys[t, c]
                if held[x]:
                    if t >= start:
                        hits[c] += 1
                    if head != x:  # move to the front
                        p = prev[x]
                        q = nxt[x]
                        nxt[p] = q
                        if q >= 0:
                            prev[q] = p
                        else:
                            tail = p
                        prev[x] = -1
                        nxt[x] = head
                        prev[head] = x
                        head = x
                else:
                    pending[n_pending] = x
                    n_pending += 1
        for i in range(n_pending):
            x = pending[i]
            if held[x] or capacity == 0:
                continue
            if size == capacity:  # evict the tail
                v = tail
                tail = prev[v]
                nxt[tail] = -1
                held[v] = False
                size -= 1
                if tail < 0:
                    head = -1
            held[x] = True
            prev[x] = -1
            nxt[x] = head
            if head >= 0:
                prev[head] = x
            head = x
            if tail < 0:
                tail = x
            size += 1
    return hits


@njit(cache=True, nogil=True)
def first_touch_hits(keys, n_keys, start, seen_before):
    """Per-column lookups from token ``start`` on whose row was looked up before (at or after token
    ``seen_before``): what a cache of unbounded size could hit. A first touch always misses."""
    T, C = keys.shape
    seen = np.zeros(n_keys, np.bool_)
    hits = np.zeros(C, np.int64)
    for t in range(seen_before, T):
        for c in range(C):
            x = keys[t, c]
            if seen[x]:
                if t >= start:
                    hits[c] += 1
            else:
                seen[x] = True
    return hits
