"""Tables in this host's memory without a store: the caller's own arrays, or layers published as files.

* :class:`ArraySource` (``store=None``): ``bind_local`` reads the caller's immutable arrays in place (no copy).
* :class:`DirSource` (``local_dir=``): ``populate`` copies the tables into files under a directory, published
  atomically per layer (see :mod:`._local_dir`); every process that opens the directory maps the published
  layers read-only and shares their pages.
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import InvalidArgument, ObjectNotFound
from ._layout import Layer
from ._local_dir import LocalDir, MappedLayer
from ._source import HeldTables, InMemory, Job, Source, closed_error, gather, progress, state_of

#: A prefetch of at most this many rows from tables all in memory here runs at once in the caller's thread (a few
#: microseconds, cheaper than a thread hand-off).
PREFETCH_INLINE_ROWS = 4096


class ArraySource(Source):
    """Layers bound to the caller's own arrays (``bind_local``); an unbound layer has nothing to read. Once the
    EngramStore is closing, every read and bind raises TableClosed (a read already running finishes: it holds the
    arrays it reads)."""

    def __init__(self, threads: int = 1):
        super().__init__(threads)
        self.closed = False

    def closing(self) -> None:
        self.closed = True

    def ready(self, lay: Layer, what: str) -> None:
        if self.closed:
            raise closed_error(lay, what)
        if lay.state is None:
            super().ready(lay, what)

    def bind(self, lay: Layer, tables: list[np.ndarray], keep: list) -> None:
        with lay.lock:
            if self.closed:
                raise closed_error(lay, "bind_local")
            if lay.state is not None:
                raise InvalidArgument(f"bind_local: layer {lay.layer_id} is already bound; build a new EngramStore "
                                      "to read other tables")
            lay.state = InMemory.of(lay, [(j, t.reshape(-1).view(np.uint8)) for j, t in enumerate(tables)], keep)

    def read(self, jobs: list[Job]) -> None:
        for job in jobs:
            gather(job.layer, state_of(job.layer, "lookup"), job.ids, job.out, self.threads)
            job.layer.counters.add(lookups=1, rows=job.ids.size, local_rows=job.ids.size)

    def inline(self, lay: Layer, rows: int) -> bool:
        return rows <= PREFETCH_INLINE_ROWS

    def local_tables(self, lay: Layer) -> list[np.ndarray] | None:
        return state_of(lay, "local_tables").views(lay)

    def held_tables(self, lay: Layer) -> HeldTables | None:
        state = lay.state
        if state is None or self.closed:
            return None
        tables = self.local_tables(lay)
        return HeldTables(tables, lay, state, self) if tables is not None and lay.state is state else None


class _Mapped:
    """A ``local_dir`` layer's published files, mapped, and the row sources over them."""

    def __init__(self, lay: Layer, mapped: MappedLayer):
        self.mapped = mapped
        self.memory = InMemory.of(lay, [(j, mapped.tables[h]) for j, h in enumerate(lay.heads)], [mapped])


class DirSource(ArraySource):
    """Layers published as files under ``local_dir`` (Mooncake's directory layout), mapped read-only."""

    streams = True

    def __init__(self, path: str | os.PathLike, threads: int = 1):
        super().__init__(threads)
        self.dir = LocalDir(path)
        self.local_dir = self.dir.path
        self.where = f"local_dir={self.dir.path!r}"

    def attach(self, lay: Layer) -> None:
        self._open(lay)  # published layers are opened (and their layout checked) now

    def _open(self, lay: Layer, what: str = "open") -> bool:
        """Map the layer's published files if they are there (and not mapped yet); whether the layer is readable."""
        if self.closed:
            raise closed_error(lay, what)
        if lay.state is not None:
            return True
        with lay.lock:
            if self.closed:  # closing() came while this waited: detach() follows, and must find nothing opened
                raise closed_error(lay, what)
            if lay.state is None:
                mapped = self.dir.open(lay.layer_id, lay.row_bytes, lay.layer_sizes)
                if mapped is None:
                    return False
                lay.state = _Mapped(lay, mapped)
        return True

    def ready(self, lay: Layer, what: str) -> None:
        if not self._open(lay, what):
            raise ObjectNotFound(f"{what}: layer {lay.layer_id} is not published under local_dir {self.dir.path} "
                                 f"(no {self.dir.layer_path(lay.layer_id)}); populate it first")

    def bind(self, lay: Layer, tables: list[np.ndarray], keep: list) -> None:
        Source.bind(self, lay, tables, keep)

    def populate(self, lay: Layer, tables: list[np.ndarray], replica_num: int) -> None:
        if self.closed:
            raise closed_error(lay, "populate")
        bar = progress(lay, tables)
        try:
            self.dir.publish(lay.layer_id, lay.row_bytes, lay.layer_sizes, tables, progress=bar)
        finally:
            bar.close()
        self._open(lay, "populate")

    def read(self, jobs: list[Job]) -> None:
        for job in jobs:  # the state taken once holds the mapped tables until the gather ends, whatever closes
            gather(job.layer, state_of(job.layer, "lookup").memory, job.ids, job.out, self.threads)
            job.layer.counters.add(lookups=1, rows=job.ids.size, local_rows=job.ids.size)

    def local_tables(self, lay: Layer) -> list[np.ndarray] | None:
        return state_of(lay, "local_tables").memory.views(lay)

    def detach(self, lay: Layer) -> None:
        with lay.lock:
            state, lay.state = lay.state, None
        if state is not None:
            state.mapped.close()

    def close(self) -> None:
        self.dir.close()
