"""The hot-row cache: a bounded, set-associative cache of rows in memory, shared by layers and threads.

7 ways a set, CLOCK eviction within the set, and an admission policy: ``"always"`` (a missed row evicts the
CLOCK victim) or ``"doorkeeper"`` (a row read from disk takes a free way at once, but displaces a cached row only
on its second miss within a window as long as the cache). The doorkeeper keeps one-off rows from pushing hot
ones out of Zipfian streams (``bench/bench_disk.py``); on real n-gram traffic, where most reuse is a document
repeating its own n-grams soon after, it costs 5-10 points of hit rate and ``"always"`` matches an LRU of the
same size (``bench/bench_cache_policy.py``). :meth:`RowCache.pin` warm-starts it: the most frequent rows of a
profile, pinned so that CLOCK passes them by. Lookups take no lock (see ``_kernels``); fills are serialised by
one lock and do not block lookups. :class:`~engram_store.disk.HostRowCache` is the same cache in shared memory,
one for every process of a host.
"""
from __future__ import annotations

import threading

import numpy as np

from ..errors import InvalidArgument, describe, is_int
from . import _cache_kernels as ck
from . import _kernels as k
from ._files import aligned_empty

LINE_BYTES = 64

ADMISSIONS = {"always": ck.ADMIT_ALWAYS, "doorkeeper": ck.ADMIT_DOORKEEPER}
#: At most this many of a set's 7 ways are pinned by a warm start: the others keep serving recent rows. On the
#: standard library's V4.1 traffic 2 beat an LRU at caches of 0.1%, 1% and 10% of the distinct rows, 3 and 4 only
#: at 10% (``bench/bench_cache_policy.py``).
MAX_PINNED_WAYS = 2


def per_set_bytes(row_bytes: int) -> int:
    """Bytes one set costs: its rows, the metadata line, the CLOCK hand, one byte of doorkeeper bits per way (the
    doorkeeper's floor of 512 bytes is not counted)."""
    return k.WAYS * row_bytes + k.META_WORDS * 8 + 1 + k.WAYS


def check_geometry(capacity_bytes: int, row_bytes: int, admission: str) -> int:
    """Validate a cache's arguments; returns its number of sets."""
    if not is_int(row_bytes) or row_bytes <= 0:
        raise InvalidArgument(f"row_bytes: expected an int > 0, got {describe(row_bytes)}")
    if admission not in ADMISSIONS:
        raise InvalidArgument(f"admission: expected one of {sorted(ADMISSIONS)}, got {describe(admission)}")
    per_set = per_set_bytes(int(row_bytes))
    if not is_int(capacity_bytes) \
            or capacity_bytes < per_set:
        raise InvalidArgument(f"capacity_bytes: expected a byte count >= {per_set} (one set of {k.WAYS} rows of "
                              f"{row_bytes} bytes), got {describe(capacity_bytes)}")
    n_sets = int(capacity_bytes) // per_set
    if n_sets >= 1 << 32:
        raise InvalidArgument(f"capacity_bytes: expected at most {((1 << 32) - 1) * per_set} bytes "
                              f"(2**32 - 1 sets), got {capacity_bytes}")
    return n_sets


