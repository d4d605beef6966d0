"""The hit rate at every cache size, from live traffic: a miss-ratio curve kept beside the hot-row cache.

An operator sizing ``row_cache_bytes`` wants the hit rate of every size, not only of the one running. An LRU
cache of S rows hits an access iff fewer than S other rows were touched since the row's last touch (its stack
distance; Mattson et al., 1970), so one pass over the stream gives every size at once. Tracking every row of a
100 GB layer would cost more than the cache; SHARDS (Waldspurger et al., FAST 2015) tracks a spatially hashed
sample instead: the rows whose hash falls under a threshold, every touch of them, with distances scaled by the
sampling rate. At most ``max_keys`` rows are tracked (the rate halves when more would be), so the cost is
bounded whatever the layer: memory ~40 bytes a tracked row, and on the lookup path a hash a row looked up and a
stack update a sampled one (``_mrc_kernels``).

The cache itself is set-associative with CLOCK eviction, not an LRU; on n-gram traffic the two hit within a
fraction of a point of each other (``bench/bench_cache_policy.py``), so the curve predicts the cache.

:func:`shards_twin` is the same algorithm in plain Python (an ``OrderedDict`` stack, distances counted by
position), which the tests hold the kernels to.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np

from ..errors import InvalidArgument, describe, is_int
from . import _mrc_kernels as mk
from ._cache import per_set_bytes
from ._kernels import WAYS

#: The sizes ``EngramStore.stats()`` reports, as shares of the rows the cache serves (0.1% .. 100%).
SIZE_LADDER = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
#: Rows tracked at most: 32k rows keep ~40 sampled rows under a cache of 0.1% of a layer they fill, and cost
#: 2.5 MiB (the table, the tree and a histogram per column).
DEFAULT_MAX_KEYS = 1 << 13
_NO_BUF = np.zeros(3, dtype=np.int64)  # a buffer with no room and threshold 0: collects nothing


def bytes_for_rows(rows: int, row_bytes: int) -> int:
    """The ``row_cache_bytes`` of a cache holding ``rows`` rows of ``row_bytes`` (whole sets of 7 ways, each with
    its metadata)."""
    return -(-int(rows) // WAYS) * per_set_bytes(row_bytes)


def _geometry(max_keys: int) -> tuple[int, int]:
    """The table's slots (load <= 1/2) and the times before a rebuild (~3 * max_keys touches) of a stack."""
    slots = 1 << int(2 * (max_keys + 1) - 1).bit_length()
    return slots, -(-(4 * max_keys + 2) // mk.TIME_QUANTUM) * mk.TIME_QUANTUM


def state_words(max_keys: int) -> int:
    """The int64 words of a stack's state (laid out in ``_mrc_kernels``)."""
    slots, times = _geometry(max_keys)
    return mk.N_SCALARS + 2 * slots + times // 64 + times // mk.TIME_QUANTUM


def new_state(max_keys: int) -> np.ndarray:
    """An empty stack tracking at most ``max_keys`` rows, every row sampled until there are more."""
    slots, times = _geometry(max_keys)
    state = np.zeros(state_words(max_keys), dtype=np.int64)
    state[[mk.THRESHOLD, mk.NOW, mk.MAX_KEYS, mk.SLOTS, mk.TIMES]] = [mk.FULL, 1, max_keys, slots, times]
    state[mk.N_SCALARS:mk.N_SCALARS + 2 * slots:2] = -1  # every key slot empty
    return state


class MissRatioCurve:
    """A sampled LRU stack over row keys (``(tag << 40) | row``) and the weight of its distances per column.
    Thread-safe. Columns are added as layers arrive (:meth:`add_columns`)."""

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS):
        if not is_int(max_keys) or not 1 <= max_keys <= 1 << 30:
            raise InvalidArgument(f"max_keys: expected an int in [1, 2**30], got {describe(max_keys)}")
        self.lock = threading.Lock()
        self.state = new_state(max_keys)
        self.scal = self.state[:mk.N_SCALARS]
        self.hist = np.zeros((0, mk.N_BINS + 1), dtype=np.float64)

    @property
    def columns(self) -> int:
        return self.hist.shape[0]

    @property
    def rate(self) -> float:
        """The share of rows sampled now."""
        return float(self.scal[mk.THRESHOLD]) / float(mk.FULL)

    def add_columns(self, n: int) -> int:
        """Room for ``n`` more columns (a layer's heads); returns the first one's index."""
        with self.lock:
            first = self.hist.shape[0]
            self.hist = np.concatenate([self.hist, np.zeros((n, mk.N_BINS + 1))])
            return first

    def observe(self, ids: np.ndarray, row_base: np.ndarray, tag: int, col0: int, buf: np.ndarray = _NO_BUF) -> None:
        """Replay one lookup (``ids`` int64 ``[M, H]``, head h's rows from ``row_base[h]``, in columns ``col0 +
        h``); ``buf`` (see ``_mrc_kernels.observe``) also collects the rows sampled at its threshold."""
        with self.lock:
            mk.observe(ids, row_base, tag, col0, self.state, self.hist, buf)

    def replay(self, keys: np.ndarray, cols: np.ndarray, col_map: np.ndarray) -> None:
        """Replay collected accesses, column ``cols[i]`` counted as ``col_map[cols[i]]`` (-1: not counted)."""
        with self.lock:
            mk.replay(keys, cols, col_map, self.state, self.hist)

    def hits(self, cols: Sequence[int], sizes: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
        """(estimated hits ``[len(cols), len(sizes)]`` of an LRU of each size in rows, rows looked up per column)."""
        cols_a = np.asarray(cols, dtype=np.int64)
        out = np.zeros((cols_a.size, len(sizes)), dtype=np.float64)
        with self.lock:
            mk.hits_at(self.hist, cols_a, np.asarray(sizes, dtype=np.float64), out)
            looked = self.hist[cols_a, mk.LOOKED].astype(np.int64)
        return out, looked

    def reset(self, cols: Sequence[int] | None = None) -> None:
        """Zero the counts (of ``cols``, or all); the stack is kept, as the cache keeps its rows."""
        with self.lock:
            self.hist[slice(None) if cols is None else np.asarray(cols, dtype=np.int64)] = 0.0

    def stats(self) -> dict[str, float]:
        """The sample's state: ``rate``, ``tracked_rows``, ``rebuilds``, ``rate_drops``."""
        return {"rate": self.rate, "tracked_rows": int(self.scal[mk.KEYS]), "rebuilds": int(self.scal[mk.REBUILDS]),
                "rate_drops": int(self.scal[mk.RATE_DROPS])}


# ---- the twin ---------------------------------------------------------------------------------------------------

def sample_hash_twin(key: int) -> int:
    """``_mrc_kernels.sample_hash`` in plain Python."""
    u = int(key) & 0xFFFF_FFFF_FFFF_FFFF
    x = ((u & 0xFFFFFFFF) ^ (((u >> 32) * 0x9E3779B1) & 0xFFFFFFFF)) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def distance_bin_twin(distance: float) -> int:
    """``_mrc_kernels.distance_bin``: 8 equal bins an octave."""
    if distance < 1.0:
        return 0
    mantissa, exponent = math.frexp(distance)  # distance = mantissa * 2**exponent, 0.5 <= mantissa < 1
    return min(1 + (exponent - 1) * mk.BINS_PER_OCTAVE + int((2 * mantissa - 1) * mk.BINS_PER_OCTAVE),
               mk.N_BINS - 2)


def shards_twin(keys: Sequence[int], cols: Sequence[int], n_cols: int, max_keys: int,
                threshold: int = int(mk.FULL)) -> tuple[np.ndarray, int]:
    """The kernels' histogram of the access stream ``keys`` (column ``cols[i]``), computed with an exact LRU
    stack of the sampled keys: (hist ``[n_cols, N_BINS]``, the final threshold)."""
    hist = np.zeros((n_cols, mk.N_BINS + 1), dtype=np.float64)
    stack: OrderedDict[int, None] = OrderedDict()  # least recent first
    for key, col in zip(keys, cols):
        key = int(key)
        if sample_hash_twin(key) >= threshold:
            continue
        scale = float(mk.FULL) / float(threshold)
        if key in stack:
            order = list(stack)
            distance = len(order) - 1 - order.index(key)  # keys touched since
            stack.move_to_end(key)
            hist[col, distance_bin_twin(distance * scale)] += scale
        else:
            stack[key] = None
            hist[col, mk.COLD] += scale
        while len(stack) > max_keys:
            threshold //= 2
            stack = OrderedDict((k, None) for k in stack if sample_hash_twin(k) < threshold)
    return hist, threshold
