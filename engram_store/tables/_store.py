"""EngramStore: the per-head embedding tables of one or more Engram layers, read by row id.

Keeps the contract of Mooncake's EngramStore: keys ``engram:l{layer_id}:h{head}``, each a C-contiguous
``[N_h, D]`` table (float32 by default, or 16-bit floats, or opaque byte rows); ``populate`` is create-only and
all-or-nothing; ``lookup`` maps ``[B, L, H]`` row ids to ``[B, L, H, D]`` rows and never clamps an id or fills
zeros. This class checks arguments and hands the rest to its row source (see :mod:`._source`).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .. import _fork
from ..errors import InvalidArgument, InvalidType, describe
from ._layout import EngramStoreConfig, Layer, check_tables, find_layer, layers_of
from ._plan import Background, LookupHandle, layer_jobs, read_jobs, start_reads
from ._source import HeldTables, Job
from ._places import check_options, release, source_for, sum_stats, warm_cache


class EngramStore:
    """The tables of one or more Engram layers. A context manager; ``close()`` stops background reads.

    One layer (the form of Mooncake's first EngramStore)::

        EngramStore(layer_id, config, store)

    Several layers, each with its own geometry, read together (one request per segment server for all)::

        EngramStore({1: config_1, 15: config_15}, store=store)

    Where the tables are: ``store``, this project's :class:`DistributedStore`, ``engram_store.compat``'s
    ``MooncakeDistributedStore`` or a real ``mooncake.store.MooncakeDistributedStore``; or, with ``store=None``,
    files under ``local_dir`` (mapped in memory, shared by the host's processes), page-aligned files under
    ``disk_dir`` on local SSD (for layers larger than memory; ``row_cache_bytes`` keeps hot rows in memory, in all),
    or the caller's own arrays bound with :meth:`bind_local`. With none of these, getters work and reads raise
    :class:`NotConnected`.

    Methods act on the only layer, or on the one named with ``layer=``. ``heads`` (one layer only) makes a
    head shard: the store owns and reads just those heads. ``threads`` > 1 splits large gathers from memory on
    this host over that many threads (the kernel releases the GIL). ``row_cache_bytes`` with a store keeps each
    layer's recently read remote rows in this process. ``cache_scope="host"`` (``disk_dir`` only) shares the row
    cache with every process of the host that opens the same ``disk_dir`` (another ``row_cache_bytes`` attaches to
    the one there, with a warning): one copy of the hot rows in shared memory instead of one per worker (see
    :class:`engram_store.disk.HostRowCache`); :meth:`warm_cache` pins the most frequent rows of a profile in it.
    """

    def __init__(self, layer_id: int | Mapping[int, EngramStoreConfig], config: EngramStoreConfig | None = None,
                 store: Any = None, *, heads: Sequence[int] | None = None, require_manifest: bool = True,
                 row_cache_bytes: int = 0, local_dir: str | os.PathLike | None = None,
                 disk_dir: str | os.PathLike | None = None, threads: int = 1, cache_scope: str = "process"):
        check_options(cache_scope, disk_dir, row_cache_bytes, threads)
        layers = layers_of(layer_id, config, heads)
        self.layer_id: int | None = None if isinstance(layer_id, Mapping) else layers[0].layer_id
        self._layers = {layer.layer_id: layer for layer in layers}
        self._only = layers[0] if len(layers) == 1 else None  # the layer methods act on without layer=
        self._store = store
        self._source = source_for(store, local_dir, disk_dir, bool(require_manifest), int(row_cache_bytes),
                                  int(threads), layers, cache_scope)
        try:
            for layer in layers:
                self._source.attach(layer)
        except BaseException:  # a layer that does not open: what the source made (files, caches) goes now
            release(self._source, layers)
            raise
        self._pool = Background("this EngramStore",
                                f"engram-l{self.layer_id}" if self.layer_id is not None else "engram-layers")
        _fork.in_child(self._forked)

    def _forked(self) -> None:
        """In a forked child: the parent's pool and locks are not its own; it makes its own (``engram_store._fork``)."""
        self._pool.forked()
        for layer in self._layers.values():
            layer.forked()

    # ---- layers and getters (work without a store) ------------------------------------------------

    def _layer(self, layer: int | None) -> Layer:
        if self._only is not None and (layer is None or (type(layer) is int and layer == self._only.layer_id)):
            return self._only
        return find_layer(self._layers, layer)

    def get_layer_ids(self) -> list[int]:
        return sorted(self._layers)

    def get_table_vocab_sizes(self, layer: int | None = None) -> list[int]:
        """Rows of each head this store owns (all heads of the layer unless built with ``heads=``)."""
        return list(self._layer(layer).sizes)

    def get_heads(self, layer: int | None = None) -> list[int]:
        """The layer's head indices this store owns, in the order of the last axis of its row ids."""
        return list(self._layer(layer).heads)

    def get_row_format(self, layer: int | None = None) -> str:
        return self._layer(layer).row_format

    def get_row_bytes(self, layer: int | None = None) -> int:
        return self._layer(layer).row_bytes

    def get_store_keys(self, layer: int | None = None) -> list[str]:
        return list(self._layer(layer).keys)

    def get_num_heads(self, layer: int | None = None) -> int:
        return self._layer(layer).num_heads

    def get_embedding_dim(self, layer: int | None = None) -> int:
        return self._layer(layer).dim

    @property
    def store(self) -> Any:
        """The store the tables are in (None for tables on this host)."""
        return self._store

    @property
    def local_dir(self) -> str | None:
        return self._source.local_dir

    @property
    def disk_dir(self) -> str | None:
        return self._source.disk_dir

    # ---- tables ---------------------------------------------------------------------------------

    def populate(self, embedding_buffers: Sequence[np.ndarray], replica_num: int = 1, *,
                 layer: int | None = None) -> None:
        """Write one ``[N_h, D]`` table per head of the layer; create-only and all-or-nothing.

        Into a store: refuses (naming the key) if any head already exists; if an upload fails, or the call is
        interrupted, every table this call wrote is removed before the error propagates. Under ``local_dir`` or
        ``disk_dir``: the tables are written into files and published atomically, and a table too large to hold
        in memory may be given as a function ``fill(start_row, out)`` that writes rows ``start_row ..
        start_row + len(out)`` into ``out`` (uint8 ``[rows, row_bytes]``), called chunk by chunk. The caller's
        buffers may be reused or freed once this returns.
        """
        lay = self._layer(layer)
        tables = check_tables(lay, embedding_buffers, streams=self._source.streams)
        if not isinstance(replica_num, int) or isinstance(replica_num, bool) or replica_num < 1:
            raise InvalidArgument(f"replica_num: expected an integer >= 1, got {describe(replica_num)}")
        self._source.populate(lay, tables, replica_num)

    def bind_local(self, embedding_buffers: Sequence[np.ndarray], *, layer: int | None = None) -> None:
        """Read the layer from the caller's own ``[N_h, D]`` arrays, in place: no copy, no store.

        The arrays are kept referenced until :meth:`close`; do not modify, resize or unmap them while bound.
        Only for an EngramStore without a store, ``local_dir`` or ``disk_dir``, and once per layer.
        """
        lay = self._layer(layer)
        tables = check_tables(lay, embedding_buffers, streams=False)
        self._source.bind(lay, tables, keep=list(embedding_buffers))

    def verify(self, *, layer: int | None = None) -> list[int]:
        """Read this store's heads of the layer in full and compare them with their recorded checksums.

        Returns the heads that were checked (heads of a layer written without checksums have none); raises
        :class:`StoreError` naming the first head whose bytes differ.
        """
        return self._source.verify(self._layer(layer))

    def remove_from_store(self, force: bool = False, *, layer: int | None = None) -> int:
        """Remove this store's head tables of the layer; returns how many were removed (missing keys are skipped).

        The layer's manifest goes first, so readers see the layer as unpublished, never half removed. Layers
        published under ``local_dir`` are files: delete their directory to remove them; layers under ``disk_dir``
        are deleted (processes reading them keep their open files until they close them).
        """
        return self._source.remove(self._layer(layer), force)

    def undo_populate(self, *, layer: int | None = None) -> int:
        """Remove what this EngramStore's last :meth:`populate` of the layer that succeeded wrote (a refused one
        wrote nothing; one since removed by :meth:`remove_from_store` leaves nothing to undo): its heads and, if
        that populate published the layer, the manifest (first). Returns how many heads were removed.

        For a loader that writes a layer shard by shard and must take back the shards it wrote when a later one
        fails. Unlike ``remove_from_store(force=True)``, an object another writer put under the same key since (after
        a forced remove of this layer) is not removed: each key goes only while it holds the object this populate's
        put wrote (in a Mooncake store, which names no puts, by key). Raises InvalidArgument when this EngramStore
        has no populate of the layer to undo."""
        return self._source.undo_populate(self._layer(layer))

    def stats(self, reset: bool = False, *, layer: int | None = None) -> dict[str, Any]:
        """Lookup counters (see :class:`LookupCounters`) of the layer, or summed over all layers of a multi-layer
        store when none is named; ``reset=True`` zeroes them after reading.

        Layers under ``disk_dir`` add ``cache_hits_per_head`` and ``cache_misses_per_head`` (lists, one count per
        head: for a V4.1 layer, per column, so ``(n - 2) * n_heads + h`` gives the hit rate of n-gram order n);
        ``hit_rate_by_size``, the predicted hit rate of a cache of every size from 0.1% to 100% of the rows (a list
        of ``{'bytes', 'hit_rate'}``; per head in ``hit_rate_by_size_per_head``; see docs/ssd-tier.md); and a host
        cache its own counters over all its processes (``host_cache_hits``, ``host_cache_misses``, ...; never
        reset) and the same curves for the whole host (``host_cache_hit_rate_by_size``, ...).
        """
        layers = [self._layer(layer)] if layer is not None or len(self._layers) == 1 else list(self._layers.values())
        return sum_stats(self._source, layers, reset)

    def warm_cache(self, profile: Any, *, layer: int | None = None, max_rows: int | None = None) -> int:
        """Pin the most frequent rows of ``profile`` in the row cache of a ``disk_dir`` layer (warm start); returns
        how many were pinned. ``profile``: a path written by ``engram-stats --profile`` (or
        :func:`engram_store.disk.save_profile`), or a loaded ``{layer_id: LayerProfile}``; ``max_rows``: by
        default 2 of each set's 7 ways (the others keep serving recent rows)."""
        return warm_cache(self._source, self._layer(layer), profile, max_rows)

    def local_tables(self, *, layer: int | None = None) -> list[np.ndarray] | None:
        """Each head's table as a read-only ``[N_h, row_bytes]`` uint8 view of this host's memory (None if one is not
        here): what the memory holds when read. Kernels read rows in place through read_local or held_tables."""
        lay = self._layer(layer)
        self._source.ready(lay, "local_tables")
        return self._source.local_tables(lay)

    def held_tables(self, *, layer: int | None = None) -> HeldTables | None:
        """Tables a read needs no check of (``bind_local``, ``local_dir``; see HeldTables), else None."""
        return self._source.held_tables(self._layer(layer))

    def read_local(self, read: Callable[[list[np.ndarray]], bool], *, layer: int | None = None) -> bool:
        """``read(tables)`` over :meth:`local_tables`, checked as a lookup's read (docs/store.md, "What a read
        checks"): its result, or False where it did not run or its output must not be used (read with lookup_into)."""
        lay = self._layer(layer)
        self._source.ready(lay, "read_local")
        return self._source.read_local(lay, read)

    # ---- lookups --------------------------------------------------------------------------------

    def _job(self, row_ids: Any, out: Any, layer: int | None, what: str = "lookup",
             read_checks: bool = False) -> tuple[Job, Any]:
        """A checked read job, and what the call returns (the caller's ``out``, else a new array).

        ``read_checks``: the job is read at once and alone, so where the source checks ids as it reads them
        (``Source.checks_ids``) their range is left to it (the job's ``row_ids``); nothing is read before."""
        lay = self._layer(layer)
        self._source.ready(lay, what)
        unchecked = read_checks and self._source.checks_ids
        row_ids = lay.as_ids(row_ids) if unchecked else lay.check_ids(row_ids)  # [B, L, H], C-contiguous int64
        shape = row_ids.shape + (lay.dim,)
        target = lay.check_out(out, shape) if out is not None else np.empty(shape, dtype=lay.dtype)
        job = Job(self._source, lay, row_ids.reshape(-1, lay.num_heads), target.reshape(-1).view(np.uint8),
                  row_ids if unchecked else None)
        return job, out if out is not None else target

    def lookup(self, row_ids: Any, *, layer: int | None = None) -> np.ndarray:
        """Rows for ``[B, L, H]`` ids as ``[B, L, H, D]`` in the stored format (float32 by default)."""
        if layer is None and self._only is not None:
            rows = self._source.express(self._only, row_ids, None)
            if rows is not None:
                return rows
        job, result = self._job(row_ids, None, layer, read_checks=True)
        self._source.read([job])  # one job: nothing to group
        return result

    def lookup_into(self, row_ids: Any, out: Any, *, layer: int | None = None) -> Any:
        """Fill ``out`` (a writable C-contiguous ``[B, L, H, D]`` buffer of the stored dtype) with the rows.

        ``out`` may be a NumPy array, a CPU tensor that speaks DLPack, or anything NumPy views without copying
        (see :meth:`Layer.check_out`); nothing else is allocated for it. Returns ``out``.
        """
        if layer is None and self._only is not None and self._source.express(self._only, row_ids, out) is not None:
            return out
        job, result = self._job(row_ids, out, layer, read_checks=True)
        self._source.read([job])  # one job: nothing to group
        return result

    def lookup_layers(self, row_ids: Mapping[int, Any], out: Mapping[int, Any] | None = None) -> dict[int, Any]:
        """Rows of several layers in one call: ``{layer_id: [B, L, H] ids}`` -> ``{layer_id: rows}``.

        Remote reads of every layer that go to the same segment server travel in one request. ``out`` may give
        a caller buffer per layer (as in :meth:`lookup_into`).
        """
        jobs, results = self._jobs(row_ids, out)
        read_jobs(jobs)
        return results

    def prefetch(self, row_ids: Any, out: Any = None, background: bool | None = None, *,
                 layer: int | None = None) -> LookupHandle:
        """Start a lookup; the ids (and ``out``) are checked now, errors of the read come from ``result()``.

        ``out``: a caller buffer to fill (as in :meth:`lookup_into`; nothing is allocated), else a new array.
        ``background=True`` always reads in a background thread and returns at once (so the caller can launch
        other work, e.g. on a GPU); ``False`` reads now; None (default) reads a small lookup whose tables are all
        in memory on this host at once (a few microseconds, cheaper than a thread hand-off) and the rest in the
        background.
        """
        job, result = self._job(row_ids, out, layer, "prefetch")
        if background is None:
            background = not self._source.inline(job.layer, job.ids.size)
        return self._start([job], result, background, row_ids)

    def prefetch_layers(self, row_ids: Mapping[int, Any], out: Mapping[int, Any] | None = None,
                        background: bool = True) -> LookupHandle:
        """:meth:`lookup_layers` in the background: ``result()`` returns ``{layer_id: rows}``."""
        jobs, results = self._jobs(row_ids, out)
        return self._start(jobs, results, background, row_ids)

    def _jobs(self, row_ids: Mapping[int, Any], out: Mapping[int, Any] | None) -> tuple[list[Job], dict[int, Any]]:
        return layer_jobs(row_ids, out, self._job, lambda layer_id: self._layer(layer_id).layer_id)

    def _start(self, jobs: list[Job], result: Any, background: bool, row_ids: Any) -> LookupHandle:
        return start_reads(jobs, result, row_ids, self._background() if background else None)

    def _background(self) -> ThreadPoolExecutor:
        return self._pool.executor()

    # ---- lifecycle --------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for background reads, release mapped tables, open files and bound arrays; safe to call twice. Tables
        on this host (``local_dir``, ``disk_dir``, ``bind_local``) raise :class:`TableClosed` from then on; a read
        already running finishes first, on the files it began with."""
        self._pool.close()
        release(self._source, list(self._layers.values()))

    def __enter__(self) -> "EngramStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.layer_id is not None:
            lay = self._layer(None)
            return (f"EngramStore(layer_id={self.layer_id}, heads={lay.num_heads}, "
                    f"embedding_dim={lay.dim}, store={self._source.where})")
        return f"EngramStore(layers={self.get_layer_ids()}, store={self._source.where})"


def lookup_many(requests: Sequence[tuple[Any, Any]], *, layers: Sequence[int | None] | None = None,
                out: Sequence[Any] | None = None, background: bool = False) -> LookupHandle:
    """Read the rows of several EngramStores (e.g. one per Engram layer) together.

    ``requests`` holds ``(engram_store, [B, L, H] row ids)``; ``layers`` names each one's layer where a store
    holds several; ``out`` gives caller buffers. Stores on the same :class:`DistributedStore` send one request
    per segment server for all of them. Returns a handle whose ``result()`` is the list of row arrays (or the
    ``out`` buffers), in order; with ``background=True`` the reads run in a background thread.
    """
    if layers is not None and len(layers) != len(requests):
        raise InvalidArgument(f"layers: expected {len(requests)} entries (one per request), got {len(layers)}")
    if out is not None and len(out) != len(requests):
        raise InvalidArgument(f"out: expected {len(requests)} entries (one per request), got {len(out)}")
    jobs, results = [], []
    for i, item in enumerate(requests):
        if not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], EngramStore):
            raise InvalidType(f"requests[{i}]: expected (EngramStore, row_ids), got {describe(item)}")
        owner, row_ids = item
        job, result = owner._job(row_ids, out[i] if out is not None else None,
                                 layers[i] if layers is not None else None)
        jobs.append(job)
        results.append(result)

    return start_reads(jobs, results, requests, requests[0][0]._background() if background and requests else None)


def prefetch_many(requests: Sequence[tuple[Any, Any]], *, layers: Sequence[int | None] | None = None,
                  out: Sequence[Any] | None = None, background: bool = True) -> list[LookupHandle]:
    """:func:`lookup_many` with one handle per request (each ``result()`` is that request's rows).

    The reads still go out together (one request per segment server for all layers); every handle completes
    when they all have, and a failure is raised by every handle.
    """
    combined = lookup_many(requests, layers=layers, out=out, background=background)
    handles = [LookupHandle(Future(), row_ids) for _, row_ids in requests]

    def finish(done: Future) -> None:
        exc = done.exception()
        for i, handle in enumerate(handles):
            if exc is not None:
                handle._future.set_exception(exc)
            else:
                handle._future.set_result(done.result()[i])

    combined._future.add_done_callback(finish)
    return handles
