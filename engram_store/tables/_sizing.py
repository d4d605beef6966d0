"""The hit rate at every cache size of a ``disk_dir`` EngramStore's layers: ``stats()['hit_rate_by_size']``.

One :class:`~engram_store.disk.MissRatioCurve` per row size, as there is one row cache per row size: it sees
every lookup of the layers that share that cache (whether or not the cache exists: the curve is how an operator
picks ``row_cache_bytes`` in the first place). Each layer has a column per head, so the curve is reported for
the layers named and per head; a V4.1 layer's heads are its columns, ``(n - 2) * n_heads + h`` for n-gram order
n (``engram_model.v41.hit_rate_by_order`` adds them up by order). Where the cache is the host's
(``cache_scope="host"``), the rows the host's curve samples are also handed to it (``disk._host_mrc``), and
``host_cache_hit_rate_by_size`` is the curve of every process's lookups together.

Sizes are the ladder ``SIZE_LADDER`` of shares of the rows that cache serves (every head of every layer of that row
size in this EngramStore), given in bytes as ``row_cache_bytes`` would have to be to hold that many rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..disk import SIZE_LADDER, HostCurve, HostRowCache, MissRatioCurve, bytes_for_rows
from ._layout import Layer
from ._source import Job

#: How long stats() waits for the host cache's lock to read its curve.
HOST_READ_TIMEOUT_S = 1.0


@dataclass
class _Column:
    """Where one layer's heads are counted."""
    curve: MissRatioCurve
    col0: int
    fallback_tag: int  # the key's tag when the layer has no cache (a cache gives its own)
    state: Any = None  # the DiskLayer the bases below are of
    row_base: np.ndarray | None = None  # the first row of each of the layer's heads in the layer


class Sizing:
    """The curves of one DiskSource's layers (``caches``: the source's row caches by row size, filled later)."""

    def __init__(self, caches: dict[int, Any]) -> None:
        self.caches = caches
        self.curves: dict[int, MissRatioCurve] = {}   # by row size
        self.hosts: dict[int, HostCurve] = {}          # by row size, where the cache is the host's
        self.rows: dict[int, int] = {}                 # rows of every layer of that size
        self._columns: dict[int, _Column] = {}         # by layer id

    def add(self, lay: Layer) -> None:
        """Count a layer of the EngramStore (once, when it is attached)."""
        curve = self.curves.get(lay.row_bytes)
        if curve is None:
            curve = self.curves[lay.row_bytes] = MissRatioCurve()
            cache = self.caches.get(lay.row_bytes)
            if isinstance(cache, HostRowCache):
                self.hosts[lay.row_bytes] = HostCurve(cache)
        self.rows[lay.row_bytes] = self.rows.get(lay.row_bytes, 0) + int(sum(lay.sizes))
        self._columns[lay.layer_id] = _Column(curve, curve.add_columns(len(lay.heads)), len(self._columns) + 1)

    def observe(self, jobs: list[Job], states: list[Any]) -> None:
        """Replay the rows of a read's jobs into their layers' curves (``states``: the DiskLayer each job read, as
        the read took it: a layer closed since is not looked up again)."""
        for job, state in zip(jobs, states):
            lay = job.layer
            column = self._columns[lay.layer_id]
            host = self.hosts.get(lay.row_bytes)
            if column.state is not state:  # a layer opened (again): its heads' first rows, its tag
                self._opened(lay, state, column, host)
            if host is None:
                column.curve.observe(job.ids, column.row_base, state.tag or column.fallback_tag, column.col0)
            else:
                column.curve.observe(job.ids, column.row_base, state.tag, column.col0, host.buf)
                host.after(column.curve)

    def _opened(self, lay: Layer, state: Any, column: _Column, host: HostCurve | None) -> None:
        column.state = state
        column.row_base = np.ascontiguousarray(state.row_base[list(lay.heads)])
        if host is not None:
            host.layer(state.tag, column.col0, len(lay.heads))

    def close(self) -> None:
        """Hand the host caches' curves the rows collected since the last replay."""
        for row_bytes, host in self.hosts.items():
            host.flush(self.curves[row_bytes], HOST_READ_TIMEOUT_S)

    def report(self, layers: list[Layer], reset: bool) -> dict[str, list]:
        """``hit_rate_by_size`` (a list of ``{'bytes', 'hit_rate'}``) and ``hit_rate_by_size_per_head`` (per head,
        the hit rates at the same sizes) of ``layers`` together; with a host cache, the same of the host's curve
        as ``host_cache_hit_rate_by_size`` and ``host_cache_hit_rate_by_size_per_head``."""
        for row_bytes, host in self.hosts.items():  # this process's rows first, and before a reset
            host.flush(self.curves[row_bytes], HOST_READ_TIMEOUT_S)
        mine, host = _Sum(), _Sum()
        for row_bytes, curve in self.curves.items():
            named = [lay for lay in layers if lay.row_bytes == row_bytes]
            if not named:
                continue
            sizes = [f * self.rows[row_bytes] for f in SIZE_LADDER]
            nbytes = np.array([bytes_for_rows(round(s), row_bytes) for s in sizes])
            for lay in named:
                column = self._columns[lay.layer_id]
                cols = range(column.col0, column.col0 + len(lay.heads))
                mine.add(*curve.hits(cols, sizes), row_bytes, nbytes)
                if reset:
                    curve.reset(cols)
                shared = self.hosts.get(row_bytes)
                found = None if shared is None or column.state is None else \
                    shared.hits(column.state.tag, sizes, HOST_READ_TIMEOUT_S)
                if found is not None:
                    host.add(*found, row_bytes, nbytes)
        out = mine.report("")
        if host.looked is not None:
            out.update(host.report("host_cache_"))
        return out


class _Sum:
    """Hits and rows looked up, summed over layers and head by head."""

    def __init__(self) -> None:
        self.hits = np.zeros(len(SIZE_LADDER))
        self.looked: int | None = None
        self.head_hits: list[np.ndarray] = []
        self.head_looked: list[int] = []
        self.nbytes: dict[int, np.ndarray] = {}

    def add(self, per_head: np.ndarray, looked: np.ndarray, row_bytes: int, nbytes: np.ndarray) -> None:
        self.hits += per_head.sum(axis=0)
        self.looked = (self.looked or 0) + int(looked.sum())
        self.nbytes[row_bytes] = nbytes  # the ladder of each row size's cache; summed over them below
        for h in range(per_head.shape[0]):
            if h == len(self.head_hits):
                self.head_hits.append(np.zeros(len(SIZE_LADDER)))
                self.head_looked.append(0)
            self.head_hits[h] += per_head[h]
            self.head_looked[h] += int(looked[h])

    def report(self, prefix: str) -> dict[str, list]:
        nbytes = sum(self.nbytes.values(), np.zeros(len(SIZE_LADDER), dtype=np.int64))
        rate = (lambda x, n: (x / n).tolist() if n else [0.0] * len(SIZE_LADDER))
        return {f"{prefix}hit_rate_by_size": [{"bytes": int(b), "hit_rate": r}
                                              for b, r in zip(nbytes, rate(self.hits, self.looked or 0))],
                f"{prefix}hit_rate_by_size_per_head": [rate(x, n) for x, n in zip(self.head_hits, self.head_looked)]}
