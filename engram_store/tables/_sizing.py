"""The hit rate at every cache size of a ``disk_dir`` EngramStore's layers: ``stats()['hit_rate_by_size']``.

One :class:`~engram_store.disk.MissRatioCurve` per row size, as there is one row cache per row size: it sees
every lookup of the layers that share that cache (whether or not the cache exists: the curve is how an operator
picks ``row_cache_bytes`` in the first place). Each layer has a column per head, so the curve is reported for
the layers named and per head; a V4.1 layer's heads are its columns, ``(n - 2) * n_heads + h`` for n-gram order
n (``engram_model.v41.hit_rate_by_order`` adds them up by order).

Sizes are the ladder ``SIZE_LADDER`` of shares of the rows that cache serves (every head of every layer of that row
size in this EngramStore), given in bytes as ``row_cache_bytes`` would have to be to hold that many rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..disk import SIZE_LADDER, MissRatioCurve, bytes_for_rows
from ._layout import Layer
from ._source import Job


@dataclass
class _Column:
    """Where one layer's heads are counted."""
    curve: MissRatioCurve
    col0: int
    fallback_tag: int  # the key's tag when the layer has no cache (a cache gives its own)


class Sizing:
    """The curves of one DiskSource's layers."""

    def __init__(self) -> None:
        self.curves: dict[int, MissRatioCurve] = {}   # by row size
        self.rows: dict[int, int] = {}                 # rows of every layer of that size
        self._columns: dict[int, _Column] = {}         # by layer id
        self._row_base: dict[int, tuple[object, np.ndarray]] = {}  # layer id -> (the DiskLayer, its heads' bases)

    def add(self, lay: Layer) -> None:
        """Count a layer of the EngramStore (once, when it is attached)."""
        curve = self.curves.get(lay.row_bytes)
        if curve is None:
            curve = self.curves[lay.row_bytes] = MissRatioCurve()
        self.rows[lay.row_bytes] = self.rows.get(lay.row_bytes, 0) + int(sum(lay.sizes))
        self._columns[lay.layer_id] = _Column(curve, curve.add_columns(len(lay.heads)), len(self._columns) + 1)

    def observe(self, jobs: list[Job]) -> None:
        """Replay the rows of a read's jobs into their layers' curves."""
        for job in jobs:
            lay = job.layer
            column = self._columns[lay.layer_id]
            state = lay.state
            seen = self._row_base.get(lay.layer_id)
            if seen is None or seen[0] is not state:  # a layer opened (again): its heads' first rows
                seen = self._row_base[lay.layer_id] = (state, np.ascontiguousarray(state.row_base[list(lay.heads)]))
            column.curve.observe(job.ids, seen[1], state.tag or column.fallback_tag, column.col0)

    def report(self, layers: list[Layer], reset: bool) -> dict[str, list]:
        """``hit_rate_by_size`` (a list of ``{'bytes', 'hit_rate'}``) and ``hit_rate_by_size_per_head`` (per head,
        the hit rates at the same sizes) of ``layers`` together."""
        hits = np.zeros(len(SIZE_LADDER))
        looked = 0
        head_hits: list[np.ndarray] = []
        head_looked: list[int] = []
        nbytes = np.zeros(len(SIZE_LADDER), dtype=np.int64)
        for row_bytes, curve in self.curves.items():
            named = [lay for lay in layers if lay.row_bytes == row_bytes]
            if not named:
                continue
            sizes = [f * self.rows[row_bytes] for f in SIZE_LADDER]
            nbytes += [bytes_for_rows(round(s), row_bytes) for s in sizes]
            for lay in named:
                column = self._columns[lay.layer_id]
                cols = range(column.col0, column.col0 + len(lay.heads))
                per_head, per_head_looked = curve.hits(cols, sizes)
                if reset:
                    curve.reset(cols)
                hits += per_head.sum(axis=0)
                looked += int(per_head_looked.sum())
                for h in range(len(cols)):
                    if h == len(head_hits):
                        head_hits.append(np.zeros(len(SIZE_LADDER)))
                        head_looked.append(0)
                    head_hits[h] += per_head[h]
                    head_looked[h] += int(per_head_looked[h])
        rate = (lambda x, n: (x / n).tolist() if n else [0.0] * len(SIZE_LADDER))
        return {"hit_rate_by_size": [{"bytes": int(b), "hit_rate": r} for b, r in zip(nbytes, rate(hits, looked))],
                "hit_rate_by_size_per_head": [rate(x, n) for x, n in zip(head_hits, head_looked)]}