def door_words(n_sets: int) -> int:
    return max(64, n_sets * k.WAYS // 8)  # 8 bits a row: few false positives


class RowCache:
    """At most ``capacity_bytes`` of cached rows (keys and policy state included) of ``row_bytes`` bytes each.

    Pass one to several :class:`DiskLayer` objects to share it: each layer gets its own tag, so keys never mix.
    ``admission``: ``"doorkeeper"`` (default) or ``"always"`` (every missed row evicts the CLOCK victim).
    """

    def __init__(self, capacity_bytes: int, row_bytes: int, admission: str = "doorkeeper"):
        self.n_sets = check_geometry(capacity_bytes, row_bytes, admission)
        self.row_bytes = int(row_bytes)
        self.admission = admission
        self.lock = threading.Lock()  # held by fills only
        self._tags = 0
        self._tag_lock = threading.Lock()
        self.stop_at = -1  # a test hook of the host cache (see HostRowCache)
        self._alloc()

    def _alloc(self) -> None:
        # each set's metadata on one cache line of its own, and rows from a line's start: a probe reads one
        # line of keys, not two
        self.meta = aligned_empty(self.n_sets * k.META_WORDS * 8, LINE_BYTES).view(np.int64)
        self.meta[:] = -1
        self.meta[::k.META_WORDS] = 0
        self.hands = np.zeros(self.n_sets, dtype=np.uint8)
        # committed now (written once): fills land on random sets, and in memory not yet touched each would fault
        # in a page (2 MiB with transparent huge pages) while a lookup waits; a large cache takes seconds here
        self.rows = aligned_empty(self.n_sets * k.WAYS * self.row_bytes, LINE_BYTES)
        self.rows.fill(0)
        self.door = np.zeros(door_words(self.n_sets), dtype=np.uint64)
        self.door_state = np.array([0, self.capacity_rows], dtype=np.int64)
        self.journal = np.full(1, -1, dtype=np.int64)  # the set a fill is changing (see _cache_kernels)

    @property
    def capacity_rows(self) -> int:
        return self.n_sets * k.WAYS

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes + self.hands.nbytes + self.rows.nbytes + self.door.nbytes

    def new_tag(self, row_bytes: int, identity: int = 0) -> int:
        """A tag for one more layer's keys (a layer asks once, when it opens). ``identity`` names the layer's
        published data (a host cache gives equal identities the same tag); a process's cache ignores it."""
        self._check_row_bytes(row_bytes)
        with self._tag_lock:
            if self._tags >= k.MAX_TAG:
                raise InvalidArgument(f"cache: at most {k.MAX_TAG} layers can share one cache")
            self._tags += 1
            return self._tags

    def _check_row_bytes(self, row_bytes: int) -> None:
        if row_bytes != self.row_bytes:
            raise InvalidArgument(f"cache: expected layers of row_bytes={self.row_bytes} (the cache's), "
                                  f"got a layer of row_bytes={row_bytes}")

    def fill(self, miss_key: np.ndarray, miss_pos: np.ndarray, out: np.ndarray) -> int:
        """Offer the rows just read (``out[miss_pos[i] * row_bytes:]`` under key ``miss_key[i]``); returns how
        many were inserted."""
        with self.lock:
            return self._fill_locked(miss_key, miss_pos, out)

    def _fill_locked(self, miss_key: np.ndarray, miss_pos: np.ndarray, out: np.ndarray) -> int:
        return int(ck._cache_fill(self.meta, self.hands, self.rows, self.row_bytes, miss_key, miss_pos, out,
                                  self.row_bytes, ADMISSIONS[self.admission], self.door, self.door_state,
                                  self.journal, self.stop_at))

    def pin(self, keys: np.ndarray, rows: np.ndarray, max_ways: int = MAX_PINNED_WAYS) -> int:
        """Cache and pin ``rows`` (flat, ``keys.size * row_bytes`` bytes) under ``keys``, most important first,
        at most ``max_ways`` pinned ways a set; returns how many were pinned (see :meth:`DiskLayer.warm`)."""
        if not is_int(max_ways) \
                or not 0 <= max_ways <= k.WAYS - 1:
            raise InvalidArgument(f"max_ways: expected an int in [0, {k.WAYS - 1}], got {describe(max_ways)}")
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        rows = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
        if rows.size != keys.size * self.row_bytes:
            raise InvalidArgument(f"rows: expected {keys.size} rows of {self.row_bytes} bytes "
                                  f"({keys.size * self.row_bytes} bytes), got {rows.size} bytes")
        with self.lock:
            return self._pin_locked(keys, rows, int(max_ways))

    def _pin_locked(self, keys: np.ndarray, rows: np.ndarray, max_ways: int) -> int:
        return int(ck._cache_pin(self.meta, self.hands, self.rows, self.row_bytes, keys, rows, self.row_bytes,
                                 max_ways, self.journal))

    def count(self, hits: int, misses: int) -> None:
        """Add a lookup's hits and misses to the cache's own counters (a process's cache keeps none)."""

    def held(self) -> int:
        """Rows cached now."""
        tags = self.meta.reshape(-1, k.META_WORDS)[:, 1:]
        return int(np.count_nonzero(tags != -1))

    def pinned(self) -> int:
        """Rows pinned now."""
        pins = (self.meta[::k.META_WORDS] >> k.PIN_SHIFT) & k.REF_MASK
        return int(np.unpackbits(pins.astype(np.uint8)).sum())

    def stats(self) -> dict[str, int]:
        """The cache's own state: ``capacity_rows``, ``held_rows``, ``pinned_rows``."""
        return {"capacity_rows": self.capacity_rows, "held_rows": self.held(), "pinned_rows": self.pinned()}

    def clear(self) -> None:
        with self.lock:
            meta = self.meta.reshape(-1, k.META_WORDS)
            meta[:, 0] += k.BUSY  # readers that raced this see the version move and re-read from disk
            meta[:, 1:] = -1
            meta[:, 0] = (meta[:, 0] + k.BUSY) & ~(k.REF_MASK | k.PIN_MASK)
            self.door[:] = 0
            self.door_state[0] = 0

    def close(self) -> None:
        """Nothing to release for a process's cache (its memory goes with the object)."""

    def __repr__(self) -> str:
        return (f"RowCache({self.capacity_rows} rows of {self.row_bytes} B, {self.nbytes / 2**20:.1f} MiB, "
                f"admission={self.admission!r})")
