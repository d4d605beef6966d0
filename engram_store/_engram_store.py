"""EngramStore: one layer's per-head embedding tables in the store, read by row id.

Keeps the contract of Mooncake's EngramStore: keys ``engram:l{layer_id}:h{head}``, each a C-contiguous
float32 ``[N_h, D]`` table; ``populate`` is create-only and all-or-nothing; ``lookup`` maps ``[B, L, H]`` row
ids to float32 ``[B, L, H, D]`` rows and never clamps an id or fills zeros.

The fast path (on this project's store) resolves the placement of every head once, then per lookup:
heads whose replica sits in a segment mapped on this host are gathered straight from the mapping; for the
others a Numba kernel drops duplicate rows, merges adjacent ones into byte ranges, and one request per
segment server goes out, all at once; the replies are scattered into the output. On a real Mooncake store
the same planning feeds its ``get_into_ranges``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from . import _kernels
from ._errors import (
    ConfigError,
    InvalidArgument,
    InvalidType,
    LeaseActive,
    NotConnected,
    ObjectExists,
    ObjectLost,
    ObjectNotFound,
    SegmentUnavailable,
    StoreError,
    describe,
)
from ._progress import Progress

log = logging.getLogger(__name__)

#: Tables larger than this (all heads together) show a progress bar while they upload.
PROGRESS_MIN_BYTES = 256 << 20
#: How long a resolved table placement is used before it is checked with the master again (one request).
PLACEMENT_TTL_S = 0.5
#: A prefetch of at most this many rows from tables that are all local-direct runs at once (see prefetch).
PREFETCH_INLINE_ROWS = 4096
#: How many times a lookup re-resolves placement after a segment fails before giving up.
FAILOVER_ROUNDS = 2
#: Row formats and the NumPy dtype their items are returned as.
ROW_FORMATS = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "bytes": np.uint8}
_WORD_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
#: Version of the layout manifest written with each layer.
MANIFEST_VERSION = 1
#: Mooncake's ErrorCode::OBJECT_NOT_FOUND and OBJECT_HAS_LEASE, as its Python methods return them.
_MOONCAKE_OBJECT_NOT_FOUND = -704
_MOONCAKE_OBJECT_HAS_LEASE = -706


@dataclass
class EngramStoreConfig:
    """Table geometry of one Engram layer: rows per head and the embedding dimension of every row."""

    table_vocab_sizes: list[int] = field(default_factory=lambda: [1024])
    embedding_dim: int = 64
    #: How a row is stored: "float32" (default), "float16", "bfloat16" (raw bits, read back as uint16) or
    #: "bytes" (opaque rows of ``embedding_dim`` bytes, e.g. 256 FP8 values plus their scales).
    row_format: str = "float32"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> tuple[list[int], int]:
        """Check the fields (they may have been set by attribute); return normalised copies."""
        sizes = self.table_vocab_sizes
        if isinstance(sizes, np.ndarray):
            sizes = sizes.tolist()
        if not isinstance(sizes, (list, tuple)) or not sizes:
            raise InvalidArgument(f"table_vocab_sizes: expected a non-empty list of row counts, got {describe(sizes)}")
        for h, n in enumerate(sizes):
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n <= 0:
                raise InvalidArgument(f"table_vocab_sizes[{h}]: expected a positive integer, got {describe(n)}")
        dim = self.embedding_dim
        if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or dim <= 0:
            raise InvalidArgument(f"embedding_dim: expected a positive integer, got {describe(dim)}")
        if self.row_format not in ROW_FORMATS:
            raise InvalidArgument(f"row_format: expected one of {sorted(ROW_FORMATS)}, got {describe(self.row_format)}")
        return [int(n) for n in sizes], int(dim)

    @property
    def dtype(self) -> np.dtype:
        """The NumPy dtype rows are returned in (uint16 bit patterns for bfloat16, uint8 for opaque bytes)."""
        return np.dtype(ROW_FORMATS[self.row_format])

    @property
    def row_bytes(self) -> int:
        return int(self.embedding_dim) * self.dtype.itemsize


class LookupHandle:
    """A lookup running in the background: ``done()``, ``result(timeout=None)``, ``cancel()``."""

    def __init__(self, future: Future, row_ids: np.ndarray):
        self._future = future
        self.row_ids = row_ids

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> np.ndarray:
        return self._future.result(timeout)

    def cancel(self) -> bool:
        return self._future.cancel()


@dataclass
class _Placement:
    """Where each head's table lives, resolved once per populate (or after a segment failure)."""

    # per mapped segment: (segment, base_elems[H], heads, words, base_words[H], words_per_row, word); the word
    # views (see _kernels.local_gather_plan) are built once here, not on every lookup
    local: list[tuple]
    remote: list[tuple[str, np.ndarray, np.ndarray]]         # (address, heads, base byte offsets)
    order: np.ndarray                                        # remote heads, grouped by address
    replicas: list[tuple]                                    # per head, its replicas
    signature: tuple = ()                                    # (size, replicas) per head, to spot changes
    checked_at: float = 0.0                                  # time.monotonic() of the last check with the master


