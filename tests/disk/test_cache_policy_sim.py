"""The reference caches of bench/bench_cache_policy.py against plain Python (an OrderedDict LRU, a set)."""
from __future__ import annotations

import os
import sys
from collections import OrderedDict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from _policy import first_touch_hits, lru_hits  # noqa: E402


def lru_reference(keys, capacity, batch, start):
    T, C = keys.shape
    cache, hits = OrderedDict(), np.zeros(C, np.int64)
    for a in range(0, T, batch):
        missed = []
        for t in range(a, min(a + batch, T)):
            for c in range(C):
                x = int(keys[t, c])
                if x in cache:
                    cache.move_to_end(x)
                    hits[c] += t >= start
                else:
                    missed.append(x)
        for x in missed:  # filled after the batch's reads
            if x in cache or capacity == 0:
                continue
            if len(cache) == capacity:
                cache.popitem(last=False)
            cache[x] = True
    return hits


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32), capacity=st.integers(0, 12), batch=st.integers(1, 5), C=st.integers(1, 3))
def test_lru_hits_equal_an_ordered_dict_lru(seed, capacity, batch, C):
    rng = np.random.default_rng(seed)
    T = int(rng.integers(1, 60))
    keys = rng.integers(0, 20, (T, C)).astype(np.int64)
    start = int(rng.integers(0, T))
    np.testing.assert_array_equal(lru_hits(keys, 20, capacity, batch, start), lru_reference(keys, capacity, batch,
                                                                                             start))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_first_touch_hits_count_every_lookup_of_a_row_seen_before(seed):
    rng = np.random.default_rng(seed)
    T, C = int(rng.integers(1, 60)), int(rng.integers(1, 4))
    keys = rng.integers(0, 30, (T, C)).astype(np.int64)
    start = int(rng.integers(0, T))
    since = int(rng.integers(0, start + 1))
    seen, want = set(), np.zeros(C, np.int64)
    for t in range(since, T):
        for c in range(C):
            x = int(keys[t, c])
            want[c] += t >= start and x in seen
            seen.add(x)
    np.testing.assert_array_equal(first_touch_hits(keys, 30, start, since), want)
