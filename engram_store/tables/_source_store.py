"""Tables in this project's store: each head an object on segments, read in place where a segment is mapped here.

For the others a Numba kernel plans the reads (see :mod:`._plan`), and one request per segment server goes out for
every layer of the call, all at once. Where the tables are comes from the master (:mod:`._placement`); a hot-row
cache (``row_cache_bytes``) keeps recently read remote rows in this process.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable

import numpy as np

from .. import kernels as _kernels
from ..errors import ObjectNotFound, SegmentUnavailable, StalePlacement, StoreError, WriteFenced
from ._keyed import KeyedSource, Upload, Written
from ._layout import Layer
from ._placement import Placement, Placements, PlacementState
from ._plan import READ_ROUND_BYTES, READ_ROUND_ROWS, STALE, fits_one_round, place_reply, read_native, \
    server_parts, tally
from ._source import Job
from ._source_memory import PREFETCH_INLINE_ROWS


_INT64 = np.dtype(np.int64)


class StoreSource(KeyedSource):
    """Layers in a :class:`~engram_store.DistributedStore` (or the one a Mooncake-compatible wrapper holds)."""

    def __init__(self, native: Any, store: Any, require_manifest: bool, row_cache_bytes: int, threads: int = 1):
        super().__init__(store, require_manifest, threads)
        self.native = native
        self.batch_key = native  # EngramStores on one store read together: one request per server for all
        self.row_cache_bytes = int(row_cache_bytes)
        self.placements = Placements(native, self.check_published, self._clear_cache)

    def attach(self, lay: Layer) -> None:
        lay.state = PlacementState(_RowCache(self.row_cache_bytes, lay.row_bytes) if self.row_cache_bytes else None)

    def detach(self, lay: Layer) -> None:
        """Forget the layer's placement and cached rows (a closed EngramStore's next read resolves them again)."""
        self.attach(lay)  # (a new state: no placement, no _Lean)

    def _clear_cache(self, lay: Layer, signature: tuple) -> None:
        if lay.state.cache is not None:
            lay.state.cache.clear(signature)

    # ---- the store's primitives (see KeyedSource) -------------------------------------------------------------

    def exists(self, keys: list[str]) -> list[bool]:
        return self.native.batch_is_exist(keys)

    def get_manifest(self, lay: Layer) -> bytes | None:
        try:
            return self.native.get_checked(lay.manifest_key, lease=False)  # (a lease would block remove)
        except ObjectNotFound:
            return None

    def put_manifest(self, lay: Layer, data: bytes, replica_num: int, heads: dict[str, int] | None = None) -> int:
        """Published only while every head of the layer is the object ``heads`` names (this populate's) or, for
        another shard's head, the object there as the manifest is put: the master checks them with the
        publication (``put_generations(requires=)``), so a remove of the heads meanwhile fails this put
        (WriteFenced) instead of leaving a manifest without its heads."""
        heads = dict(heads or {})
        others = [key for key in lay.layer_keys if key not in heads]
        try:
            infos = self.native.locate(others, lease=False) if others else []
        except ObjectNotFound as exc:  # removed since publish() saw every shard's heads
            raise WriteFenced(f"populate layer {lay.layer_id}: a head of another shard was removed before the "
                              f"manifest was published ({exc}); nothing was published") from exc
        for info in infos:
            if info.replicas and info.replicas[0].generation:
                heads[info.key] = info.replicas[0].generation
        return self.native.put_generations([lay.manifest_key], [data], replica_num=replica_num,
                                           requires=list(heads.items()))[1][0]

    def put_tables(self, lay: Layer, tables: list[np.ndarray], replica_num: int, bar: Any) -> Upload:
        # The store computes each table's xxh3_64 while it uploads (and the master keeps them).
        return Upload("xxh3_64", *self.native.put_generations(lay.keys, tables, replica_num=replica_num,
                                                              progress=bar))

    def undo_written(self, lay: Layer, written: Written) -> int:
        """The manifest (if this populate published it) and the heads in one request, each only if still the
        object this populate's put wrote: a head another writer put under the same key since (after a forced
        remove of this populate's layer) is not this populate's to remove."""
        keys, generations = list(lay.keys), list(written.upload.generations)
        if written.manifest:
            keys, generations = [lay.manifest_key] + keys, [written.manifest_generation] + generations
        removed = self.native.remove_many(keys, force=True, generations=generations)
        return sum(1 for key in removed if key != lay.manifest_key)

    def remove_key(self, key: str, force: bool) -> bool:
        try:
            self.native.remove(key, force=force)
            return True
        except ObjectNotFound:
            return False

    def remove_layer(self, lay: Layer, force: bool) -> int:
        """Manifest and heads in one request, all or nothing: a read lease on any head refuses the whole remove
        (LeaseActive) and the layer stays published."""
        removed = self.native.remove_many([lay.manifest_key] + list(lay.keys), force=force)
        return sum(1 for key in removed if key != lay.manifest_key)

    def read_head(self, lay: Layer, j: int) -> np.ndarray:
        rows = np.empty(lay.sizes[j] * lay.row_bytes, dtype=np.uint8)
        # The whole table in one read, no lease (it would block a remove).
        self.native.read_object(self.native.locate([lay.keys[j]], lease=False)[0], rows)
        return rows

    def recorded_checksums(self, lay: Layer) -> dict[int, str]:
        infos = self.native.locate(lay.layer_keys, lease=False)
        return {h: info.checksum for h, info in enumerate(infos) if info.checksum}

    def forget(self, lay: Layer) -> None:
        with lay.lock:
            lay.state.placement = None

    # ---- reads ------------------------------------------------------------------------------------------------

    #: A lookup of this store checks its ids as the kernel builds its request (``kernels.read_direct``'s limits).
    checks_ids = True

    def read(self, jobs: list[Job]) -> None:
        if len(jobs) == 1:
            job = jobs[0]
            self._read_one(job.layer, job.ids, job.out, job.row_ids)
        else:
            for job in jobs:
                if job.row_ids is not None:
                    job.layer.check_range(job.row_ids)
            read_native(self.native, jobs)

    def express(self, lay: Layer, row_ids: Any, out: Any) -> Any:
        """A lookup whose ids are a C-contiguous int64 ``[B, L, H]`` array (and ``out`` None or a matching writable
        array), read by :meth:`_read_one` straight from the call: the arguments are what the facade's checks take as
        they are, so only their range is left, and the read checks it (the kernel call as it builds its request).
        At a model step's cadence every cache is cold and each Python call on the way costs microseconds. Anything
        else (None) goes the facade's way, which converts what it can and names what it cannot."""
        # The facade's tests of arguments it takes as they are (Layer.as_ids, Layer.check_out), in the order that
        # costs least when cold.
        if type(row_ids) is not np.ndarray or row_ids.dtype is not _INT64:
            return None
        shape = row_ids.shape
        if len(shape) != 3 or shape[2] != lay.num_heads or not row_ids.size or not row_ids.flags["C_CONTIGUOUS"]:
            return None
        if out is None:
            rows = np.empty(shape + (lay.dim,), dtype=lay.dtype)
        elif type(out) is np.ndarray and out.dtype is lay.dtype and out.shape == shape + (lay.dim,) \
                and (flags := out.flags).c_contiguous and flags.writeable:
            rows = out
        else:
            return None
        self._read_one(lay, row_ids.reshape(-1, shape[2]), rows.reshape(-1).view(np.uint8), row_ids)
        return rows

    def inline(self, lay: Layer, rows: int) -> bool:
        placement = lay.state.placement
        return (placement is not None and not placement.remote and rows <= PREFETCH_INLINE_ROWS
                and time.monotonic() - placement.checked_at < placement.ttl_s)

    def local_tables(self, lay: Layer) -> list[np.ndarray] | None:
        return self.placements.get(lay, set()).memory.views(lay)

    def read_local(self, lay: Layer, read: Callable[[list[np.ndarray]], bool]) -> bool:
        """``read(tables)`` over the tables mapped here, under :meth:`Placements.read_mapped` (the one rule of mapped
        reads): False where a table was written over meanwhile (the caller's lookup of the rows meets the same
        check, and asks the master again)."""
        placement = self.placements.get(lay, set())
        tables = placement.memory.views(lay)
        if tables is None:
            return False
        try:
            return self.placements.read_mapped(lay, placement, lambda: read(tables))
        except StalePlacement:
            return False

    def _read_one(self, lay: Layer, ids: np.ndarray, flat: np.ndarray, row_ids: np.ndarray | None = None) -> None:
        """One layer's read of ``ids`` (``[M, H]``) into ``flat`` (the output's bytes): the one place that decides
        which way it goes. Under the layer's placement now, the first condition that holds decides:

        =============================================================  ============================================
        condition                                                      way
        =============================================================  ============================================
        this placement's one-call plan (_Lean), fresh (*), one round   one kernel call (``native.read_direct``)
        no placement or past its TTL, several servers, a row cache,    the general path (:meth:`_read_general`)
        more than one round
        heads mapped here                                              gathered in place, then the rows below
        remote heads on one server                                     one read_pairs (:meth:`_read_one_server`)
        =============================================================  ============================================

        (*) younger than its stale limit; past its TTL it is checked with the master after the read, in the
        background. A kernel call the channel does not take (none open on this thread, reads in flight, an id out
        of range) goes on to the rows below. Every way that fails (a segment that does not answer, a placement a
        segment refuses as stale) hands the read to :meth:`_read_general`, which fails over. ``row_ids``: the
        ``[B, L, H]`` ids of ``ids`` while their range is unchecked: the kernel call checks it (an id out of range
        sends nothing), every other way checks it first.
        """
        state = lay.state
        placement, lean = state.placement, state.lean
        age = time.monotonic() - placement.checked_at if placement is not None else math.inf
        if lean is not None and lean.placement is placement and ids.size <= lean.max_ids and age < placement.stale_s:
            native = self.native
            try:
                taken = native.read_direct(lean.endpoint or native.pick_endpoint(lean.endpoints), lean.plan, ids,
                                           lay.row_bytes, flat)
            except SegmentUnavailable:
                if row_ids is not None:  # (the channel may have failed before the request was built)
                    lay.check_range(row_ids)
                self._read_general(lay, ids, flat, failed=lean.address)
                return
            if taken:
                lay.counters.add_remote(ids.size)
                if age >= placement.ttl_s:
                    self.placements.refresh_later(lay)  # in the background: its work does not land inside a lookup
                return
        if row_ids is not None:
            lay.check_range(row_ids)
        if placement is None or age >= placement.ttl_s \
                or len(placement.remote) > 1 or state.cache is not None or not fits_one_round(ids, flat):
            self._read_general(lay, ids, flat)
            return
        if placement.memory.sources:
            try:
                self.placements.gather(lay, placement, ids, flat, self.threads, age)
            except StalePlacement as exc:  # a mapped table was written over: ask the master where it is now
                self._read_general(lay, ids, flat, stale=exc)
                return
        if placement.remote:
            self._read_one_server(lay, placement, ids, flat)
        else:
            lay.counters.add(lookups=1, rows=ids.size, local_rows=ids.size)

    def _read_one_server(self, lay: Layer, placement: Placement, ids: np.ndarray, flat: np.ndarray) -> None:
        """The remote heads of a fresh placement on one server (the mapped ones are gathered already) in one
        read_pairs, the part the general path would send there (:func:`._plan.server_parts`: where every head is
        there, each (m, h) row in output order, straight into ``flat``, and the layer's next lookups read in one
        kernel call, :meth:`_lean_of`; else each distinct row once, scattered). A failed or stale read goes to
        :meth:`_read_general`."""
        (address, endpoints, _, _), checks = placement.remote[0], placement.checks[0]
        (part,) = server_parts(self, lay, placement, ids, flat)
        if part.scatter is None:
            self._lean_of(lay, placement)
        native = self.native
        try:
            data = native.read_pairs(native.pick_endpoint(endpoints),
                                     np.concatenate((checks, part.pairs)) if checks.size else part.pairs,
                                     part.rows * lay.row_bytes, out=flat if part.scatter is None else None)
        except SegmentUnavailable:
            self._read_general(lay, ids, flat, failed=address)
            return
        except StalePlacement as exc:  # removed and its space reused: ask the master where it is now
            self._read_general(lay, ids, flat, stale=exc)
            return
        if part.scatter is not None:  # (else the reply is in flat already)
            place_reply(part, _kernels.readonly(np.frombuffer(data, dtype=np.uint8)), address)
        lay.counters.add(lookups=1, rows=ids.size, local_rows=placement.memory.heads * ids.shape[0],
                         remote_requests=1, remote_rows=part.rows, remote_bytes=part.rows * lay.row_bytes)

    def _read_general(self, lay: Layer, ids: np.ndarray, flat: np.ndarray, *, failed: str | None = None,
                      stale: StalePlacement | None = None) -> None:
        """The general path (:func:`._plan.read_native`: rounds, every server at once, failover), where every way
        of :meth:`_read_one` that fails ends: ``failed``, the address of a segment that did not answer (the
        layer's placement is resolved again, as the master may have dropped the segment, and other replicas serve
        the heads it held); ``stale``, a segment's refusal of the placement (the master is asked where the layer
        is now)."""
        if stale is not None:
            self.placements.stale(lay, stale)
        if failed is not None:
            self.forget(lay)
        read_native(self.native, [Job(self, lay, ids, flat)], failed={failed} if failed is not None else None)

    def _lean_of(self, lay: Layer, placement: Placement) -> "_Lean":
        """What a lookup of the layer needs to read it in one kernel call while ``placement`` holds (every remote
        head on one server, none mapped here, no row cache), made once per placement (by its first read)."""
        lean = lay.state.lean
        if lean is None or lean.placement is not placement:
            address, endpoints, _, _ = placement.remote[0]
            lean = lay.state.lean = _Lean(placement, address, endpoints, _kernels.direct_read_plan(
                placement.order, placement.bases, placement.checks[0], lay.sizes_arr),
                min(READ_ROUND_ROWS, READ_ROUND_BYTES // lay.row_bytes))
        return lean

    def read_cached(self, lay: Layer, placement: Placement, ids: np.ndarray, flat: np.ndarray,
                    counts: dict) -> set[str]:
        """The remote read of a layer with a hot-row cache: cached rows are not requested, fetched ones are added
        (each under the placement it was read under: see :class:`_RowCache`)."""
        uniq, head_starts, inverse = _kernels.plan_unique_rows(ids, placement.order)
        cache = lay.state.cache
        head_of = np.repeat(placement.order, np.diff(head_starts))
        keys = (head_of << 40) | uniq
        rows_all = np.empty((uniq.size, lay.dim), dtype=lay.dtype)
        hit, hits = cache.probe(placement.signature, keys, rows_all)
        miss = ~hit
        tally(counts, flat, cache_hits=hits, cache_misses=int(uniq.size) - hits)
        requests = []
        for g, (address, endpoints, j0, j1) in enumerate(placement.remote):
            endpoint = self.native.pick_endpoint(endpoints)
            lo = int(head_starts[j0])
            rows = uniq[lo:head_starts[j1]]
            wanted = miss[lo:head_starts[j1]]
            positions = lo + np.flatnonzero(wanted)
            starts = np.concatenate(([0], np.cumsum(wanted)))[head_starts[j0:j1 + 1] - lo]
            rows = rows[wanted]
            if rows.size == 0:
                continue  # every row of this server's heads came from the cache
            offsets, lengths, _ = _kernels.rows_to_ranges(rows, starts, placement.bases[j0:j1], lay.row_bytes)
            requests.append((address, endpoint, positions, np.stack((offsets, lengths), axis=1), placement.checks[g]))
        results = self.native.read_pairs_many([(endpoint, np.concatenate((checks, pairs)) if checks.size else pairs)
                                               for _, endpoint, _, pairs, checks in requests])
        fetched = sum(int(p[:, 1].sum()) for _, _, _, p, _ in requests)
        tally(counts, flat, remote_requests=len(requests), remote_rows=fetched // lay.row_bytes, remote_bytes=fetched)
        failed = set()
        for (address, _, positions, _, _), result in zip(requests, results):
            if isinstance(result, BaseException):
                if isinstance(result, SegmentUnavailable):
                    failed.add(address)
                    continue
                if isinstance(result, StalePlacement):
                    self.placements.stale(lay, result)
                    failed.add(STALE)
                    continue
                raise result
            cache.fill(placement.signature, keys, positions, np.frombuffer(result, dtype=lay.dtype).reshape(
                -1, lay.dim), rows_all)
        if not failed:
            bad = _kernels.scatter_rows_prepared(rows_all.reshape(-1).view(np.uint8), inverse, placement.order, 0,
                                                 lay.row_bytes, flat)
            if bad >= 0:
                raise StoreError(f"layer {lay.layer_id}: a cached read returned too few rows")
        return failed

    def close(self) -> None:
        self.placements.close()


class _Lean:
    """A layer read in one kernel call (``DistributedStore.read_direct``): the placement this holds for (every remote
    head on the segment at ``address``, none mapped here, no row cache), its read endpoints, and the plan
    (``kernels.direct_read_plan``: heads, table offsets, checks). A lookup whose layer has one goes straight to the
    read (a model step's lookups come tens of milliseconds apart, every cache cold: each check skipped saves a
    few microseconds there); any failure takes the general path."""

    __slots__ = ("placement", "address", "endpoints", "endpoint", "plan", "max_ids")

    def __init__(self, placement: Placement, address: str, endpoints: tuple, plan: np.ndarray, max_ids: int):
        self.placement = placement
        self.address = address
        self.endpoints = endpoints
        self.endpoint = endpoints[0] if len(endpoints) == 1 else None  # several: each thread picks its own
        self.plan = plan
        self.max_ids = max_ids  # the most ids a lookup may have to be read in one round (READ_ROUND_*)


class _RowCache:
    """A bounded, direct-mapped cache of remote rows (see ``kernels.cache_probe``); thread-safe.

    It holds the rows of one placement at a time: ``tag``, the signature of the placement they were read under
    (each table's place and the put that wrote it; None: none yet), set when the layer's placement changes
    (:meth:`clear`). A read under another placement neither takes rows from it nor adds its own, so no clear can
    race a fill into serving an earlier populate's rows."""

    def __init__(self, capacity_bytes: int, row_bytes: int):
        self.word = 8 if row_bytes % 8 == 0 else 4 if row_bytes % 4 == 0 else 1
        self.words_per_row = row_bytes // self.word
        slots = max(1, capacity_bytes // (row_bytes + 8))
        self.keys = np.full(slots, -1, dtype=np.int64)
        self.rows = np.zeros((slots, self.words_per_row), dtype={8: np.uint64, 4: np.uint32, 1: np.uint8}[self.word])
        self.lock = threading.Lock()
        self.tag: tuple | None = None

    def words(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` ([n, D] of any dtype, C-contiguous) seen as the cache's words."""
        return rows.reshape(rows.shape[0], -1).view(self.rows.dtype)

    def probe(self, tag: tuple, keys: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, int]:
        """Copy the rows of ``keys`` held under placement ``tag`` into ``out``: (hit mask, hit count)."""
        with self.lock:
            if self.tag == tag:
                return _kernels.cache_probe(keys, self.keys, self.rows, self.words(out))
        return np.zeros(keys.size, dtype=np.bool_), 0  # rows of another placement (or none): take nothing

    def fill(self, tag: tuple, keys: np.ndarray, positions: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        """``out[positions] = rows``, keeping each under ``keys[positions]`` while the cache holds ``tag``'s rows."""
        with self.lock:
            if self.tag == tag:
                _kernels.cache_fill(keys, positions, self.words(rows), self.words(out), self.keys, self.rows)
                return
        out[positions] = rows  # the layer moved since this read began: its rows stay out

    def clear(self, tag: tuple | None) -> None:
        """Forget every row; rows read under the placement of signature ``tag`` are kept from now on."""
        with self.lock:
            self.keys.fill(-1)
            self.tag = tag