def _as_row_ids(row_ids: Any, num_heads: int) -> np.ndarray:
    """Validate ``[B, L, H]`` row ids (nested lists or an integer array) into a C-contiguous int64 array."""
    if isinstance(row_ids, np.ndarray):
        arr = row_ids
    else:
        try:
            arr = np.asarray(row_ids)
        except ValueError as exc:  # NumPy refuses ragged nesting
            raise InvalidArgument(f"row_ids: expected a [B, L, H] nesting of equal-length lists, "
                                  f"got ragged lists ({exc})") from None
        if arr.dtype == object:
            raise InvalidArgument("row_ids: expected a [B, L, H] nesting of equal-length lists of integers, "
                                  "got ragged lists or non-numeric items")
    if arr.dtype == np.bool_ or arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f" and not isinstance(row_ids, np.ndarray):
            arr = arr.astype(np.int64)  # np.asarray([]) is float64; the emptiness check below reports it
        else:
            raise InvalidType(f"row_ids: expected integer row ids, got dtype {arr.dtype}")
    if arr.ndim != 3:
        raise InvalidArgument(f"row_ids: expected shape [B, L, H] (3 dimensions), got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidArgument(f"row_ids: expected a non-empty [B, L, H] array, got shape {arr.shape}")
    if arr.shape[2] != num_heads:
        raise InvalidArgument(f"row_ids: expected H = {num_heads} heads in the last dimension, "
                              f"got shape {arr.shape}")
    if arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
        b, l, h = np.unravel_index(int(np.argmax(arr > np.iinfo(np.int64).max)), arr.shape)
        raise InvalidArgument(f"row_ids[{b}, {l}, {h}] = {int(arr[b, l, h])} is out of range for any table")
    return np.ascontiguousarray(arr, dtype=np.int64)


class LookupCounters:
    """Running totals of this layer's lookups; read them with :meth:`EngramStore.stats`.

    ``lookups``: calls served; ``rows``: rows returned (B x L x H); ``local_rows``: of those, gathered straight
    from a mapped segment; ``remote_rows``: distinct rows fetched over the network (after dropping duplicates);
    ``remote_requests`` and ``remote_bytes``: range reads sent and bytes received; ``retries``: failover rounds
    after a segment failed; ``placement_refreshes``: times the table placement was resolved from the master;
    ``cache_hits`` / ``cache_misses``: distinct remote rows found in / missing from the hot-row cache.
    """

    FIELDS = ("lookups", "rows", "local_rows", "remote_rows", "remote_requests", "remote_bytes", "retries",
              "placement_refreshes", "cache_hits", "cache_misses")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def reset(self) -> None:
        with self._lock:
            self._values = dict.fromkeys(self.FIELDS, 0)


class _RowCache:
    """A bounded, direct-mapped cache of remote rows (see ``_kernels.cache_probe``); thread-safe."""

    def __init__(self, capacity_bytes: int, row_bytes: int):
        self.word = 8 if row_bytes % 8 == 0 else 4 if row_bytes % 4 == 0 else 1
        self.words_per_row = row_bytes // self.word
        slots = max(1, capacity_bytes // (row_bytes + 8))
        self.keys = np.full(slots, -1, dtype=np.int64)
        self.rows = np.zeros((slots, self.words_per_row), dtype={8: np.uint64, 4: np.uint32, 1: np.uint8}[self.word])
        self.lock = threading.Lock()

    def words(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` ([n, D] of any dtype, C-contiguous) seen as the cache's words."""
        return rows.reshape(rows.shape[0], -1).view(self.rows.dtype)

    def clear(self) -> None:
        with self.lock:
            self.keys.fill(-1)


class EngramStore:
    """The tables of one Engram layer in a store. A context manager; ``close()`` stops background reads.

    ``store`` may be this project's :class:`DistributedStore`, ``engram_store.compat.MooncakeDistributedStore``,
    a real ``mooncake.store.MooncakeDistributedStore``, or None (metadata only: getters work, reads and
    writes raise :class:`NotConnected`).
    """

    def __init__(self, layer_id: int, config: EngramStoreConfig | None = None, store: Any = None,
                 heads: Sequence[int] | None = None, require_manifest: bool = True, row_cache_bytes: int = 0):
        if not isinstance(layer_id, (int, np.integer)) or isinstance(layer_id, bool) or layer_id < 0:
            raise InvalidArgument(f"layer_id: expected a non-negative integer, got {describe(layer_id)}")
        config = EngramStoreConfig() if config is None else config
        if not isinstance(config, EngramStoreConfig):
            raise InvalidType(f"config: expected an EngramStoreConfig, got {type(config).__name__}")
        sizes, dim = config.validate()
        self.layer_id = int(layer_id)
        self._layer_sizes = sizes
        self._heads = _check_heads(heads, len(sizes))
        self._sizes = [sizes[h] for h in self._heads]
        self._sizes_arr = np.asarray(self._sizes, dtype=np.int64)
        self._dim = dim
        self._row_format = config.row_format
        self._dtype = config.dtype
        self._row_bytes = config.row_bytes
        self._keys = [f"engram:l{self.layer_id}:h{h}" for h in self._heads]
        self._layer_keys = [f"engram:l{self.layer_id}:h{h}" for h in range(len(sizes))]
        self._manifest_key = f"engram:l{self.layer_id}:manifest"
        self._require_manifest = bool(require_manifest)
        self._published = False  # Mooncake path: manifest checked
        if isinstance(row_cache_bytes, bool) or not isinstance(row_cache_bytes, (int, np.integer)) \
                or row_cache_bytes < 0:
            raise InvalidArgument(f"row_cache_bytes: expected a byte count >= 0, got {describe(row_cache_bytes)}")
        self._cache = _RowCache(int(row_cache_bytes), self._row_bytes) if row_cache_bytes else None
        self._store = store
        self._native = _native_store(store)
        self._placement: _Placement | None = None
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._staging: np.ndarray | None = None  # Mooncake path: registered buffer for unique rows
        self._counters = LookupCounters()

    # ---- getters (work without a store) ---------------------------------------------------------

    def get_table_vocab_sizes(self) -> list[int]:
        """Rows of each head this store owns (all heads of the layer unless built with ``heads=``)."""
        return list(self._sizes)

    def get_heads(self) -> list[int]:
        """The layer's head indices this store owns, in the order of the last axis of its row ids."""
        return list(self._heads)

    def get_row_format(self) -> str:
        return self._row_format

    def get_store_keys(self) -> list[str]:
        return list(self._keys)

    def get_num_heads(self) -> int:
        return len(self._sizes)

    def get_embedding_dim(self) -> int:
        return self._dim

    def _require_store(self, what: str) -> None:
        if self._store is None:
            raise NotConnected(f"{what}: this EngramStore for layer {self.layer_id} was built without a store "
                               "(store=None); pass a DistributedStore or MooncakeDistributedStore")

    # ---- populate -------------------------------------------------------------------------------

    def populate(self, embedding_buffers: Sequence[np.ndarray], replica_num: int = 1) -> None:
        """Upload one float32 ``[N_h, D]`` table per head; create-only and all-or-nothing.

        Refuses (naming the key) if any head already exists. If an upload fails, or the call is
        interrupted, every table this call wrote is removed before the error propagates.
        """
        self._require_store("populate")
        tables = self._check_tables(embedding_buffers)
        if not isinstance(replica_num, int) or isinstance(replica_num, bool) or replica_num < 1:
            raise InvalidArgument(f"replica_num: expected an integer >= 1, got {describe(replica_num)}")
        existing = [k for k, e in zip(self._keys, self._batch_is_exist(self._keys)) if e]
        if existing:
            raise ObjectExists(f"populate layer {self.layer_id}: key {existing[0]!r} already exists "
                               f"({len(existing)} of {len(self._keys)} heads present); call "
                               "remove_from_store() first")
        published = self._read_manifest()
        if published is not None:
            self._check_manifest(published)  # another shard published this layer: the layouts must agree
        total = sum(t.nbytes for t in tables)
        bar = Progress(total, f"populate layer {self.layer_id}", enabled=None if total > PROGRESS_MIN_BYTES else False)
        with self._lock:
            self._placement = None
        # The manifest's checksums are computed while the tables upload (zlib releases the GIL).
        with ThreadPoolExecutor(1, thread_name_prefix=f"engram-l{self.layer_id}-crc") as pool:
            checksums = pool.submit(_crc32_hex, tables)
            try:
                if self._native is not None:
                    self._native.batch_put_from(self._keys, tables, replica_num=replica_num, progress=bar)
                else:
                    self._populate_mooncake(tables, replica_num, bar)
            finally:
                bar.close()
        try:
            self._publish(checksums.result(), replica_num)
        except BaseException:
            self._remove_keys(self._keys, force=True)  # all-or-nothing: no tables without their manifest
            raise

    # ---- the layout manifest --------------------------------------------------------------------

    def _manifest_record(self, head_checksums: Sequence[str] = ()) -> dict:
        """The manifest of this layer; ``head_checksums`` are the crc32s of this store's heads, if it wrote them."""
        checksums: list[str | None] = [None] * len(self._layer_sizes)
        for h, crc in zip(self._heads, head_checksums):
            checksums[h] = crc
        return {"format": "engram-layer", "version": MANIFEST_VERSION, "layer_id": self.layer_id,
                "table_vocab_sizes": list(self._layer_sizes), "embedding_dim": self._dim,
                "row_format": self._row_format, "crc32": checksums}

    def _publish(self, head_checksums: Sequence[str], replica_num: int) -> None:
        """Write the manifest last, once every head of the layer is in the store (this call's or other shards')."""
        if self._read_manifest() is not None:
            return
        if len(self._heads) < len(self._layer_sizes) and not all(self._batch_is_exist(self._layer_keys)):
            return  # other shards have yet to write their heads; the last one publishes
        data = json.dumps(self._manifest_record(head_checksums), sort_keys=True).encode()
        try:
            if self._native is not None:
                self._native.put(self._manifest_key, data, replica_num=replica_num)
            else:
                buf = np.frombuffer(data, dtype=np.uint8).copy()
                _check_code(self._store.register_buffer(buf.ctypes.data, buf.nbytes), "register_buffer",
                            self._manifest_key)
                try:
                    config = _replicate_config(replica_num)
                    codes = (self._store.batch_put_from([self._manifest_key], [buf.ctypes.data], [buf.nbytes], config)
                             if config is not None else
                             self._store.batch_put_from([self._manifest_key], [buf.ctypes.data], [buf.nbytes]))
                    _check_code(codes[0], "batch_put_from", self._manifest_key)
                finally:
                    self._store.unregister_buffer(buf.ctypes.data)
        except ObjectExists:
            self._check_manifest(self._read_manifest())  # a concurrent shard published first

    def _read_manifest(self) -> dict | None:
        """The layer's manifest, or None if it has none (not populated, or a populate still running)."""
        if self._native is not None:
            try:
                data = self._native.get(self._manifest_key, lease=False)  # a lease would block remove
            except (ObjectNotFound, ObjectLost):
                return None  # a lost manifest (its segment died) publishes nothing, like a missing one
        else:
            if not self._batch_is_exist([self._manifest_key])[0]:
                return None
            data = self._store.get(self._manifest_key)
            if not data:
                return None
        try:
            record = json.loads(bytes(data))
        except ValueError:
            raise StoreError(f"{self._manifest_key!r} does not hold a layout manifest (not JSON)") from None
        if not isinstance(record, dict) or record.get("format") != "engram-layer":
            raise StoreError(f"{self._manifest_key!r} does not hold an engram layer manifest")
        return record

    def _check_manifest(self, record: dict | None) -> None:
        """Refuse a layer stored with another layout than this store's configuration."""
        if record is None:
            raise ObjectNotFound(f"layer {self.layer_id} is not published: {self._manifest_key!r} is missing "
                                 "(the layer was never populated, a populate is still running, or one was "
                                 "interrupted; remove_from_store(force=True) and populate again)")
        if record.get("version") != MANIFEST_VERSION:
            raise StoreError(f"layer {self.layer_id}: manifest version {record.get('version')!r}; this engram "
                             f"reads version {MANIFEST_VERSION}")
        mine = self._manifest_record()
        for name in ("table_vocab_sizes", "embedding_dim", "row_format"):
            if record.get(name) != mine[name]:
                raise ConfigError(f"layer {self.layer_id} is stored with {name}={record.get(name)!r}, but this "
                                  f"EngramStore is configured with {name}={mine[name]!r}; use the configuration "
                                  "it was populated with")

    def verify(self) -> list[int]:
        """Read this store's heads in full and compare them with the manifest's checksums.

        Returns the heads that were checked (heads written by another shard may have none); raises
        :class:`StoreError` naming the first head whose bytes differ.
        """
        self._require_store("verify")
        record = self._read_manifest()
        self._check_manifest(record)
        checked = []
        for h, key, n in zip(self._heads, self._keys, self._sizes):
            expected = record["crc32"][h] if h < len(record["crc32"]) else None
            if expected is None:
                continue
            ids = np.arange(n, dtype=np.int64)
            rows = np.empty((n, self._dim), dtype=self._dtype)
            full = np.zeros((n, 1, len(self._heads)), dtype=np.int64)
            full[:, 0, self._heads.index(h)] = ids
            rows[:] = self.lookup(full)[:, 0, self._heads.index(h)]
            got = _crc32_hex([rows])[0]
            if got != expected:
                raise StoreError(f"layer {self.layer_id} head {h}: stored rows have crc32 {got}, the manifest "
                                 f"says {expected}")
            checked.append(h)
        return checked

    def _check_tables(self, buffers: Sequence[np.ndarray]) -> list[np.ndarray]:
        if isinstance(buffers, np.ndarray) or not isinstance(buffers, (list, tuple)):
            raise InvalidType(f"embedding_buffers: expected a list of {len(self._sizes)} arrays (one per head), "
                              f"got {type(buffers).__name__}")
        if len(buffers) != len(self._sizes):
            raise InvalidArgument(f"embedding_buffers: expected {len(self._sizes)} tables (one per head), "
                                  f"got {len(buffers)}")
        for h, (t, n) in enumerate(zip(buffers, self._sizes)):
            if not isinstance(t, np.ndarray):
                raise InvalidType(f"embedding_buffers[{h}]: expected a {self._row_format} NumPy array, "
                                  f"got {type(t).__name__}")
            if t.dtype != self._dtype and not (self._row_format == "bfloat16" and t.dtype.name == "bfloat16"):
                raise InvalidType(f"embedding_buffers[{h}]: expected dtype {self._dtype} (row_format="
                                  f"{self._row_format!r}), got {t.dtype}")
            if t.shape != (n, self._dim):
                raise InvalidArgument(f"embedding_buffers[{h}]: expected shape ({n}, {self._dim}) "
                                      f"(table_vocab_sizes[{h}] rows x embedding_dim), got {t.shape}")
            if not t.flags.c_contiguous:
                raise InvalidArgument(f"embedding_buffers[{h}]: expected a C-contiguous array "
                                      "(use np.ascontiguousarray)")
        return [t.view(self._dtype) for t in buffers]

    def _populate_mooncake(self, tables: list[np.ndarray], replica_num: int, bar: Progress) -> None:
        store = self._store
        config = _replicate_config(replica_num)
        written: list[str] = []
        done = 0
        try:
            for key, table in zip(self._keys, tables):
                ptr = table.ctypes.data
                _check_code(store.register_buffer(ptr, table.nbytes), "register_buffer", key)
                try:
                    codes = (store.batch_put_from([key], [ptr], [table.nbytes], config) if config is not None
                             else store.batch_put_from([key], [ptr], [table.nbytes]))
                    _check_code(codes[0], "batch_put_from", key)
                    written.append(key)
                finally:
                    store.unregister_buffer(ptr)
                done += table.nbytes
                bar(done)
        except BaseException:
            for key in written:
                try:
                    store.remove(key)
                except Exception:
                    log.exception("rollback: could not remove %r", key)
            raise

    def _batch_is_exist(self, keys: list[str]) -> list[bool]:
        result = self._store.batch_is_exist(keys)
        out = []
        for key, r in zip(keys, result):
            if r not in (0, 1, True, False):
                raise StoreError(f"batch_is_exist: the store answered {r!r} for {key!r}")
            out.append(bool(r))
        return out

    def stats(self, reset: bool = False) -> dict[str, int]:
        """This layer's lookup counters (see :class:`LookupCounters`); ``reset=True`` zeroes them after reading."""
        values = self._counters.snapshot()
        if reset:
            self._counters.reset()
        return values

    # ---- lookup ---------------------------------------------------------------------------------

    def lookup(self, row_ids: Any) -> np.ndarray:
        """Rows for ``[B, L, H]`` ids as ``[B, L, H, D]`` in the stored format (float32 by default)."""
        ids = self._check_row_ids(row_ids)
        out = np.empty(ids.shape + (self._dim,), dtype=self._dtype)
        self._lookup_checked(ids, out)
        return out

    def lookup_into(self, row_ids: Any, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` (C-contiguous ``[B, L, H, D]`` of the stored dtype) with the rows; no allocation."""
        ids = self._check_row_ids(row_ids)
        shape = ids.shape + (self._dim,)
        if not isinstance(out, np.ndarray):
            raise InvalidType(f"out: expected a {self._dtype} NumPy array, got {type(out).__name__}")
        if out.dtype != self._dtype or out.shape != shape or not out.flags.c_contiguous or not out.flags.writeable:
            raise InvalidArgument(f"out: expected a writable C-contiguous {self._dtype} array of shape {shape}, "
                                  f"got {out.dtype} {out.shape}")
        self._lookup_checked(ids, out, out_aligned=out.ctypes.data % 8 == 0)
        return out

    def prefetch(self, row_ids: Any) -> LookupHandle:
        """Start a lookup in the background; the ids are checked now, errors of the read come from ``result()``.

        A small lookup whose tables are all mapped on this host (a few microseconds of copying) is done at
        once instead: handing it to a thread would cost more than the read.
        """
        ids = self._check_row_ids(row_ids)
        out = np.empty(ids.shape + (self._dim,), dtype=self._dtype)
        placement = self._placement
        if (placement is not None and not placement.remote and ids.size <= PREFETCH_INLINE_ROWS
                and time.monotonic() - placement.checked_at < PLACEMENT_TTL_S):
            done: Future = Future()
            try:
                self._lookup_checked(ids, out)
                done.set_result(out)
            except BaseException as exc:
                done.set_exception(exc)
            return LookupHandle(done, ids)
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"engram-l{self.layer_id}")
            executor = self._executor

        def run() -> np.ndarray:
            self._lookup_checked(ids, out)
            return out

        return LookupHandle(executor.submit(run), ids)

    def _check_row_ids(self, row_ids: Any) -> np.ndarray:
        self._require_store("lookup")
        ids = _as_row_ids(row_ids, len(self._sizes))
        bad = _kernels._first_bad_row(ids.reshape(-1, len(self._sizes)), self._sizes_arr)  # ids: int64, C order
        if bad >= 0:
            B, L, H = ids.shape
            b, rest = divmod(bad, L * H)
            l, h = divmod(rest, H)
            raise InvalidArgument(f"row_ids[{b}, {l}, {h}] = {int(ids[b, l, h])} is out of range: head {h} has "
                                  f"{self._sizes[h]} rows (expected 0 <= id < {self._sizes[h]})")
        return ids

    def _lookup_checked(self, ids: np.ndarray, out: np.ndarray, out_aligned: bool = True) -> None:
        """Read the rows of validated ``ids`` into ``out``; ``out_aligned``: ``out`` starts on an 8-byte boundary
        (true of every array this class allocates; checked for a caller's buffer)."""
        M = ids.shape[0] * ids.shape[1]
        ids2 = ids.reshape(M, len(self._sizes))            # (M, H)
        out3 = out.reshape(M, len(self._sizes), self._dim)  # (M, H, D)
        if self._native is None:
            self._lookup_mooncake(ids2, out3)
            self._counters.add(lookups=1, rows=ids2.size)
            return
        failed: set[str] = set()
        for round_ in range(FAILOVER_ROUNDS + 1):
            placement = self._get_placement(failed)
            local_rows = 0
            if placement.local:
                flat = out3.reshape(-1).view(np.uint8)
                for source in placement.local:
                    if not out_aligned and flat.ctypes.data % (1 << source.shift):  # a caller's unaligned buffer
                        source = _kernels.narrower(source, _kernels.word_shift(flat.ctypes.data))
                    if _kernels.gather_rows(source, ids2, flat) >= 0:
                        raise StoreError(f"layer {self.layer_id}: a row lies outside its mapped segment; the "
                                         "stored layer does not match this configuration")
                    local_rows += M * source.heads.size
            bad = self._lookup_remote(placement, ids2, out3) if placement.remote else set()
            if not bad:
                self._counters.add(lookups=1, rows=ids2.size, local_rows=local_rows, retries=round_)
                return
            failed |= bad
            with self._lock:
                self._placement = None  # re-resolve: the master may have dropped the dead segment
            log.warning("layer %d: segment(s) %s failed; retrying on other replicas", self.layer_id, sorted(bad))
        raise SegmentUnavailable(f"layer {self.layer_id}: no live replica answered for some heads "
                                 f"(failed: {', '.join(sorted(failed))})")

    def _lookup_remote(self, placement: _Placement, ids2: np.ndarray, out3: np.ndarray) -> set[str]:
        """Read the remote heads: one read_ranges per server, all in flight; returns addresses that failed.

        With a row cache, rows found in it are not requested, and the rows that come back are added to it.
        """
        uniq, head_starts, inverse = _kernels.plan_unique_rows(ids2, placement.order)
        cache = self._cache
        rows_all = keys = miss = None
        if cache is not None:
            head_of = np.repeat(placement.order, np.diff(head_starts))
            keys = (head_of << 40) | uniq
            rows_all = np.empty((uniq.size, self._dim), dtype=self._dtype)
            with cache.lock:
                hit, hits = _kernels.cache_probe(keys, cache.keys, cache.rows, cache.words(rows_all))
            miss = ~hit
            self._counters.add(cache_hits=hits, cache_misses=int(uniq.size) - hits)
        requests = []
        j = 0
        for address, heads, base_offsets in placement.remote:
            k = j + len(heads)
            lo = int(head_starts[j])
            rows = uniq[lo:head_starts[k]]
            starts = head_starts[j:k + 1] - lo
            positions = None
            if miss is not None:
                wanted = miss[lo:head_starts[k]]
                positions = lo + np.flatnonzero(wanted)
                starts = np.concatenate(([0], np.cumsum(wanted)))[starts]
                rows = rows[wanted]
            j = k
            if rows.size == 0:
                continue  # every row of this server's heads came from the cache
            offsets, lengths, _ = _kernels.rows_to_ranges(rows, starts, base_offsets, self._row_bytes)
            requests.append((address, heads, lo, positions, offsets, lengths))
        results = self._native.read_ranges_many([(a, o, n) for a, _, _, _, o, n in requests])
        fetched = sum(int(n.sum()) for *_, n in requests)
        self._counters.add(remote_requests=len(requests), remote_rows=fetched // self._row_bytes,
                           remote_bytes=fetched)
        failed = set()
        for (address, heads, row_start, positions, _, _), result in zip(requests, results):
            if isinstance(result, BaseException):
                if isinstance(result, SegmentUnavailable):
                    failed.add(address)
                    continue
                raise result
            rows = np.frombuffer(result, dtype=self._dtype).reshape(-1, self._dim)
            if rows_all is None:
                _kernels.scatter_rows(rows, inverse, heads, row_start, out3)
            else:
                with cache.lock:
                    _kernels.cache_fill(keys, positions, cache.words(rows), cache.words(rows_all), cache.keys,
                                        cache.rows)
        if rows_all is not None and not failed:
            _kernels.scatter_rows(rows_all, inverse, placement.order, 0, out3)
        return failed

    def _get_placement(self, failed: set[str]) -> _Placement:
        """The cached placement, checked with the master every PLACEMENT_TTL_S.

        Another client may remove and repopulate this layer; the check notices within PLACEMENT_TTL_S, and
        the master keeps a removed table's space unallocated for longer than that (its reuse delay), so a
        lookup never reads another object's bytes in between.
        """
        with self._lock:
            cached = self._placement
        now = time.monotonic()
        if cached is not None and now - cached.checked_at < PLACEMENT_TTL_S:
            return cached
        try:
            infos = self._native.locate(self._keys, lease=False)
        except ObjectNotFound:
            if self._require_manifest:
                self._check_manifest(self._read_manifest())  # "not published" says more than a missing head
            raise
        signature = tuple((info.size, tuple((r.segment_id, r.address, r.offset) for r in info.replicas))
                          for info in infos)
        if cached is not None and signature == cached.signature:
            cached.checked_at = now
            return cached
        if self._require_manifest:
            self._check_manifest(self._read_manifest())  # first read, or the layer changed: check its layout
        if self._cache is not None:
            self._cache.clear()  # rows cached from an earlier placement may belong to another table now
        self._counters.add(placement_refreshes=1)
        local: dict[str, tuple[np.ndarray, list[int]]] = {}
        remote: dict[str, list[tuple[int, int]]] = {}
        base_elems = np.zeros(len(self._keys), dtype=np.int64)
        for h, info in enumerate(infos):
            if info.size != self._sizes[h] * self._row_bytes:
                raise StoreError(f"key {info.key!r} holds {info.size} bytes, but table_vocab_sizes[{h}] x "
                                 f"row bytes = {self._sizes[h] * self._row_bytes}; the stored layer was "
                                 "written with another geometry")
            live = [r for r in info.replicas if r.address not in failed]
            if not live:
                raise SegmentUnavailable(f"key {info.key!r}: every replica is on a failed segment "
                                         f"({', '.join(r.address for r in info.replicas)})")
            chosen = None
            for r in live:
                view = self._native.local_view(r)
                item = self._dtype.itemsize
                if view is not None and r.offset % item == 0:
                    chosen = r
                    local.setdefault(r.segment_id, (view[:view.size - view.size % item].view(self._dtype), []))[1] \
                        .append(h)
                    base_elems[h] = r.offset // item
                    break
            if chosen is None:
                r = live[h % len(live)]
                remote.setdefault(r.address, []).append((h, r.offset))
        placement = _Placement(
            local=[_kernels.row_source(seg.view(np.uint8), base_elems * self._dtype.itemsize,
                                       np.asarray(heads, dtype=np.int64), self._row_bytes)
                   for seg, heads in local.values()],
            remote=[(a, np.asarray([h for h, _ in hs], dtype=np.int64), np.asarray([o for _, o in hs], dtype=np.int64))
                    for a, hs in remote.items()],
            order=np.asarray([h for hs in remote.values() for h, _ in hs], dtype=np.int64),
            replicas=[info.replicas for info in infos],
            signature=signature,
            checked_at=now,
        )
        with self._lock:
            self._placement = placement
        return placement

    def _lookup_mooncake(self, ids2: np.ndarray, out3: np.ndarray) -> None:
        """The same planning over Mooncake's ``get_into_ranges`` (one call for all heads)."""
        if self._require_manifest and not self._published:
            self._check_manifest(self._read_manifest())
            self._published = True
        H = len(self._sizes)
        heads = np.arange(H, dtype=np.int64)
        uniq, head_starts, inverse = _kernels.plan_unique_rows(ids2, heads)
        need = int(uniq.size) * self._row_bytes
        with self._lock:
            staging = self._staging
            if staging is None or staging.nbytes < need:
                if staging is not None:
                    self._store.unregister_buffer(staging.ctypes.data)
                staging = np.empty(max(need, 1 << 20), dtype=np.uint8)
                _check_code(self._store.register_buffer(staging.ctypes.data, staging.nbytes), "register_buffer",
                            "staging buffer")
                self._staging = staging
            all_keys, all_dst, all_src, all_sizes = [], [], [], []
            zero = np.zeros(1, dtype=np.int64)
            for h in range(H):
                rows = uniq[head_starts[h]:head_starts[h + 1]]
                offsets, lengths, _ = _kernels.rows_to_ranges(rows, np.array([0, rows.size], dtype=np.int64),
                                                              zero, self._row_bytes)
                dst = int(head_starts[h]) * self._row_bytes + np.concatenate(([0], np.cumsum(lengths)[:-1]))
                all_keys.append(self._keys[h])
                all_dst.append(dst.tolist())
                all_src.append(offsets.tolist())
                all_sizes.append(lengths.tolist())
            results = self._store.get_into_ranges([staging.ctypes.data], [all_keys], [all_dst], [all_src], [all_sizes])
            # Mooncake answers per range with the bytes read, or a negative code (the same for every range
            # of a key that cannot be read). -704 is OBJECT_NOT_FOUND: name it, as the native path does.
            for h, (sizes, got) in enumerate(zip(all_sizes, results[0])):
                if list(got) != sizes:
                    if any(int(g) == _MOONCAKE_OBJECT_NOT_FOUND for g in got):
                        raise ObjectNotFound(f"get_into_ranges: key {self._keys[h]!r} is not in the store "
                                             f"(code {_MOONCAKE_OBJECT_NOT_FOUND}); populate layer "
                                             f"{self.layer_id} first")
                    raise StoreError(f"get_into_ranges: key {self._keys[h]!r} returned {list(got)[:4]}..., "
                                     f"expected the requested sizes")
            rows_all = staging[:need].view(self._dtype).reshape(-1, self._dim)
            _kernels.scatter_rows(rows_all, inverse, heads, 0, out3)

    # ---- removal and lifecycle ------------------------------------------------------------------

    def remove_from_store(self, force: bool = False) -> int:
        """Remove this store's head tables; returns how many were removed (missing keys are skipped).

        The layer's manifest goes first, so readers see the layer as unpublished, never half removed.
        """
        self._require_store("remove_from_store")
        with self._lock:
            self._placement = None
            self._published = False
        self._remove_keys([self._manifest_key], force)
        return self._remove_keys(self._keys, force)

    def _remove_keys(self, keys: Sequence[str], force: bool) -> int:
        removed = 0
        for key in keys:
            if self._native is not None:
                try:
                    self._native.remove(key, force=force)
                    removed += 1
                except ObjectNotFound:
                    pass
            else:
                # Remove first and read the code; no existence check before it: on a real Mooncake store
                # is_exist/batch_is_exist grant the key a read lease (-default_kv_lease_ttl, 10 s by default),
                # so checking first made every remove without force fail with OBJECT_HAS_LEASE (-706).
                try:
                    code = self._store.remove(key, force)
                except TypeError:  # an older binding without the force argument
                    code = self._store.remove(key)
                if code == _MOONCAKE_OBJECT_NOT_FOUND:
                    continue
                if code != 0:
                    if code != _MOONCAKE_OBJECT_HAS_LEASE and not self._batch_is_exist([key])[0]:
                        continue
                    raise LeaseActive(f"remove {key!r}: the store refused with code {code} (a read lease may be "
                                      "live: Mooncake leases a key for -default_kv_lease_ttl, 10 s by default, "
                                      "after each read or existence check; pass force=True)")
                removed += 1
        return removed

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
            staging, self._staging = self._staging, None
        if executor is not None:
            executor.shutdown(wait=True)
        if staging is not None and self._native is None and self._store is not None:
            self._store.unregister_buffer(staging.ctypes.data)

    def __enter__(self) -> "EngramStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"EngramStore(layer_id={self.layer_id}, heads={len(self._sizes)}, "
                f"embedding_dim={self._dim}, store={type(self._store).__name__ if self._store else None})")


def _crc32_hex(tables: Sequence[np.ndarray]) -> list[str]:
    """crc32 of each table's bytes, as 8 hex digits (the manifest's checksums)."""
    return [f"{zlib.crc32(t.reshape(-1).view(np.uint8)) & 0xFFFFFFFF:08x}" for t in tables]


def _check_heads(heads: Sequence[int] | None, num_heads: int) -> list[int]:
    """The sorted, distinct head indices a store owns (all of them for None)."""
    if heads is None:
        return list(range(num_heads))
    if isinstance(heads, (str, bytes)) or not isinstance(heads, (list, tuple, range, np.ndarray)):
        raise InvalidType(f"heads: expected a list of head indices, got {describe(heads)}")
    out = []
    for i, h in enumerate(heads):
        if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or not 0 <= h < num_heads:
            raise InvalidArgument(f"heads[{i}]: expected a head index in [0, {num_heads}), got {describe(h)}")
        out.append(int(h))
    if not out or len(set(out)) != len(out) or out != sorted(out):
        raise InvalidArgument(f"heads: expected a non-empty increasing list of distinct head indices, got {out}")
    return out


def _native_store(store: Any):
    """The DistributedStore behind ``store`` (itself, or the one a compat wrapper holds), else None."""
    from ._client import DistributedStore

    if isinstance(store, DistributedStore):
        return store
    inner = getattr(store, "native_store", None)
    return inner if isinstance(inner, DistributedStore) else None


def _replicate_config(replica_num: int):
    """Mooncake's ReplicateConfig for a table upload: ``replica_num`` copies, hard-pinned.

    Hard pin is what keeps a table in a real Mooncake store: its master evicts unpinned objects whose read
    lease has run out as soon as a segment passes ``-eviction_high_watermark_ratio`` (0.9) or an allocation
    fails, and with the default config (no pin) a table would silently disappear under memory pressure.
    ``with_hard_pin`` objects are never eviction candidates (tests/mooncake checks both behaviours). Without
    the mooncake package (a duck-typed store) a single replica needs no config, as before.
    """
    try:
        from mooncake.store import ReplicateConfig  # type: ignore
    except ImportError:
        if replica_num == 1:
            return None
        raise InvalidArgument("replica_num > 1 on a Mooncake store needs mooncake.store.ReplicateConfig") from None
    config = ReplicateConfig()
    config.replica_num = replica_num
    config.with_hard_pin = True  # tables are immutable once published: never evicted
    return config


def _check_code(code: Any, op: str, what: str) -> None:
    if isinstance(code, (int, np.integer)) and code < 0:
        raise StoreError(f"{op} for {what} failed with code {int(code)}")

