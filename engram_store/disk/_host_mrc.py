"""The host cache's hit rate at every size: one sampled LRU stack in the cache's shared memory, fed by every
process that attaches.

A host cache serves the lookups of every worker together, so its curve is that of their interleaved stream: no
sum of per-process curves gives it (a row two workers share is reused sooner; a worker's own rows later, other
workers' lookups coming between). Each process collects the rows of its lookups that fall under the host curve's
sampling threshold (the same hash as its own curve, ``_mrc``) in a buffer of its own, and replays them into the
shared stack, a thousand at a time, under the cache's lock (``HostRowCache.locked``):

    region of the cache file (``REGION_BYTES``):
        header     [BUSY, RESETS, DROPPED, GENERATION, LAYERS, NEXT_COLUMN, -, -]   int64
        layers     MAX_LAYERS x (tag, first column, columns)                         int64
        state      a MissRatioCurve's state (``_mrc_kernels``), MAX_KEYS rows        int64
        hist       MAX_COLUMNS x (N_BINS + 1): weights by distance, rows looked up   float64

Why it holds, in the same spirit as the cache's own file:

* **One writer at a time**: a replay holds the cache's lock (the thread lock and the ``flock`` fills take); one
  that cannot take it at once keeps its rows for the next try, so no lookup waits for it. A buffer that fills
  meanwhile drops what does not fit and counts it (``DROPPED``).
* **A process killed mid-replay** leaves ``BUSY`` set; the next to take the lock starts the curve afresh (the
  stack, the columns, the counts; ``RESETS`` counts it, and ``GENERATION`` tells the processes to register their
  layers again). Statistics may be lost, never a row: nothing here is read by a lookup.
* **Layers are named by their tags**, which the cache gives every process alike for the same published data, so
  the rows of one layer count in one set of columns whichever process looked them up.

The interleaving is that of the replays, not of the lookups: a process's sampled rows arrive a replay late, which
moves a distance by at most that replay's rows (about 1,000 sampled rows, a million looked-up ones at a rate of
1/1024), against caches of millions of rows.
"""
from __future__ import annotations

import numpy as np

from . import _mrc_kernels as mk
from ._mrc import DEFAULT_MAX_KEYS, MissRatioCurve, new_state, state_words

BUSY, RESETS, DROPPED, GENERATION, LAYERS, NEXT_COLUMN = range(6)
HEADER_WORDS = 8
MAX_LAYERS = 64
MAX_COLUMNS = 256
#: Rows a process collects before it replays them, and at most.
FLUSH_AT = 1024
BUFFER_ROWS = 4096


STATE_WORDS = state_words(DEFAULT_MAX_KEYS)
REGION_BYTES = 8 * (HEADER_WORDS + 3 * MAX_LAYERS + STATE_WORDS) + 8 * MAX_COLUMNS * (mk.N_BINS + 1)


