"""EngramStore: the per-head embedding tables of one or more Engram layers, read by row id.

Keeps the contract of Mooncake's EngramStore: keys ``engram:l{layer_id}:h{head}``, each a C-contiguous
``[N_h, D]`` table (float32 by default, or 16-bit floats, or opaque byte rows); ``populate`` is create-only and
all-or-nothing; ``lookup`` maps ``[B, L, H]`` row ids to ``[B, L, H, D]`` rows and never clamps an id or fills
zeros.

Where tables live, per layer:

* in a store (this project's :class:`DistributedStore`, its Mooncake-compatible wrapper, or a real
  ``MooncakeDistributedStore``): heads whose replica sits in a segment mapped on this host are gathered straight
  from the mapping; for the others a Numba kernel drops duplicate rows, merges adjacent ones into byte ranges,
  and one request per segment server goes out for every layer of the call, all at once; the replies are
  scattered into the output. On a real Mooncake store the same planning feeds its ``get_into_ranges``.
* on this host without a store: the caller's own arrays (:meth:`EngramStore.bind_local`), or layers published
  as files under ``local_dir`` (see :mod:`engram_store._local`) and mapped read-only by every process.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import xxhash

from . import kernels as _kernels
from .kernels._gather import _scatter_rows
from .kernels._planning import _direct_pairs, _first_bad_row, _plan_reads
from ._errors import (
    ConfigError,
    EngramError,
    InvalidArgument,
    InvalidType,
    LeaseActive,
    NotConnected,
    ObjectExists,
    ObjectLost,
    ObjectNotFound,
    SegmentUnavailable,
    StoreError,
    Unavailable,
    describe,
)
from ._local import LocalDir, MappedLayer, sources_for
from ._progress import Progress

log = logging.getLogger(__name__)

#: Tables larger than this (all heads together) show a progress bar while they upload.
PROGRESS_MIN_BYTES = 256 << 20
#: How long a resolved table placement is used before it is checked with the master again (one request, in the
#: background up to PLACEMENT_STALE_S, before use past it). Both stay well below the master's reuse delay (2 s).
PLACEMENT_TTL_S = 0.5
PLACEMENT_STALE_S = 1.0
#: The longest a lookup waits for the master to check a placement it already has, before reading from it anyway.
REFRESH_TIMEOUT_MS = 2000
#: After the master failed a placement check, lookups do not wait for it for this long (checks go on behind).
MASTER_RETRY_S = 2.0
#: At most one warning per EngramStore this often while the master does not answer.
MASTER_WARN_INTERVAL_S = 10.0
#: A prefetch of at most this many rows from tables that are all read in place runs at once (see prefetch).
PREFETCH_INLINE_ROWS = 4096
#: A local gather of at least this many rows is split over the store's ``threads``.
THREADED_MIN_ROWS = 16384
#: A lookup from the native store reads at most this many output bytes and rows per round (one request per
#: segment server); a larger one, or several layers batched together, is read in several rounds. This keeps
#: every request well inside a segment's limits (MAX_READ_BYTES, MAX_RANGES).
READ_ROUND_BYTES = 64 << 20
READ_ROUND_ROWS = 1 << 20
#: A remote lookup of at most this many rows, with every head of its layer on one server, reads each (m, h) row
#: as it is into the output (no sort, no deduplication, no scatter: a repeated row travels again, which costs
#: less than sorting and scattering at every size measured, see bench/bench_read_plans.py). A layer spread over
#: several servers reads each distinct row once and scatters it: there the reply is not the output, and placing
#: it by head cost more than deduplication saved once rows repeat.
DIRECT_MAX_ROWS = READ_ROUND_ROWS
#: How many times a lookup re-resolves placement after a segment fails before giving up.
FAILOVER_ROUNDS = 2
#: Row formats and the NumPy dtype their items are returned as.
ROW_FORMATS = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "bytes": np.uint8}
#: Version of the layout manifest written with each layer (1: crc32 checksums; 2: xxh3_64 or crc32, named).
MANIFEST_VERSION = 2
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
        row_bytes = int(dim) * np.dtype(ROW_FORMATS[self.row_format]).itemsize
        for h, n in enumerate(sizes):
            if int(n) > (2**63 - 1) // row_bytes:
                raise InvalidArgument(f"table_vocab_sizes[{h}]: expected at most {(2**63 - 1) // row_bytes} rows of "
                                      f"{row_bytes} bytes (a table must fit in 64-bit byte offsets), got {int(n)}")
        return [int(n) for n in sizes], int(dim)

    @property
    def dtype(self) -> np.dtype:
        """The NumPy dtype rows are returned in (uint16 bit patterns for bfloat16, uint8 for opaque bytes)."""
        return np.dtype(ROW_FORMATS[self.row_format])

    @property
    def row_bytes(self) -> int:
        return int(self.embedding_dim) * self.dtype.itemsize


class LookupHandle:
    """A lookup that may be running in the background: ``done()``, ``result(timeout=None)``, ``cancel()``.

    ``result()`` returns the rows (the caller's ``out`` buffer if one was given) or raises what the read raised.
    """

    def __init__(self, future: Future, row_ids: Any):
        self._future = future
        self.row_ids = row_ids

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Any:
        return self._future.result(timeout)

    def cancel(self) -> bool:
        return self._future.cancel()


class LookupCounters:
    """Running totals of a layer's lookups; read them with :meth:`EngramStore.stats`.

    ``lookups``: calls served; ``rows``: rows returned (B x L x H); ``local_rows``: of those, gathered straight
    from memory on this host; ``remote_rows``: rows fetched over the network (each (m, h) row where one server
    holds the whole layer, else distinct rows only); ``remote_requests`` and ``remote_bytes``: range reads sent
    and bytes received (a request that carries several layers counts once for each); ``retries``: failover
    rounds after a segment failed; ``placement_refreshes``: times the table placement was resolved from the
    master; ``cache_hits`` / ``cache_misses``: distinct remote rows found in / missing from the hot-row cache.
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


@dataclass
class _Placement:
    """Where a layer's head tables live, resolved from the master (and rechecked every PLACEMENT_TTL_S)."""

    local: list                       # _kernels.RowSource per group of tables mapped on this host
    remote: list[tuple[str, tuple, int, int]]  # (segment address, endpoints that serve its reads, j0, j1): the
                                               # segment holds heads order[j0:j1]
    order: np.ndarray                 # remote heads, grouped by server (read-only int64)
    bases: np.ndarray                 # byte offset of head order[j]'s table in its segment (read-only int64)
    replicas: list[tuple]             # per head, its replicas
    signature: tuple = ()             # (size, replicas) per head, to spot changes
    checked_at: float = 0.0           # time.monotonic() of the last check with the master
    keep: list = field(default_factory=list)  # the mapped tables the sources read (kept alive here)
    tables: dict = field(default_factory=dict)  # head -> flat read-only uint8 view of its table, for heads in memory

    @property
    def local_heads(self) -> int:
        return sum(int(source.heads.size) for source in self.local)


class _Layer:
    """One layer's geometry and read state inside an :class:`EngramStore`."""

    def __init__(self, layer_id: Any, config: Any, heads: Sequence[int] | None, row_cache_bytes: int):
        if not isinstance(layer_id, (int, np.integer)) or isinstance(layer_id, bool) or layer_id < 0:
            raise InvalidArgument(f"layer_id: expected a non-negative integer, got {describe(layer_id)}")
        if not isinstance(config, EngramStoreConfig):
            raise InvalidType(f"config: expected an EngramStoreConfig, got {type(config).__name__}")
        sizes, dim = config.validate()
        self.layer_id = int(layer_id)
        self.layer_sizes = sizes
        self.heads = _check_heads(heads, len(sizes))
        self.sizes = [sizes[h] for h in self.heads]
        self.sizes_arr = _kernels.readonly(np.asarray(self.sizes, dtype=np.int64))
        self.num_heads = len(self.sizes)
        self.dim = dim
        self.row_format = config.row_format
        self.dtype = config.dtype
        self.row_bytes = config.row_bytes
        self.keys = [f"engram:l{self.layer_id}:h{h}" for h in self.heads]
        self.layer_keys = [f"engram:l{self.layer_id}:h{h}" for h in range(len(sizes))]
        self.manifest_key = f"engram:l{self.layer_id}:manifest"
        self.cache = _RowCache(int(row_cache_bytes), self.row_bytes) if row_cache_bytes else None
        self.counters = LookupCounters()
        self.lock = threading.Lock()
        self.placement: _Placement | None = None
        self.known: tuple | None = None        # (infos, signature, time) of the master's last answer
        self.validated: tuple = ()             # the signature whose manifest was checked
        self.refreshing = False                # a background placement check is running
        self.published = False                 # Mooncake path: manifest checked
        self.local: _Placement | None = None   # tables read in place without a store (bind_local, local_dir)
        self.mapped: MappedLayer | None = None  # local_dir: the published files this layer reads

    def check_ids(self, row_ids: Any) -> np.ndarray:
        """``[B, L, H]`` row ids, validated: C-contiguous int64, every id in its head's range."""
        ids = row_ids
        H = self.num_heads
        # The common case (a C-contiguous int64 array of the right shape) skips the generic conversion.
        if not (type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 3 and ids.shape[2] == H
                and ids.size and ids.flags.c_contiguous):
            ids = _as_row_ids(row_ids, H)
        bad = _first_bad_row(_kernels.readonly(ids.reshape(-1, H)), self.sizes_arr)
        if bad >= 0:
            B, L, _ = ids.shape
            b, rest = divmod(int(bad), L * H)
            l, h = divmod(rest, H)
            raise InvalidArgument(f"row_ids[{b}, {l}, {h}] = {int(ids[b, l, h])} is out of range: head {h} of layer "
                                  f"{self.layer_id} has {self.sizes[h]} rows (expected 0 <= id < {self.sizes[h]})")
        return ids

    def check_out(self, out: Any, shape: tuple[int, ...]) -> np.ndarray:
        """A caller's output buffer as a writable C-contiguous array of ``shape`` and this layer's dtype.

        Accepts NumPy arrays, any CPU tensor that speaks DLPack (``__dlpack__``: torch, JAX, CuPy's host arrays,
        NumPy), and anything else NumPy views without copying (the buffer protocol, ``__array_interface__``); a
        flat byte buffer of exactly the right size is viewed with the right dtype and shape. Never copies: a
        buffer that cannot be written in place is refused.
        """
        arr = out
        if not isinstance(arr, np.ndarray):
            if isinstance(out, (list, tuple, str, bytes)) or out is None:
                raise InvalidType(f"out: expected a writable {self.dtype} buffer of shape {shape} (a NumPy array, "
                                  f"a CPU tensor with __dlpack__, or an object with the buffer protocol or "
                                  f"__array_interface__), got {type(out).__name__}")
            arr = _from_dlpack(out) if hasattr(out, "__dlpack__") else None
            if arr is None:
                try:
                    arr = np.asarray(out)
                except Exception:  # anything NumPy cannot view
                    arr = None
                if arr is None or arr.dtype == object or arr.base is None:  # no view of the caller's memory
                    raise InvalidType(f"out: expected a writable {self.dtype} buffer of shape {shape} that NumPy "
                                      f"can view in place, got {type(out).__name__}")
        if arr.dtype != self.dtype and arr.dtype == np.uint8 and arr.ndim == 1 and arr.flags.c_contiguous \
                and arr.size == int(np.prod(shape)) * self.dtype.itemsize:
            arr = arr.view(self.dtype).reshape(shape)  # a flat byte buffer of the right size
        if arr.dtype != self.dtype or arr.shape != shape or not arr.flags.c_contiguous or not arr.flags.writeable:
            raise InvalidArgument(f"out: expected a writable C-contiguous {self.dtype} array of shape {shape}, got "
                                  f"{arr.dtype} {arr.shape}{'' if arr.flags.c_contiguous else ' (not C-contiguous)'}"
                                  f"{'' if arr.flags.writeable else ' (read-only)'}")
        return arr

    def manifest_record(self, checksums: Mapping[int, str | None] | None = None, algorithm: str = "xxh3_64") -> dict:
        """The manifest of this layer; ``checksums`` by head index (heads without one record None)."""
        checksums = checksums or {}
        values = [checksums.get(h) for h in range(len(self.layer_sizes))]
        return {"format": "engram-layer", "version": MANIFEST_VERSION, "layer_id": self.layer_id,
                "table_vocab_sizes": list(self.layer_sizes), "embedding_dim": self.dim,
                "row_format": self.row_format, "checksum": algorithm, "checksums": values}


#: DLPack device types whose memory the CPU reads and writes: kDLCPU, kDLCUDAHost (pinned), kDLCUDAManaged.
_DLPACK_HOST_DEVICES = {1: "CPU", 3: "CUDA host (pinned)", 13: "CUDA managed"}


def _from_dlpack(out: Any) -> np.ndarray:
    """A NumPy view of a tensor that speaks DLPack, sharing its memory (never a copy); refused unless the memory is
    the CPU's. A tensor that exports read-only memory yields a read-only view, which :meth:`check_out` refuses."""
    try:
        device_type = int(out.__dlpack_device__()[0])
    except Exception as exc:
        raise InvalidType(f"out: {type(out).__name__} has __dlpack__ but no usable __dlpack_device__ ({exc})") from None
    if device_type not in _DLPACK_HOST_DEVICES:
        raise InvalidArgument(f"out: a {type(out).__name__} on DLPack device type {device_type}; lookups write into "
                              "host memory (a CPU or pinned tensor): read into one and copy it to the device")
    try:
        return np.from_dlpack(out, copy=False)
    except TypeError:  # NumPy < 2.1 has no copy= (and never copies)
        return np.from_dlpack(out)
    except (BufferError, ValueError, RuntimeError) as exc:
        raise InvalidType(f"out: NumPy cannot view {type(out).__name__} through DLPack in place ({exc})") from None


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


class EngramStore:
    """The tables of one or more Engram layers. A context manager; ``close()`` stops background reads.

    One layer (the form of Mooncake's first EngramStore)::

        EngramStore(layer_id, config, store)

    Several layers, each with its own geometry, read together (one request per segment server for all)::

        EngramStore({1: config_1, 15: config_15}, store=store)

    ``store`` may be this project's :class:`DistributedStore`, ``engram_store.compat.MooncakeDistributedStore``,
    a real ``mooncake.store.MooncakeDistributedStore``, or None: then tables are read from memory on this host,
    bound with :meth:`bind_local` or published under ``local_dir`` by :meth:`populate` (see
    :mod:`engram_store._local`); with neither, getters work and reads raise :class:`NotConnected`.

    Methods act on the only layer, or on the one named with ``layer=``. ``heads`` (one layer only) makes a
    head shard: the store owns and reads just those heads. ``threads`` > 1 splits large gathers from memory on
    this host over that many threads (the kernel releases the GIL).
    """

    def __init__(self, layer_id: int | Mapping[int, EngramStoreConfig], config: EngramStoreConfig | None = None,
                 store: Any = None, *, heads: Sequence[int] | None = None, require_manifest: bool = True,
                 row_cache_bytes: int = 0, local_dir: str | os.PathLike | None = None, threads: int = 1):
        if isinstance(row_cache_bytes, bool) or not isinstance(row_cache_bytes, (int, np.integer)) \
                or row_cache_bytes < 0:
            raise InvalidArgument(f"row_cache_bytes: expected a byte count >= 0, got {describe(row_cache_bytes)}")
        if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or not 1 <= threads <= 256:
            raise InvalidArgument(f"threads: expected an integer in [1, 256], got {describe(threads)}")
        if isinstance(layer_id, Mapping):
            if config is not None:
                raise InvalidArgument("config: a multi-layer EngramStore takes its configs in the layers mapping; "
                                      "pass the store as store=")
            if heads is not None:
                raise InvalidArgument("heads: head shards are for a single-layer EngramStore")
            if not layer_id:
                raise InvalidArgument("layers: expected at least one {layer_id: EngramStoreConfig} entry, got none")
            layers = [_Layer(lid, cfg, None, row_cache_bytes) for lid, cfg in sorted(layer_id.items(),
                                                                                    key=lambda kv: _sort_key(kv[0]))]
            self.layer_id: int | None = None
        else:
            layers = [_Layer(layer_id, EngramStoreConfig() if config is None else config, heads, row_cache_bytes)]
            self.layer_id = layers[0].layer_id
        self._layers = {layer.layer_id: layer for layer in layers}
        self._require_manifest = bool(require_manifest)
        self._store = store
        self._native = _native_store(store)
        if store is not None and self._native is None and not _looks_like_mooncake(store):
            raise InvalidType(f"store: expected a DistributedStore, a MooncakeDistributedStore or None, "
                              f"got {type(store).__name__}")
        self._local_dir = None
        if local_dir is not None and os.fspath(local_dir) != "":
            if store is not None:
                raise InvalidArgument("local_dir: tables are either in a store or under local_dir, not both; "
                                      "pass store=None to use local_dir")
            self._local_dir = LocalDir(local_dir)
            for layer in layers:  # published layers are opened (and their layout checked) now
                self._open_local(layer)
        self._threads = int(threads)
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._staging: np.ndarray | None = None  # Mooncake path: registered buffer for unique rows
        self._staging_release: weakref.finalize | None = None
        self._refresher: ThreadPoolExecutor | None = None  # background placement checks
        self._master_trouble_at = 0.0
        self._master_warned_at = -MASTER_WARN_INTERVAL_S
        self._closed = False

    # ---- layers and getters (work without a store) ------------------------------------------------

    def _layer(self, layer: int | None) -> _Layer:
        if layer is None:
            if len(self._layers) == 1:
                return next(iter(self._layers.values()))
            raise InvalidArgument(f"layer: this EngramStore holds layers {self.get_layer_ids()}; name one with "
                                  "layer=")
        found = self._layers.get(layer) if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool) \
            else None
        if found is None:
            raise InvalidArgument(f"layer: unknown Engram layer {describe(layer)}; this EngramStore holds "
                                  f"{self.get_layer_ids()}")
        return found

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
    def local_dir(self) -> str | None:
        return self._local_dir.path if self._local_dir is not None else None

    def _require_store(self, what: str, layer: _Layer | None = None) -> None:
        if self._store is None:
            name = f"layer {layer.layer_id}" if layer is not None else f"layers {self.get_layer_ids()}"
            raise NotConnected(f"{what}: this EngramStore for {name} was built without a store (store=None); pass "
                               "a DistributedStore or MooncakeDistributedStore"
                               + ("" if self._local_dir else ", or local_dir= for tables in files on this host"))

    # ---- populate -------------------------------------------------------------------------------

    def populate(self, embedding_buffers: Sequence[np.ndarray], replica_num: int = 1, *,
                 layer: int | None = None) -> None:
        """Write one ``[N_h, D]`` table per head of the layer; create-only and all-or-nothing.

        Into the store: refuses (naming the key) if any head already exists; if an upload fails, or the call is
        interrupted, every table this call wrote is removed before the error propagates. Under ``local_dir``:
        the tables are copied into files and published atomically (see :mod:`engram_store._local`). The
        caller's buffers may be reused or freed once this returns.
        """
        lay = self._layer(layer)
        tables = self._check_tables(lay, embedding_buffers)
        if not isinstance(replica_num, int) or isinstance(replica_num, bool) or replica_num < 1:
            raise InvalidArgument(f"replica_num: expected an integer >= 1, got {describe(replica_num)}")
        if self._local_dir is not None:
            self._populate_local(lay, tables)
            return
        self._require_store("populate", lay)
        existing = [k for k, e in zip(lay.keys, self._batch_is_exist(lay.keys)) if e]
        if existing:
            raise ObjectExists(f"populate layer {lay.layer_id}: key {existing[0]!r} already exists "
                               f"({len(existing)} of {len(lay.keys)} heads present); call "
                               "remove_from_store() first")
        published = self._read_manifest(lay)
        if published is not None:
            self._check_manifest(lay, published)  # another shard published this layer: the layouts must agree
        bar = _populate_progress(lay, tables)
        with lay.lock:
            lay.placement = None
        try:
            if self._native is not None:
                # The store computes each table's xxh3_64 while it uploads (and the master keeps them).
                algorithm, values = "xxh3_64", self._native.put_objects(lay.keys, tables, replica_num=replica_num,
                                                                        progress=bar)
            else:
                # The manifest's checksums are computed while the tables upload (the hash releases the GIL).
                with ThreadPoolExecutor(1, thread_name_prefix=f"engram-l{lay.layer_id}-checksum") as pool:
                    checksums = pool.submit(_checksums, tables)
                    self._populate_mooncake(lay, tables, replica_num, bar)
                    algorithm, values = checksums.result()
        finally:
            bar.close()
        try:
            self._publish(lay, values, replica_num, algorithm)
        except BaseException:
            self._remove_keys(lay.keys, force=True)  # all-or-nothing: no tables without their manifest
            raise

    def _populate_local(self, lay: _Layer, tables: list[np.ndarray]) -> None:
        bar = _populate_progress(lay, tables)
        try:
            self._local_dir.publish(lay.layer_id, lay.row_bytes, lay.layer_sizes, tables, progress=bar)
        finally:
            bar.close()
        self._open_local(lay)

    def bind_local(self, embedding_buffers: Sequence[np.ndarray], *, layer: int | None = None) -> None:
        """Read the layer from the caller's own ``[N_h, D]`` arrays, in place: no copy, no store.

        The arrays are kept referenced until :meth:`close`; do not modify, resize or unmap them while bound.
        Only for an EngramStore without a store or ``local_dir``, and once per layer.
        """
        lay = self._layer(layer)
        if self._store is not None or self._local_dir is not None:
            raise InvalidArgument(f"bind_local: layer {lay.layer_id} of this EngramStore is read from "
                                  f"{'a store' if self._store is not None else 'local_dir'}; bind_local is for an "
                                  "EngramStore built with store=None and no local_dir")
        tables = self._check_tables(lay, embedding_buffers)
        with lay.lock:
            if lay.local is not None:
                raise InvalidArgument(f"bind_local: layer {lay.layer_id} is already bound; build a new EngramStore "
                                      "to read other tables")
            lay.local = self._local_placement(lay, [t.reshape(-1).view(np.uint8) for t in tables],
                                              keep=list(embedding_buffers))

    def _local_placement(self, lay: _Layer, flat_tables: list[np.ndarray], keep: list) -> _Placement:
        empty = _kernels.readonly(np.zeros(0, dtype=np.int64))
        return _Placement(local=sources_for(list(enumerate(flat_tables)), lay.num_heads, lay.row_bytes), remote=[],
                          order=empty, bases=empty, replicas=[], keep=keep + flat_tables,
                          tables={j: _kernels.readonly(t) for j, t in enumerate(flat_tables)})

    def _open_local(self, lay: _Layer) -> bool:
        """Map the layer's published files if they are there (and not mapped yet); whether the layer is readable."""
        if lay.local is not None:
            return True
        with lay.lock:
            if lay.local is None:
                mapped = self._local_dir.open(lay.layer_id, lay.row_bytes, lay.layer_sizes)
                if mapped is None:
                    return False
                lay.mapped = mapped
                lay.local = self._local_placement(lay, [mapped.tables[h] for h in lay.heads], keep=[mapped])
        return True

    # ---- the layout manifest --------------------------------------------------------------------

    def _publish(self, lay: _Layer, checksums: Sequence[str], replica_num: int, algorithm: str = "xxh3_64") -> None:
        """Write the manifest last, once every head of the layer is in the store (this call's or other shards')."""
        if self._read_manifest(lay) is not None:
            return
        by_head = dict(zip(lay.heads, checksums))
        if len(lay.heads) < len(lay.layer_sizes):
            if not all(self._batch_is_exist(lay.layer_keys)):
                return  # other shards have yet to write their heads; the last one publishes
            if self._native is not None and algorithm == "xxh3_64":
                # The other shards' checksums, as their writers gave them to the master with their tables.
                infos = self._native.locate(lay.layer_keys, lease=False)
                by_head = {h: by_head.get(h) or info.checksum or None for h, info in enumerate(infos)}
        data = json.dumps(lay.manifest_record(by_head, algorithm), sort_keys=True).encode()
        try:
            if self._native is not None:
                self._native.put(lay.manifest_key, data, replica_num=replica_num)
            else:
                _mooncake_put(self._store, lay.manifest_key, np.frombuffer(data, dtype=np.uint8).copy(),
                              _replicate_config(replica_num))
        except ObjectExists:
            self._check_manifest(lay, self._read_manifest(lay))  # a concurrent shard published first

    def _read_manifest(self, lay: _Layer) -> dict | None:
        """The layer's manifest, or None if it has none (not populated, or a populate still running)."""
        if self._native is not None:
            try:
                data = self._native.get(lay.manifest_key, lease=False)  # a lease would block remove
            except (ObjectNotFound, ObjectLost):
                return None  # a lost manifest (its segment died) publishes nothing, like a missing one
        else:
            if not self._batch_is_exist([lay.manifest_key])[0]:
                return None
            data = self._store.get(lay.manifest_key)
            if not data:
                return None
        try:
            record = json.loads(bytes(data))
        except ValueError:
            raise StoreError(f"{lay.manifest_key!r} does not hold a layout manifest (not JSON)") from None
        if not isinstance(record, dict) or record.get("format") != "engram-layer":
            raise StoreError(f"{lay.manifest_key!r} does not hold an engram layer manifest")
        return record

    def _check_manifest(self, lay: _Layer, record: dict | None) -> None:
        """Refuse a layer stored with another layout than this store's configuration."""
        if record is None:
            raise ObjectNotFound(f"layer {lay.layer_id} is not published: {lay.manifest_key!r} is missing "
                                 "(the layer was never populated, a populate is still running, or one was "
                                 "interrupted; remove_from_store(force=True) and populate again)")
        if record.get("version") not in (1, MANIFEST_VERSION):
            raise StoreError(f"layer {lay.layer_id}: manifest version {record.get('version')!r}; this engram "
                             f"reads versions 1 to {MANIFEST_VERSION}")
        mine = lay.manifest_record()
        for name in ("table_vocab_sizes", "embedding_dim", "row_format"):
            if record.get(name) != mine[name]:
                raise ConfigError(f"layer {lay.layer_id} is stored with {name}={record.get(name)!r}, but this "
                                  f"EngramStore is configured with {name}={mine[name]!r}; use the configuration "
                                  "it was populated with")

    def verify(self, *, layer: int | None = None) -> list[int]:
        """Read this store's heads of the layer in full and compare them with the manifest's checksums.

        Returns the heads that were checked (heads written by another shard may have none); raises
        :class:`StoreError` naming the first head whose bytes differ.
        """
        lay = self._layer(layer)
        self._require_store("verify", lay)
        record = self._read_manifest(lay)
        self._check_manifest(lay, record)
        if record.get("version") == 1:
            algorithm, values = "crc32", record.get("crc32", [])
        else:
            algorithm, values = record.get("checksum"), record.get("checksums", [])
        checked = []
        for j, (h, n) in enumerate(zip(lay.heads, lay.sizes)):
            expected = values[h] if h < len(values) else None
            if expected is None:
                continue
            rows = np.empty(n * lay.row_bytes, dtype=np.uint8)
            if self._native is not None:  # the whole table in one read, no lease (it would block a remove)
                self._native.read_object(self._native.locate([lay.keys[j]], lease=False)[0], rows)
            else:
                full = np.zeros((n, 1, lay.num_heads), dtype=np.int64)
                full[:, 0, j] = np.arange(n, dtype=np.int64)
                rows = np.ascontiguousarray(self.lookup(full, layer=lay.layer_id)[:, 0, j]).reshape(-1).view(np.uint8)
            got = _checksums([rows], algorithm)[1][0]
            if got != expected:
                raise StoreError(f"layer {lay.layer_id} head {h}: stored rows have {algorithm} {got}, the manifest "
                                 f"says {expected}")
            checked.append(h)
        return checked

    def _check_tables(self, lay: _Layer, buffers: Sequence[np.ndarray]) -> list[np.ndarray]:
        n_heads = lay.num_heads
        if isinstance(buffers, np.ndarray) or not isinstance(buffers, (list, tuple)):
            raise InvalidType(f"embedding_buffers: expected a list of {n_heads} arrays (one per head), "
                              f"got {type(buffers).__name__}")
        if len(buffers) != n_heads:
            raise InvalidArgument(f"embedding_buffers: expected {n_heads} tables (one per head), got {len(buffers)}")
        for h, (t, n) in enumerate(zip(buffers, lay.sizes)):
            if not isinstance(t, np.ndarray):
                raise InvalidType(f"embedding_buffers[{h}]: expected a {lay.row_format} NumPy array, "
                                  f"got {type(t).__name__}")
            if t.dtype != lay.dtype and not (lay.row_format == "bfloat16" and t.dtype.name == "bfloat16"):
                raise InvalidType(f"embedding_buffers[{h}]: expected dtype {lay.dtype} (row_format="
                                  f"{lay.row_format!r}), got {t.dtype}")
            if t.shape != (n, lay.dim):
                raise InvalidArgument(f"embedding_buffers[{h}]: expected shape ({n}, {lay.dim}) "
                                      f"(table_vocab_sizes[{h}] rows x embedding_dim), got {t.shape}")
            if not t.flags.c_contiguous:
                raise InvalidArgument(f"embedding_buffers[{h}]: expected a C-contiguous array "
                                      "(use np.ascontiguousarray)")
        return [t.view(lay.dtype) for t in buffers]

    def _populate_mooncake(self, lay: _Layer, tables: list[np.ndarray], replica_num: int, bar: Progress) -> None:
        store = self._store
        config = _replicate_config(replica_num)
        written: list[str] = []
        done = 0
        try:
            for key, table in zip(lay.keys, tables):
                _mooncake_put(store, key, table, config)
                written.append(key)
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

    def stats(self, reset: bool = False, *, layer: int | None = None) -> dict[str, int]:
        """Lookup counters (see :class:`LookupCounters`) of the layer, or summed over all layers of a multi-layer
        store when none is named; ``reset=True`` zeroes them after reading."""
        layers = [self._layer(layer)] if layer is not None or len(self._layers) == 1 else list(self._layers.values())
        total = dict.fromkeys(LookupCounters.FIELDS, 0)
        for lay in layers:
            for name, value in lay.counters.snapshot().items():
                total[name] += value
            if reset:
                lay.counters.reset()
        return total

    def local_tables(self, *, layer: int | None = None) -> list[np.ndarray] | None:
        """Each head's table as a read-only ``[N_h, row_bytes]`` uint8 view of this host's memory, in head order, or
        None when some head is not in memory here (it is read over the network).

        For kernels that read rows in place and transform them on the way (e.g. decoding FP8 rows as they are
        gathered). Tables bound with :meth:`bind_local` or published under ``local_dir`` are always here; tables in
        a store are here when their segment is mapped on this host. Call it per step rather than keeping the views:
        for a store, the placement is revalidated as for a lookup (a layer removed and populated again moves).
        """
        lay = self._layer(layer)
        self._require_source("local_tables", lay)
        placement = lay.local
        if placement is None:
            if self._native is None:
                return None
            placement = self._get_placement(lay, set())
        if len(placement.tables) != lay.num_heads:
            return None
        return [placement.tables[j].reshape(n, lay.row_bytes) for j, n in enumerate(lay.sizes)]

    # ---- lookup ---------------------------------------------------------------------------------

    def lookup(self, row_ids: Any, *, layer: int | None = None) -> np.ndarray:
        """Rows for ``[B, L, H]`` ids as ``[B, L, H, D]`` in the stored format (float32 by default)."""
        lay = self._layer(layer)
        self._require_source("lookup", lay)
        ids = lay.check_ids(row_ids)
        out = np.empty(ids.shape + (lay.dim,), dtype=lay.dtype)
        self._run([(lay, ids, out)])
        return out

    def lookup_into(self, row_ids: Any, out: Any, *, layer: int | None = None) -> Any:
        """Fill ``out`` (a writable C-contiguous ``[B, L, H, D]`` buffer of the stored dtype) with the rows.

        ``out`` may be a NumPy array or anything NumPy views without copying (see :meth:`_Layer.check_out`);
        nothing else is allocated for it. Returns ``out``.
        """
        lay = self._layer(layer)
        self._require_source("lookup", lay)
        ids = lay.check_ids(row_ids)
        self._run([(lay, ids, lay.check_out(out, ids.shape + (lay.dim,)))])
        return out

    def lookup_layers(self, row_ids: Mapping[int, Any], out: Mapping[int, Any] | None = None) -> dict[int, Any]:
        """Rows of several layers in one call: ``{layer_id: [B, L, H] ids}`` -> ``{layer_id: rows}``.

        Remote reads of every layer that go to the same segment server travel in one request. ``out`` may give
        a caller buffer per layer (as in :meth:`lookup_into`).
        """
        jobs = self._jobs(row_ids, out)
        self._run(jobs)
        return {lay.layer_id: (out[lay.layer_id] if out is not None and lay.layer_id in out else o)
                for lay, _, o in jobs}

    def prefetch(self, row_ids: Any, out: Any = None, background: bool | None = None, *,
                 layer: int | None = None) -> LookupHandle:
        """Start a lookup; the ids (and ``out``) are checked now, errors of the read come from ``result()``.

        ``out``: a caller buffer to fill (as in :meth:`lookup_into`; nothing is allocated), else a new array.
        ``background=True`` always reads in a background thread and returns at once (so the caller can launch
        other work, e.g. on a GPU); ``False`` reads now; None (default) reads a small lookup whose tables are all
        in memory on this host at once (a few microseconds, cheaper than a thread hand-off) and the rest in the
        background.
        """
        lay = self._layer(layer)
        self._require_source("prefetch", lay)
        ids = lay.check_ids(row_ids)
        shape = ids.shape + (lay.dim,)
        target = lay.check_out(out, shape) if out is not None else np.empty(shape, dtype=lay.dtype)
        result = out if out is not None else target
        jobs = [(lay, ids, target)]
        if background is None:
            placement = lay.local or lay.placement
            background = not (placement is not None and not placement.remote and ids.size <= PREFETCH_INLINE_ROWS
                              and (placement is lay.local or time.monotonic() - placement.checked_at < PLACEMENT_TTL_S))
        return self._start(jobs, result, background, ids)

    def prefetch_layers(self, row_ids: Mapping[int, Any], out: Mapping[int, Any] | None = None,
                        background: bool = True) -> LookupHandle:
        """:meth:`lookup_layers` in the background: ``result()`` returns ``{layer_id: rows}``."""
        jobs = self._jobs(row_ids, out)
        result = {lay.layer_id: (out[lay.layer_id] if out is not None and lay.layer_id in out else o)
                  for lay, _, o in jobs}
        return self._start(jobs, result, background, row_ids)

    def _jobs(self, row_ids: Mapping[int, Any], out: Mapping[int, Any] | None) -> list[tuple[_Layer, np.ndarray, Any]]:
        if not isinstance(row_ids, Mapping) or not row_ids:
            raise InvalidType(f"row_ids: expected a non-empty {{layer_id: [B, L, H] ids}} mapping, "
                              f"got {describe(row_ids)}")
        if out is not None and not isinstance(out, Mapping):
            raise InvalidType(f"out: expected a {{layer_id: buffer}} mapping or None, got {type(out).__name__}")
        jobs = []
        for layer_id, ids in row_ids.items():
            lay = self._layer(layer_id)
            self._require_source("lookup", lay)
            ids = lay.check_ids(ids)
            shape = ids.shape + (lay.dim,)
            target = (lay.check_out(out[layer_id], shape) if out is not None and layer_id in out
                      else np.empty(shape, dtype=lay.dtype))
            jobs.append((lay, ids, target))
        return jobs

    def _start(self, jobs: list, result: Any, background: bool, row_ids: Any) -> LookupHandle:
        future: Future = Future()
        if not background:
            try:
                self._run(jobs)
                future.set_result(result)
            except BaseException as exc:
                future.set_exception(exc)
            return LookupHandle(future, row_ids)

        def run() -> Any:
            self._run(jobs)
            return result

        return LookupHandle(self._background().submit(run), row_ids)

    def _background(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise NotConnected("this EngramStore is closed")
            if self._executor is None:
                name = f"engram-l{self.layer_id}" if self.layer_id is not None else "engram-layers"
                self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix=name)
            return self._executor

    def _require_source(self, what: str, lay: _Layer) -> None:
        if lay.local is not None or self._store is not None:
            return
        if self._local_dir is not None:
            if not self._open_local(lay):
                raise ObjectNotFound(f"{what}: layer {lay.layer_id} is not published under local_dir "
                                     f"{self._local_dir.path} (no {self._local_dir.layer_path(lay.layer_id)}); "
                                     "populate it first")
            return
        raise NotConnected(f"{what}: layer {lay.layer_id} has no tables to read: this EngramStore was built without "
                           "a store (store=None); pass a DistributedStore or MooncakeDistributedStore, bind the "
                           "layer's tables with bind_local(), or use local_dir=")

    def _run(self, jobs: list[tuple[_Layer, np.ndarray, np.ndarray]]) -> None:
        """Read validated jobs ``(layer, ids [B, L, H], out [B, L, H, D])``: local tables, stores, failover."""
        if len(jobs) == 1 and self._native is not None and jobs[0][0].local is None:
            lay, ids, out = jobs[0]
            self._lookup_one(lay, ids.reshape(-1, lay.num_heads), out.reshape(-1).view(np.uint8))
            return
        prepared = []
        for lay, ids, out in jobs:
            M = ids.shape[0] * ids.shape[1]
            prepared.append((lay, ids.reshape(M, lay.num_heads), out.reshape(-1).view(np.uint8)))
        store_jobs = []
        for lay, ids2, flat in prepared:
            if lay.local is not None:
                self._gather_local(lay, lay.local, ids2, flat)
                lay.counters.add(lookups=1, rows=ids2.size, local_rows=ids2.size)
            elif self._native is None:
                self._lookup_mooncake(lay, ids2, flat)
                lay.counters.add(lookups=1, rows=ids2.size)
            else:
                store_jobs.append((lay, ids2, flat))
        if store_jobs:
            _lookup_native(self._native, [(self, lay, ids2, flat) for lay, ids2, flat in store_jobs])

    def _lookup_one(self, lay: _Layer, ids2: np.ndarray, flat: np.ndarray) -> None:
        """One layer from the native store: the lean path of a lookup (see :func:`_lookup_native` for the rest).

        With a fresh placement whose remote heads all live on one server, the rows are planned, read in one
        request and scattered with nothing in between; any failure takes the general path, which fails over.
        """
        placement = lay.placement
        if placement is None or time.monotonic() - placement.checked_at >= PLACEMENT_TTL_S \
                or len(placement.remote) > 1 or lay.cache is not None or not _fits_one_round(ids2, flat):
            _lookup_native(self._native, [(self, lay, ids2, flat)])
            return
        if placement.local:
            self._gather_local(lay, placement, ids2, flat)
        if placement.remote:
            address, endpoints, _, _ = placement.remote[0]
            native = self._native
            direct = _reads_direct(placement, ids2)
            if direct:
                # Every head on this server: one range per (m, h) in output order, so the reply lands in
                # ``flat`` as it is; no sort, no scatter (a repeated row is read again).
                pairs = _direct_pairs(ids2, placement.order, placement.bases, lay.row_bytes)
                rows = ids2.size
            else:
                pairs, r, head_rows, _, inverse = _plan_reads(ids2, placement.order, placement.bases,
                                                                        lay.row_bytes)
                pairs = pairs[:r]
                rows = int(head_rows[-1])
            try:
                data = native.read_pairs(native.pick_endpoint(endpoints), pairs, rows * lay.row_bytes,
                                         out=flat if direct else None)
            except SegmentUnavailable:
                with lay.lock:
                    lay.placement = None
                _lookup_native(native, [(self, lay, ids2, flat)], failed={address})
                return
            if not direct and _scatter_rows(_kernels.readonly(np.frombuffer(data, dtype=np.uint8)),
                                                     _kernels.readonly(inverse), placement.order, 0, lay.row_bytes,
                                                     flat) >= 0:
                raise StoreError(f"layer {lay.layer_id}: {address} returned too few rows")
            lay.counters.add(lookups=1, rows=ids2.size, local_rows=placement.local_heads * ids2.shape[0],
                             remote_requests=1, remote_rows=rows, remote_bytes=rows * lay.row_bytes)
        else:
            lay.counters.add(lookups=1, rows=ids2.size, local_rows=ids2.size)

    def _gather_local(self, lay: _Layer, placement: _Placement, ids2: np.ndarray, flat: np.ndarray) -> None:
        """Gather the rows of every head in ``placement.local`` from memory on this host into ``flat``."""
        M = ids2.shape[0]
        threads = self._threads if M * lay.num_heads >= THREADED_MIN_ROWS else 1
        for source in placement.local:
            if flat.ctypes.data % (1 << source.shift):  # a caller's buffer aligned to fewer bytes
                source = _kernels.narrower(source, _kernels.word_shift(flat.ctypes.data))
            if threads == 1:
                bad = _kernels.gather_rows(source, ids2, flat)
            else:
                step = -(-M // threads)
                pool = _gather_pool(threads - 1)
                parts = [pool.submit(_kernels.gather_rows, source, ids2, flat, lo, min(M, lo + step))
                         for lo in range(step, M, step)]
                bad = _kernels.gather_rows(source, ids2, flat, 0, min(M, step))
                for part in parts:
                    bad = max(bad, part.result())
            if bad >= 0:
                raise StoreError(f"layer {lay.layer_id}: a row lies outside its mapped tables; the stored layer "
                                 "does not match this configuration")

    def _get_placement(self, lay: _Layer, failed: set[str]) -> _Placement:
        """The layer's placement in the native store.

        Published layers are immutable, but another client may remove one and populate it again elsewhere; the
        master keeps a removed table's space unallocated for its reuse delay (2 s by default), so a placement
        checked with the master within that delay never leads to another object's bytes. A placement younger than
        PLACEMENT_TTL_S is used as it is; up to PLACEMENT_STALE_S it is used while a background thread checks it;
        older (a client that was idle), it is checked before use. When the master does not answer, reads go on
        from the last placement it gave (see DESIGN.md, "Reads outlive the master") and the check is retried in
        the background; only a layer this client never resolved needs the master to be read.
        """
        cached = lay.placement
        if cached is not None:
            age = time.monotonic() - cached.checked_at
            if age < PLACEMENT_TTL_S:
                return cached
            if age < PLACEMENT_STALE_S or self._master_trouble():
                self._refresh_later(lay)
                return cached
            return self._resolve(lay, failed, timeout_ms=min(self._native.timeout_ms, REFRESH_TIMEOUT_MS))
        return self._resolve(lay, failed)

    def _resolve(self, lay: _Layer, failed: set[str], timeout_ms: int | None = None) -> _Placement:
        """Ask the master where the layer's heads are and build the placement (reading and checking the layer's
        manifest when its tables are new to this client or have moved); on a master that does not answer, rebuild
        it from the last answer, without the ``failed`` segments."""
        native = self._native
        cached = lay.placement
        now = time.monotonic()
        try:
            infos = native.locate(lay.keys, lease=False, timeout_ms=timeout_ms)
        except ObjectNotFound:
            if self._require_manifest:
                self._check_manifest(lay, self._read_manifest(lay))  # "not published" says more than a missing head
            raise
        except Unavailable as exc:
            if lay.known is None:
                raise
            self._master_unreachable(lay, exc)
            if cached is not None and not any(address in failed for address, *_ in cached.remote):
                return cached
            infos, signature, checked_at = lay.known
        else:
            self._master_trouble_at = 0.0
            signature = tuple((info.size, tuple((r.segment_id, r.address, r.offset) for r in info.replicas))
                              for info in infos)
            checked_at = now
            if cached is not None and signature == cached.signature \
                    and not any(address in failed for address, *_ in cached.remote):
                cached.checked_at = now
                lay.known = (infos, signature, now)
                return cached
            if signature != lay.validated:
                # First read, or the layer changed: check its layout (a failover to the same tables does not).
                if self._require_manifest:
                    self._check_manifest(lay, self._read_manifest(lay))
                if lay.cache is not None:
                    lay.cache.clear()  # rows cached from an earlier placement may belong to another table now
                lay.validated = signature
            lay.known = (infos, signature, now)
        placement = self._build_placement(lay, infos, failed, signature, checked_at)
        with lay.lock:
            lay.placement = placement
        return placement

    def _build_placement(self, lay: _Layer, infos: list, failed: set[str], signature: tuple,
                         checked_at: float) -> _Placement:
        """Which heads are read in place (a segment mapped on this host) and which from which server."""
        native = self._native
        lay.counters.add(placement_refreshes=1)
        local_tables: list[tuple[int, np.ndarray]] = []
        remote: dict[str, list[tuple[int, int, Any]]] = {}
        for h, info in enumerate(infos):
            nbytes = lay.sizes[h] * lay.row_bytes
            if info.size != nbytes:
                raise StoreError(f"key {info.key!r} holds {info.size} bytes, but table_vocab_sizes[{h}] x "
                                 f"row bytes = {nbytes}; the stored layer was written with another geometry")
            live = [r for r in info.replicas if r.address not in failed]
            if not live:
                raise SegmentUnavailable(f"layer {lay.layer_id}: segment {', '.join(r.address for r in info.replicas)}"
                                         f" holding head {lay.heads[h]} ({info.key!r}) did not answer, and no other "
                                         "replica of it is left")
            for r in live:
                view = native.local_view(r)
                if view is not None and 0 <= r.offset <= view.size - nbytes:
                    local_tables.append((h, view[r.offset:r.offset + nbytes]))
                    break
            else:
                r = live[h % len(live)]
                remote.setdefault(r.address, []).append((h, r.offset, r))
        order, bases, groups = [], [], []
        for address, entries in remote.items():
            j0 = len(order)
            order += [h for h, _, _ in entries]
            bases += [offset for _, offset, _ in entries]
            groups.append((address, native.read_endpoints(entries[0][2]), j0, len(order)))
        return _Placement(
            local=sources_for(local_tables, lay.num_heads, lay.row_bytes) if local_tables else [],
            remote=groups,
            order=_kernels.readonly(np.asarray(order, dtype=np.int64)),
            bases=_kernels.readonly(np.asarray(bases, dtype=np.int64)),
            replicas=[info.replicas for info in infos],
            signature=signature,
            checked_at=checked_at,
            keep=[t for _, t in local_tables],
            tables={h: _kernels.readonly(t) for h, t in local_tables},
        )

    def _master_trouble(self) -> bool:
        """Whether a placement check failed recently (then lookups do not wait for the master)."""
        return time.monotonic() - self._master_trouble_at < MASTER_RETRY_S

    def _master_unreachable(self, lay: _Layer, exc: Exception) -> None:
        now = time.monotonic()
        self._master_trouble_at = now
        if now - self._master_warned_at >= MASTER_WARN_INTERVAL_S:
            self._master_warned_at = now
            log.warning("layer %d: the master did not answer a placement check (%s); reading from the placement it "
                        "gave %.1f s ago, and checking again in the background", lay.layer_id, exc,
                        now - lay.known[2])

    def _refresh_later(self, lay: _Layer) -> None:
        """Check the layer's placement with the master in a background thread (one check per layer at a time)."""
        with self._lock:
            if lay.refreshing or self._closed:
                return
            lay.refreshing = True
            if self._refresher is None:
                self._refresher = ThreadPoolExecutor(1, thread_name_prefix="engram-placement")
            refresher = self._refresher
        refresher.submit(self._refresh, lay)

    def _refresh(self, lay: _Layer) -> None:
        try:
            self._resolve(lay, set())
        except Unavailable:
            pass  # logged by _resolve; the next lookup past the TTL asks again
        except EngramError as exc:  # the layer is gone or changed: the next lookup resolves it and says so
            log.info("layer %d: placement check found %s; resolving again on the next lookup", lay.layer_id, exc)
            with lay.lock:
                lay.placement = None
        except Exception:
            log.exception("layer %d: placement check failed", lay.layer_id)
        finally:
            lay.refreshing = False

    def _lookup_cached(self, lay: _Layer, placement: _Placement, ids2: np.ndarray, flat: np.ndarray,
                       tally: dict) -> set[str]:
        """The remote read of a layer with a hot-row cache: cached rows are not requested, fetched ones are added."""
        uniq, head_starts, inverse = _kernels.plan_unique_rows(ids2, placement.order)
        cache = lay.cache
        head_of = np.repeat(placement.order, np.diff(head_starts))
        keys = (head_of << 40) | uniq
        rows_all = np.empty((uniq.size, lay.dim), dtype=lay.dtype)
        with cache.lock:
            hit, hits = _kernels.cache_probe(keys, cache.keys, cache.rows, cache.words(rows_all))
        miss = ~hit
        _tally(tally, flat, cache_hits=hits, cache_misses=int(uniq.size) - hits)
        requests = []
        for address, endpoints, j0, j1 in placement.remote:
            endpoint = self._native.pick_endpoint(endpoints)
            lo = int(head_starts[j0])
            rows = uniq[lo:head_starts[j1]]
            wanted = miss[lo:head_starts[j1]]
            positions = lo + np.flatnonzero(wanted)
            starts = np.concatenate(([0], np.cumsum(wanted)))[head_starts[j0:j1 + 1] - lo]
            rows = rows[wanted]
            if rows.size == 0:
                continue  # every row of this server's heads came from the cache
            offsets, lengths, _ = _kernels.rows_to_ranges(rows, starts, placement.bases[j0:j1], lay.row_bytes)
            requests.append((address, endpoint, positions, np.stack((offsets, lengths), axis=1)))
        results = self._native.read_pairs_many([(endpoint, pairs) for _, endpoint, _, pairs in requests])
        fetched = sum(int(p[:, 1].sum()) for *_, p in requests)
        _tally(tally, flat, remote_requests=len(requests), remote_rows=fetched // lay.row_bytes, remote_bytes=fetched)
        failed = set()
        for (address, _, positions, _), result in zip(requests, results):
            if isinstance(result, BaseException):
                if isinstance(result, SegmentUnavailable):
                    failed.add(address)
                    continue
                raise result
            rows = np.frombuffer(result, dtype=lay.dtype).reshape(-1, lay.dim)
            with cache.lock:
                _kernels.cache_fill(keys, positions, cache.words(rows), cache.words(rows_all), cache.keys, cache.rows)
        if not failed:
            bad = _kernels.scatter_rows_prepared(rows_all.reshape(-1).view(np.uint8), inverse, placement.order, 0,
                                                 lay.row_bytes, flat)
            if bad >= 0:
                raise StoreError(f"layer {lay.layer_id}: a cached read returned too few rows")
        return failed

    def _lookup_mooncake(self, lay: _Layer, ids2: np.ndarray, flat: np.ndarray) -> None:
        """The same planning over Mooncake's ``get_into_ranges`` (one call for all heads of the layer)."""
        if self._require_manifest and not lay.published:
            self._check_manifest(lay, self._read_manifest(lay))
            lay.published = True
        H = lay.num_heads
        heads = np.arange(H, dtype=np.int64)
        uniq, head_starts, inverse = _kernels.plan_unique_rows(ids2, heads)
        need = int(uniq.size) * lay.row_bytes
        with self._lock:
            staging = self._staging
            if staging is None or staging.nbytes < need:
                if self._staging_release is not None:
                    self._staging_release()  # unregisters the smaller buffer
                staging = np.empty(max(need, 1 << 20), dtype=np.uint8)
                _check_code(self._store.register_buffer(staging.ctypes.data, staging.nbytes), "register_buffer",
                            "staging buffer")
                self._staging = staging
                # Unregistered on close(), or when this EngramStore is dropped without one: a registration left
                # behind would make the store refuse a later buffer at the same address ("overlapped memory").
                self._staging_release = weakref.finalize(self, _unregister, self._store, staging)
            all_keys, all_dst, all_src, all_sizes = [], [], [], []
            zero = np.zeros(1, dtype=np.int64)
            for h in range(H):
                rows = uniq[head_starts[h]:head_starts[h + 1]]
                offsets, lengths, _ = _kernels.rows_to_ranges(rows, np.array([0, rows.size], dtype=np.int64),
                                                              zero, lay.row_bytes)
                dst = int(head_starts[h]) * lay.row_bytes + np.concatenate(([0], np.cumsum(lengths)[:-1]))
                all_keys.append(lay.keys[h])
                all_dst.append(dst.tolist())
                all_src.append(offsets.tolist())
                all_sizes.append(lengths.tolist())
            results = self._store.get_into_ranges([staging.ctypes.data], [all_keys], [all_dst], [all_src], [all_sizes])
            # Mooncake answers per range with the bytes read, or a negative code (the same for every range
            # of a key that cannot be read). -704 is OBJECT_NOT_FOUND: name it, as the native path does.
            for h, (sizes, got) in enumerate(zip(all_sizes, results[0])):
                if list(got) != sizes:
                    if any(int(g) == _MOONCAKE_OBJECT_NOT_FOUND for g in got):
                        raise ObjectNotFound(f"get_into_ranges: key {lay.keys[h]!r} is not in the store "
                                             f"(code {_MOONCAKE_OBJECT_NOT_FOUND}); populate layer "
                                             f"{lay.layer_id} first")
                    raise StoreError(f"get_into_ranges: key {lay.keys[h]!r} returned {list(got)[:4]}..., "
                                     f"expected the requested sizes")
            _kernels.scatter_rows_prepared(staging[:need], inverse, heads, 0, lay.row_bytes, flat)

    # ---- removal and lifecycle ------------------------------------------------------------------

    def remove_from_store(self, force: bool = False, *, layer: int | None = None) -> int:
        """Remove this store's head tables of the layer; returns how many were removed (missing keys are skipped).

        The layer's manifest goes first, so readers see the layer as unpublished, never half removed. Layers
        published under ``local_dir`` are files: delete their directory to remove them.
        """
        lay = self._layer(layer)
        self._require_store("remove_from_store", lay)
        with lay.lock:
            lay.placement = None
            lay.published = False
        self._remove_keys([lay.manifest_key], force)
        return self._remove_keys(lay.keys, force)

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
        """Wait for background reads, release mapped local tables and bound arrays; safe to call twice."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
            refresher, self._refresher = self._refresher, None
        if refresher is not None:
            refresher.shutdown(wait=False, cancel_futures=True)  # a check waiting on a paused master ends by itself
        with self._lock:
            self._staging = None
            release, self._staging_release = self._staging_release, None
        if executor is not None:
            executor.shutdown(wait=True)
        if release is not None:
            release()
        for lay in self._layers.values():
            with lay.lock:
                mapped, lay.mapped = lay.mapped, None
                lay.local = None
                lay.placement = None
            if mapped is not None:
                mapped.close()

    def __enter__(self) -> "EngramStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = (type(self._store).__name__ if self._store is not None
                 else f"local_dir={self._local_dir.path!r}" if self._local_dir is not None else None)
        if self.layer_id is not None:
            lay = self._layer(None)
            return (f"EngramStore(layer_id={self.layer_id}, heads={lay.num_heads}, "
                    f"embedding_dim={lay.dim}, store={where})")
        return f"EngramStore(layers={self.get_layer_ids()}, store={where})"


# ---- reads through the native store ---------------------------------------------------------------


def _fits_one_round(ids2: np.ndarray, flat: np.ndarray) -> bool:
    """Whether a lookup of ``ids2`` into ``flat`` (output bytes) is read in one round (see READ_ROUND_BYTES)."""
    return ids2.size <= READ_ROUND_ROWS and flat.size <= READ_ROUND_BYTES


def _read_rounds(jobs: list[tuple[EngramStore, _Layer, np.ndarray, np.ndarray]]) -> list[list]:
    """``jobs`` regrouped into rounds of at most READ_ROUND_BYTES of output and READ_ROUND_ROWS rows each, in
    order: a larger job is cut into position ranges."""
    rounds: list[list] = []
    current: list = []
    size = rows = 0
    for owner, lay, ids2, flat in jobs:
        M, H = ids2.shape
        per_m = H * lay.row_bytes
        if _fits_one_round(ids2, flat):
            pieces = [(ids2, flat)]
        else:
            step = max(1, min(READ_ROUND_BYTES // per_m, READ_ROUND_ROWS // H))
            pieces = [(ids2[m0:m0 + step], flat[m0 * per_m:(m0 + step) * per_m]) for m0 in range(0, M, step)]
        for ids_part, flat_part in pieces:
            if current and (size + flat_part.size > READ_ROUND_BYTES or rows + ids_part.size > READ_ROUND_ROWS):
                rounds.append(current)
                current, size, rows = [], 0, 0
            current.append((owner, lay, ids_part, flat_part))
            size += flat_part.size
            rows += ids_part.size
    if current:
        rounds.append(current)
    return rounds


def _lookup_native(native: Any, jobs: list[tuple[EngramStore, _Layer, np.ndarray, np.ndarray]],
                   failed: set[str] | None = None) -> None:
    """Read jobs ``(owner, layer, ids [M, H], out bytes)`` from one DistributedStore: tables mapped on this
    host are gathered in place; the rest goes out as one request per segment server for all jobs, all at
    once (in rounds of at most READ_ROUND_BYTES); heads on a server that fails (or is in ``failed`` already)
    are re-resolved and read from another replica."""
    failed = set(failed or ())
    for round_jobs in _read_rounds(jobs):
        _lookup_round(native, round_jobs, failed)
    for _, lay, _, _ in jobs:  # one lookup per job, however many rounds it took
        lay.counters.add(lookups=1)


def _lookup_round(native: Any, jobs: list[tuple[EngramStore, _Layer, np.ndarray, np.ndarray]],
                  failed: set[str]) -> None:
    """One round of :func:`_lookup_native`; servers that fail are added to ``failed``, for the next rounds."""
    pending = jobs
    for round_ in range(FAILOVER_ROUNDS + 1):
        remote_jobs, cached_jobs, placed = [], [], []
        tally: dict[int, dict] = {}  # remote counters of this attempt, per job: counted only if the job is done
        for owner, lay, ids2, flat in pending:
            placement = owner._get_placement(lay, failed)
            placed.append(placement)
            if placement.local:
                owner._gather_local(lay, placement, ids2, flat)
            if placement.remote:
                (cached_jobs if lay.cache is not None else remote_jobs).append((owner, lay, placement, ids2, flat))
        bad = _read_remote(native, remote_jobs, tally) if remote_jobs else set()
        for owner, lay, placement, ids2, flat in cached_jobs:
            bad |= owner._lookup_cached(lay, placement, ids2, flat, tally)
        retry = []
        for job, placement in zip(pending, placed):
            owner, lay, ids2, flat = job
            if any(address in bad for address, *_ in placement.remote):
                retry.append(job)
                with lay.lock:
                    lay.placement = None  # re-resolve: the master may have dropped the dead segment
            else:
                lay.counters.add(rows=ids2.size, local_rows=placement.local_heads * ids2.shape[0], retries=round_,
                                 **tally.get(id(flat), {}))
        if not retry:
            return
        failed |= bad
        log.warning("layers %s: segment(s) %s failed; retrying on other replicas",
                    sorted({lay.layer_id for _, lay, _, _ in retry}), sorted(bad))
        pending = retry
    raise SegmentUnavailable(f"layers {sorted({lay.layer_id for _, lay, _, _ in pending})}: no live replica answered "
                             f"for some heads (failed: {', '.join(sorted(failed))})")


def _reads_direct(placement: _Placement, ids2: np.ndarray) -> bool:
    """Whether a remote read asks for each (m, h) row in output order (see DIRECT_MAX_ROWS): every head of the
    layer on one server, and at most DIRECT_MAX_ROWS rows."""
    return not placement.local and len(placement.remote) == 1 and ids2.size <= DIRECT_MAX_ROWS


def _tally(tally: dict, flat: np.ndarray, **deltas: int) -> None:
    """Add counters of one attempt at the job whose output is ``flat``."""
    entry = tally.setdefault(id(flat), {})
    for name, delta in deltas.items():
        entry[name] = entry.get(name, 0) + delta


def _read_remote(native: Any, jobs: list, tally: dict) -> set[str]:
    """One read per segment server for every job's remote heads; scatter the replies; the addresses that failed.

    A job whose heads all live on one server reads its rows as they are, in output order (the reply is its
    output); others read each distinct row once and scatter it (see DIRECT_MAX_ROWS)."""
    requests: dict[str, tuple[str, list]] = {}
    for owner, lay, placement, ids2, flat in jobs:
        if _reads_direct(placement, ids2):
            address, endpoints, _, _ = placement.remote[0]
            pairs = _direct_pairs(ids2, placement.order, placement.bases, lay.row_bytes)
            requests.setdefault(address, (native.pick_endpoint(endpoints), []))[1].append(
                (lay, None, pairs, ids2.size, flat))
            continue
        plan = _kernels.plan_reads(ids2, placement.order, placement.bases, lay.row_bytes, checked=True)
        for address, endpoints, j0, j1 in placement.remote:
            pairs = plan.pairs[plan.head_ranges[j0]:plan.head_ranges[j1]]
            rows = int(plan.head_rows[j1] - plan.head_rows[j0])
            requests.setdefault(address, (native.pick_endpoint(endpoints), []))[1].append(
                (lay, (plan, placement.order[j0:j1], int(plan.head_rows[j0])), pairs, rows, flat))
    batch, outs = [], []
    for endpoint, parts in requests.values():
        pieces = [pairs for _, _, pairs, _, _ in parts]
        batch.append((endpoint, pieces[0] if len(pieces) == 1 else np.concatenate(pieces)))
        outs.append(parts[0][4] if len(parts) == 1 and parts[0][1] is None else None)  # straight into the output
    results = native.read_pairs_many(batch, outs)
    failed = set()
    for (address, (_, parts)), result in zip(requests.items(), results):
        if isinstance(result, BaseException):
            if isinstance(result, SegmentUnavailable):
                failed.add(address)
                continue
            raise result
        data = _kernels.readonly(np.frombuffer(result, dtype=np.uint8))
        pos = 0
        for lay, scatter, _, rows, flat in parts:
            n = rows * lay.row_bytes
            if data.size < pos + n:
                raise StoreError(f"layer {lay.layer_id}: {address} returned too few rows")
            if scatter is None:
                if flat.ctypes.data != data.ctypes.data + pos:
                    flat[:] = data[pos:pos + n]
            else:
                plan, heads, r0 = scatter
                if _kernels.scatter_rows_prepared(data[pos:pos + n], plan.inverse, heads, r0, lay.row_bytes,
                                                  flat) >= 0:
                    raise StoreError(f"layer {lay.layer_id}: {address} returned too few rows")
            _tally(tally, flat, remote_requests=1, remote_rows=rows, remote_bytes=n)
            pos += n
    return failed


def lookup_many(requests: Sequence[tuple[EngramStore, Any]], *, layers: Sequence[int | None] | None = None,
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
        owner, ids = item
        lay = owner._layer(layers[i] if layers is not None else None)
        owner._require_source("lookup", lay)
        ids = lay.check_ids(ids)
        shape = ids.shape + (lay.dim,)
        given = out[i] if out is not None else None
        target = lay.check_out(given, shape) if given is not None else np.empty(shape, dtype=lay.dtype)
        jobs.append((owner, lay, ids, target))
        results.append(given if given is not None else target)

    def run() -> list:
        native_jobs: dict[int, tuple[Any, list]] = {}
        for owner, lay, ids, target in jobs:
            if owner._native is not None and lay.local is None:
                M = ids.shape[0] * ids.shape[1]
                native_jobs.setdefault(id(owner._native), (owner._native, []))[1].append(
                    (owner, lay, ids.reshape(M, lay.num_heads), target.reshape(-1).view(np.uint8)))
            else:
                owner._run([(lay, ids, target)])
        for native, group in native_jobs.values():
            _lookup_native(native, group)
        return results

    owner0 = jobs[0][0] if jobs else None
    if background and owner0 is not None:
        return LookupHandle(owner0._background().submit(run), requests)
    future: Future = Future()
    try:
        future.set_result(run())
    except BaseException as exc:
        future.set_exception(exc)
    return LookupHandle(future, requests)


def prefetch_many(requests: Sequence[tuple[EngramStore, Any]], *, layers: Sequence[int | None] | None = None,
                  out: Sequence[Any] | None = None, background: bool = True) -> list[LookupHandle]:
    """:func:`lookup_many` with one handle per request (each ``result()`` is that request's rows).

    The reads still go out together (one request per segment server for all layers); every handle completes
    when they all have, and a failure is raised by every handle.
    """
    combined = lookup_many(requests, layers=layers, out=out, background=background)
    handles = [LookupHandle(Future(), ids) for _, ids in requests]

    def finish(done: Future) -> None:
        exc = done.exception()
        for i, handle in enumerate(handles):
            if exc is not None:
                handle._future.set_exception(exc)
            else:
                handle._future.set_result(done.result()[i])

    combined._future.add_done_callback(finish)
    return handles


# ---- helpers ----------------------------------------------------------------------------------------

_POOL_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0


def _gather_pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool for split local gathers, grown to the largest ``threads`` asked for."""
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < workers:
            old = _POOL
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="engram-gather")
            _POOL_SIZE = workers
            if old is not None:
                old.shutdown(wait=False)
        return _POOL


def _populate_progress(lay: _Layer, tables: Sequence[np.ndarray]) -> Progress:
    """The progress bar of a populate: shown for layers above PROGRESS_MIN_BYTES (where stderr is a terminal)."""
    total = sum(t.nbytes for t in tables)
    return Progress(total, f"populate layer {lay.layer_id}", enabled=None if total > PROGRESS_MIN_BYTES else False)


def _checksums(tables: Sequence[np.ndarray], algorithm: str | None = None) -> tuple[str, list[str]]:
    """Checksums of each table's bytes as hex strings: xxh3_64 (about 11 GB/s here, GIL released) unless
    ``algorithm`` names another (verify of a manifest written with crc32: zlib, about 2.3 GB/s)."""
    algorithm = algorithm or "xxh3_64"
    if algorithm == "xxh3_64":
        return algorithm, [xxhash.xxh3_64_hexdigest(t.reshape(-1).view(np.uint8)) for t in tables]
    if algorithm == "crc32":
        return algorithm, [f"{zlib.crc32(t.reshape(-1).view(np.uint8)) & 0xFFFFFFFF:08x}" for t in tables]
    raise StoreError(f"manifest checksum {algorithm!r} is not one this engram computes (xxh3_64, crc32)")


def _sort_key(layer_id: Any) -> Any:
    return (0, int(layer_id)) if isinstance(layer_id, (int, np.integer)) else (1, repr(layer_id))


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


def _looks_like_mooncake(store: Any) -> bool:
    """Whether ``store`` has the calls the Mooncake path uses (a real or compatible MooncakeDistributedStore)."""
    return all(callable(getattr(store, name, None)) for name in
               ("batch_put_from", "get_into_ranges", "batch_is_exist", "remove", "register_buffer"))


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


def _mooncake_put(store: Any, key: str, buffer: np.ndarray, config: Any) -> None:
    """Upload ``buffer`` (C-contiguous) under ``key`` to a Mooncake store: registered for the transfer, put
    with ``config`` (a ReplicateConfig, or None for the store's default), unregistered whatever happens."""
    ptr = buffer.ctypes.data
    _check_code(store.register_buffer(ptr, buffer.nbytes), "register_buffer", key)
    try:
        codes = (store.batch_put_from([key], [ptr], [buffer.nbytes], config) if config is not None
                 else store.batch_put_from([key], [ptr], [buffer.nbytes]))
        _check_code(codes[0], "batch_put_from", key)
    finally:
        store.unregister_buffer(ptr)


def _unregister(store: Any, buffer: np.ndarray) -> None:
    """Unregister a staging buffer from a Mooncake store (it holds ``buffer`` alive until then)."""
    try:
        store.unregister_buffer(buffer.ctypes.data)
    except Exception:  # the store may be closed already: nothing left to release
        log.debug("could not unregister a staging buffer", exc_info=True)


def _check_code(code: Any, op: str, what: str) -> None:
    if isinstance(code, (int, np.integer)) and code < 0:
        raise StoreError(f"{op} for {what} failed with code {int(code)}")
