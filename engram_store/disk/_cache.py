"""The hot-row cache: a bounded, set-associative cache of rows in memory, shared by layers and threads.

7 ways a set, CLOCK eviction within the set, and (by default) a doorkeeper in front of eviction: a row read from
disk takes a free way at once, but displaces a cached row only on its second miss within a window as long as the
cache. On Zipfian N-gram streams this keeps one-off rows from pushing hot ones out (``bench/bench_disk.py``
measures it against the direct-mapped cache and plain CLOCK). Lookups take no lock (see ``_kernels``); fills
are serialised by one lock and do not block lookups.
"""
from __future__ import annotations

import threading

import numpy as np

from .._errors import InvalidArgument, describe
from . import _kernels as k
from ._files import aligned_empty

LINE_BYTES = 64

ADMISSIONS = {"always": k.ADMIT_ALWAYS, "doorkeeper": k.ADMIT_DOORKEEPER}


class RowCache:
    """At most ``capacity_bytes`` of cached rows (keys and policy state included) of ``row_bytes`` bytes each.

    Pass one to several :class:`DiskLayer` objects to share it: each layer gets its own tag, so keys never mix.
    ``admission``: ``"doorkeeper"`` (default) or ``"always"`` (every missed row evicts the CLOCK victim).
    """

    def __init__(self, capacity_bytes: int, row_bytes: int, admission: str = "doorkeeper"):
        if isinstance(row_bytes, bool) or not isinstance(row_bytes, (int, np.integer)) or row_bytes <= 0:
            raise InvalidArgument(f"row_bytes: expected an int > 0, got {describe(row_bytes)}")
        if admission not in ADMISSIONS:
            raise InvalidArgument(f"admission: expected one of {sorted(ADMISSIONS)}, got {describe(admission)}")
        row_bytes = int(row_bytes)
        # per set: the rows, the metadata line, the CLOCK hand, one byte of doorkeeper bits per way (the
        # doorkeeper's floor of 512 bytes is not counted)
        per_set = k.WAYS * row_bytes + k.META_WORDS * 8 + 1 + k.WAYS
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, (int, np.integer)) \
                or capacity_bytes < per_set:
            raise InvalidArgument(f"capacity_bytes: expected a byte count >= {per_set} (one set of {k.WAYS} rows of "
                                  f"{row_bytes} bytes), got {describe(capacity_bytes)}")
        self.row_bytes = row_bytes
        self.admission = admission
        self.n_sets = int(capacity_bytes) // per_set
        if self.n_sets >= 1 << 32:
            raise InvalidArgument(f"capacity_bytes: expected at most {((1 << 32) - 1) * per_set} bytes "
                                  f"(2**32 - 1 sets), got {capacity_bytes}")
        # each set's metadata on one cache line of its own, and rows from a line's start: a probe reads one
        # line of keys, not two
        self.meta = aligned_empty(self.n_sets * k.META_WORDS * 8, LINE_BYTES).view(np.int64)
        self.meta[:] = -1
        self.meta[::k.META_WORDS] = 0
        self.hands = np.zeros(self.n_sets, dtype=np.uint8)
        # committed now (written once): fills land on random sets, and in memory not yet touched each would fault
        # in a page (2 MiB with transparent huge pages) while a lookup waits; a large cache takes seconds here
        self.rows = aligned_empty(self.n_sets * k.WAYS * row_bytes, LINE_BYTES)
        self.rows.fill(0)
        door_words = max(64, self.n_sets * k.WAYS // 8)  # 8 bits a row: few false positives
        self.door = np.zeros(door_words, dtype=np.uint64)
        self.door_state = np.array([0, self.capacity_rows], dtype=np.int64)
        self.lock = threading.Lock()  # held by fills only
        self._tags = 0
        self._tag_lock = threading.Lock()

    @property
    def capacity_rows(self) -> int:
        return self.n_sets * k.WAYS

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes + self.hands.nbytes + self.rows.nbytes + self.door.nbytes

    def new_tag(self, row_bytes: int) -> int:
        """A tag for one more layer's keys (a layer asks once, when it opens)."""
        if row_bytes != self.row_bytes:
            raise InvalidArgument(f"cache: expected layers of row_bytes={self.row_bytes} (the cache's), "
                                  f"got a layer of row_bytes={row_bytes}")
        with self._tag_lock:
            if self._tags >= k.MAX_TAG:
                raise InvalidArgument(f"cache: at most {k.MAX_TAG} layers can share one cache")
            self._tags += 1
            return self._tags

    def fill(self, miss_key: np.ndarray, miss_pos: np.ndarray, out: np.ndarray) -> int:
        """Offer the rows just read (``out[miss_pos[i] * row_bytes:]`` under key ``miss_key[i]``); returns how
        many were inserted."""
        with self.lock:
            return int(k._cache_fill(self.meta, self.hands, self.rows, self.row_bytes, miss_key, miss_pos, out,
                                     self.row_bytes, ADMISSIONS[self.admission], self.door, self.door_state))

    def held(self) -> int:
        """Rows cached now."""
        tags = self.meta.reshape(-1, k.META_WORDS)[:, 1:]
        return int(np.count_nonzero(tags != -1))

    def clear(self) -> None:
        with self.lock:
            meta = self.meta.reshape(-1, k.META_WORDS)
            meta[:, 0] += k.BUSY  # readers that raced this see the version move and re-read from disk
            meta[:, 1:] = -1
            meta[:, 0] = (meta[:, 0] + k.BUSY) & ~k.REF_MASK
            self.door[:] = 0
            self.door_state[0] = 0

    def __repr__(self) -> str:
        return (f"RowCache({self.capacity_rows} rows of {self.row_bytes} B, {self.nbytes / 2**20:.1f} MiB, "
                f"admission={self.admission!r})")