class HostCurve:
    """This process's side of a host cache's curve: its buffer, its layers' columns in the shared region."""

    def __init__(self, cache, lock_timeout_s: float = 1.0):
        words = cache.curve_region[:8 * (HEADER_WORDS + 3 * MAX_LAYERS + STATE_WORDS)].view(np.int64)
        self.cache = cache
        self.header = words[:HEADER_WORDS]
        self.layers = words[HEADER_WORDS:HEADER_WORDS + 3 * MAX_LAYERS].reshape(MAX_LAYERS, 3)
        self.state = words[HEADER_WORDS + 3 * MAX_LAYERS:]
        self.hist = cache.curve_region[words.nbytes:].view(np.float64).reshape(MAX_COLUMNS, mk.N_BINS + 1)
        self.buf = np.zeros(3 + 2 * BUFFER_ROWS, dtype=np.int64)  # [count, overflow, threshold, keys, cols]
        self._mine: dict[int, tuple[int, int]] = {}               # tag -> (this process's first column, columns)
        self._map = np.full(0, -1, dtype=np.int64)                 # this process's column -> the host's
        self._generation = -1
        self._flushed = np.zeros(0)                                # rows looked up, per column, already handed over
        self.flush(None, lock_timeout_s)                           # sets the threshold the buffer collects under

    def layer(self, tag: int, col0: int, columns: int) -> None:
        """This process counts layer ``tag`` in its columns ``col0 ..``."""
        self._mine[int(tag)] = (col0, columns)
        self._generation = -1  # register it at the next replay

    def after(self, process: MissRatioCurve) -> None:
        """After a lookup: replay the collected rows once there are enough (or learn the threshold to collect
        under, if that could not be read yet), if the lock is free now."""
        if self.buf[0] >= FLUSH_AT or not self.buf[2]:
            self.flush(process, 0.0)

    def flush(self, process: MissRatioCurve | None, timeout_s: float) -> bool:
        """Replay the collected rows and hand over the rows looked up since the last time; False if the lock
        was busy for ``timeout_s``."""
        with self.cache.locked(timeout_s) as held:
            if not held:
                return False
            if self.header[BUSY] or not self.state[mk.MAX_KEYS]:
                self._start_afresh()
            self.header[BUSY] = 1
            if self._generation != self.header[GENERATION]:
                self._register()
            if process is not None:
                with process.lock:  # the buffer and the counts the process's lookups write
                    n = int(self.buf[0])
                    mk.replay(self.buf[3:3 + n], self.buf[3 + BUFFER_ROWS:3 + BUFFER_ROWS + n], self._map,
                              self.state, self.hist)
                    self._hand_over_looked(process)
                    self.header[DROPPED] += self.buf[1]
                    self.buf[:2] = 0
            self.buf[2] = self.state[mk.THRESHOLD]
            self.header[BUSY] = 0
        return True

    def _start_afresh(self) -> None:
        resets = int(self.header[RESETS]) + (1 if self.header[BUSY] else 0)
        generation = int(self.header[GENERATION]) + 1
        self.header[:] = 0
        self.layers[:] = 0
        self.hist[:] = 0.0
        self.state[:] = new_state(DEFAULT_MAX_KEYS)
        self.header[RESETS], self.header[GENERATION] = resets, generation

    def _register(self) -> None:
        """Give each of this process's layers its columns in the region (found by tag, or taken anew)."""
        width = max((c0 + n for c0, n in self._mine.values()), default=0)
        self._map = np.full(width, -1, dtype=np.int64)
        if self._flushed.size < width:
            self._flushed = np.concatenate([self._flushed, np.zeros(width - self._flushed.size)])
        for tag, (col0, columns) in self._mine.items():
            first = self._columns_of(tag, columns)
            if first >= 0:
                self._map[col0:col0 + columns] = np.arange(first, first + columns)
        self._generation = int(self.header[GENERATION])

    def _columns_of(self, tag: int, columns: int) -> int:
        n = int(self.header[LAYERS])
        found = np.flatnonzero(self.layers[:n, 0] == tag)
        if found.size:
            return int(self.layers[found[0], 1])
        first = int(self.header[NEXT_COLUMN])
        if n >= MAX_LAYERS or first + columns > MAX_COLUMNS:
            return -1  # no room: this layer has no host curve (its rows still count in its process's)
        self.layers[n] = (tag, first, columns)
        self.header[NEXT_COLUMN] = first + columns
        self.header[LAYERS] = n + 1
        return first

    def _hand_over_looked(self, process: MissRatioCurve) -> None:
        looked = process.hist[:self._map.size, mk.LOOKED]
        delta = looked - self._flushed[:looked.size]
        delta[delta < 0] = looked[delta < 0]  # the process's counts were reset since
        keep = self._map[:looked.size] >= 0
        np.add.at(self.hist[:, mk.LOOKED], self._map[:looked.size][keep], delta[keep])
        self._flushed[:looked.size] = looked

    def hits(self, tag: int, sizes: np.ndarray, timeout_s: float) -> tuple[np.ndarray, np.ndarray] | None:
        """(estimated hits ``[columns, len(sizes)]`` of the host cache at each size, rows looked up per column) of
        layer ``tag``, every process together; None if the layer has no columns there."""
        with self.cache.locked(timeout_s) as held:
            if not held or self.header[BUSY]:
                return None
            n = int(self.header[LAYERS])
            found = np.flatnonzero(self.layers[:n, 0] == tag)
            if not found.size:
                return None
            _, first, columns = (int(x) for x in self.layers[found[0]])
            cols = np.arange(first, first + columns, dtype=np.int64)
            out = np.zeros((columns, len(sizes)))
            mk.hits_at(self.hist, cols, np.asarray(sizes, dtype=np.float64), out)
            return out, self.hist[cols, mk.LOOKED].astype(np.int64)

    def stats(self) -> dict[str, int]:
        return {"rate": float(self.state[mk.THRESHOLD]) / float(mk.FULL), "tracked_rows": int(self.state[mk.KEYS]),
                "resets": int(self.header[RESETS]), "dropped": int(self.header[DROPPED])}
