"""Tables on local SSD (``disk_dir``): layers larger than memory, read a page per row behind a hot-row cache.

``populate`` writes a layer as page-aligned files under the directory (see :mod:`engram_store.disk`), published
atomically; any EngramStore opened on the same directory, in any process, reads it. Reads turn rows into
distinct page reads with many in flight (O_DIRECT); ``row_cache_bytes`` keeps hot rows in memory, one cache for
all layers of a row size. Every layer of a call is read in one batch, so all their pages are in flight together.

``cache_scope="host"`` puts that cache in shared memory, one for every process of the host that opens the same
``disk_dir`` (:class:`~engram_store.disk.HostRowCache`: one asking for another ``row_cache_bytes`` attaches to the
cache there, with a warning); ``"process"`` (the default) keeps one per EngramStore.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import numpy as np

from ..errors import InvalidArgument, ObjectExists, ObjectNotFound
from ..metrics import RequestMetrics
from ..disk import DiskDir, HostRowCache, LayerProfile, RowCache, read_checked, warm_layer
from ._layout import Layer
from ._sizing import Sizing
from ._source import Job, Source, closed_error, progress, state_of

#: Counters a disk layer keeps that EngramStore.stats() reports.
DISK_STATS = ("pages_read", "bytes_read", "cache_hits", "cache_misses", "cache_hits_per_head",
              "cache_misses_per_head")
CACHE_SCOPES = ("process", "host")


class DiskSource(Source):
    """Layers published under ``disk_dir``; ``lay.state`` is the layer's open :class:`~engram_store.disk.DiskLayer`."""

    streams = True
    #: A lookup's ids are checked as its read plans them (``_kernels._plan_read``), before the cache is probed.
    checks_ids = True

    def __init__(self, path: str | os.PathLike, row_cache_bytes: int, row_sizes: Sequence[int], threads: int = 1,
                 cache_scope: str = "process"):
        super().__init__(threads)
        self.dir = DiskDir(path)
        self.disk_dir = self.dir.path
        self.where = f"disk_dir={self.dir.path!r}"
        # This source's jobs are read together (every layer's pages in flight at once). A token, not the source
        # itself: a source that named itself would live in a reference cycle, freed (its host cache detached, its
        # files closed) only when the garbage collector runs, at any point of any thread.
        self.batch_key = object()
        self.closed = False
        # One cache per row size, the bytes shared out by how many layers use each size. Every missed row is
        # admitted: on real n-gram traffic the doorkeeper cost 5-10 points of hit rate (bench_cache_policy.py).
        self.caches: dict[int, RowCache] = {}
        self.sizing = Sizing(self.caches)  # the hit rate of every cache size, from the lookups
        self.read_metrics: RequestMetrics | None = None  # reads timed once metrics are asked for (_prometheus)
        try:
            self._make_caches(row_cache_bytes, row_sizes, cache_scope)
        except BaseException:  # nothing made is left to the garbage collector
            self.close()
            raise

    def _make_caches(self, row_cache_bytes: int, row_sizes: Sequence[int], cache_scope: str) -> None:
        scope = self.dir.dir.resolved  # one cache for every path to the directory (as it was opened)
        for size in sorted(set(row_sizes)):
            share = int(row_cache_bytes) * row_sizes.count(size) // len(row_sizes)
            if share:
                self.caches[size] = (HostRowCache(share, size, scope=scope) if cache_scope == "host"
                                     else RowCache(share, size, admission="always"))

    def warm(self, lay: Layer, profile: LayerProfile, max_rows: int | None) -> int:
        self.ready(lay, "warm_cache")
        state = state_of(lay, "warm_cache")
        if state.cache is None:
            raise InvalidArgument(f"row_cache_bytes: warm_cache needs a row cache; layer {lay.layer_id} has none "
                                  "(pass row_cache_bytes > 0)")
        return warm_layer(state, profile, max_rows)

    def finish_stats(self, total: dict[str, Any], layers: list[Layer], reset: bool) -> dict[str, Any]:
        """The host caches' own counters, summed over row sizes, as ``host_cache_<name>``, and the layers' hit
        rate at every cache size."""
        for cache in self.caches.values():
            if isinstance(cache, HostRowCache):
                for name, value in cache.stats().items():
                    total[f"host_cache_{name}"] = total.get(f"host_cache_{name}", 0) + value
        total.update(self.sizing.report(layers, reset))
        return total

    def closing(self) -> None:
        self.closed = True

    def close(self) -> None:
        if self.dir.closed:
            return  # closed already
        self.closed = True
        self.sizing.close()  # the rows the host's curve has not had yet
        for cache in self.caches.values():
            cache.close()
        self.dir.close()

    def attach(self, lay: Layer) -> None:
        self.sizing.add(lay)
        self._open(lay)  # a published layer is opened (and its layout checked) now

    def _open(self, lay: Layer, what: str = "open") -> bool:
        """Open the layer's published files if they are there (and not open yet); whether the layer is readable."""
        if self.closed:
            raise closed_error(lay, what)
        if lay.state is not None:
            return True
        with lay.lock:
            if self.closed:  # closing() came while this waited: detach() follows, and must find nothing opened
                raise closed_error(lay, what)
            if lay.state is None:
                lay.state = self.dir.open(lay.layer_id, lay.row_bytes, lay.layer_sizes,
                                          cache=self.caches.get(lay.row_bytes))
        return lay.state is not None

    def ready(self, lay: Layer, what: str) -> None:
        if not self._open(lay, what):
            new = (" disk_dir did not exist: this EngramStore created it, empty; if you meant an existing "
                   "directory, check the path.") if self.dir.created else ""
            raise ObjectNotFound(f"{what}: layer {lay.layer_id} is not published under disk_dir {self.dir.path} "
                                 f"(no {self.dir.layer_path(lay.layer_id)}); populate it first.{new}")

    def populate(self, lay: Layer, tables: list[np.ndarray], replica_num: int) -> None:
        if lay.sharded:
            raise InvalidArgument(f"heads: a disk layer is written whole; build the EngramStore for layer "
                                  f"{lay.layer_id} without heads= to populate it")
        if replica_num != 1:
            raise InvalidArgument(f"replica_num: a disk layer is one set of files on this host; expected 1, got "
                                  f"{replica_num}")
        if self._open(lay, "populate"):
            raise ObjectExists(f"populate layer {lay.layer_id}: it is already published under disk_dir "
                               f"{self.dir.path}; call remove_from_store() first")
        bar = progress(lay, tables)
        try:
            self.dir.write(lay.layer_id, lay.row_bytes, lay.layer_sizes,
                           [t if callable(t) else t.reshape(-1).view(np.uint8).reshape(n, lay.row_bytes)
                            for t, n in zip(tables, lay.sizes)], progress=bar)
        finally:
            bar.close()
        self._open(lay, "populate")

    def read(self, jobs: list[Job]) -> None:
        requests, shards = [], []
        states = [state_of(job.layer, "lookup") for job in jobs]  # each read holds its layer's file to its end
        for job, state in zip(jobs, states):
            if job.layer.sharded:  # the files hold every head: read the shard's as a whole layer's, then keep them
                lay, M = job.layer, job.ids.shape[0]
                ids = np.zeros((M, len(lay.layer_sizes)), dtype=np.int64)  # row 0 of other heads: one page each
                ids[:, lay.heads] = job.ids
                whole = np.empty((M, len(lay.layer_sizes), lay.row_bytes), dtype=np.uint8)
                shards.append((job, whole))
                requests.append((state, ids, whole.reshape(-1)))
            else:
                requests.append((state, job.ids, job.out))
        timed = self.read_metrics
        start = time.perf_counter() if timed is not None else 0.0
        try:
            read_checked(requests)  # the facade's jobs: ids int64 [M, H] and flat bytes, C-contiguous
        except BaseException as exc:
            if timed is not None:
                timed.record("read", time.perf_counter() - start, False)
            if isinstance(exc, InvalidArgument):  # an id out of range: named as the facade names it
                for job in jobs:
                    if job.row_ids is not None:
                        job.layer.check_range(job.row_ids)
            raise
        if timed is not None:
            timed.record("read", time.perf_counter() - start, True)
        for job, whole in shards:
            job.out.reshape(whole.shape[0], job.layer.num_heads, -1)[:] = whole[:, job.layer.heads]
        for job in jobs:
            job.layer.counters.add(lookups=1, rows=job.ids.size)
        self.sizing.observe(jobs, states)

    def stats(self, lay: Layer, reset: bool) -> dict[str, int]:
        state = lay.state
        if state is None:
            return {}
        counts = state.stats(reset)
        return {name: counts[name] for name in DISK_STATS}

    def remove(self, lay: Layer, force: bool) -> int:
        """Delete the layer's files (processes that have them open read on until they close them)."""
        if not self._open(lay, "remove_from_store"):
            return 0
        self.detach(lay)
        try:
            self.dir.remove(lay.layer_id)
        except ObjectNotFound:
            return 0
        return len(lay.heads)

    def verify(self, lay: Layer) -> list[int]:
        self.ready(lay, "verify")
        self.dir.verify(lay.layer_id)
        return list(lay.heads)

    def detach(self, lay: Layer) -> None:
        with lay.lock:
            state, lay.state = lay.state, None
        if state is not None:
            state.close()
