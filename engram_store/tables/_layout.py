"""A layer's geometry: its configuration, its heads and keys, and the checks of row ids, output buffers and the
tables written into it; the layers an EngramStore's arguments name, and which of them a call names."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .. import kernels as _kernels
from ..buffers import BIT_VIEWS, host_array
from ..errors import InvalidArgument, InvalidType, describe, is_int

_INT64 = np.dtype(np.int64)  # compared as a dtype: against the type it costs a conversion a call

#: Row formats and the NumPy dtype their items are returned as.
ROW_FORMATS = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "bytes": np.uint8}


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


class LookupCounters:
    """Running totals of a layer's lookups; read them with :meth:`EngramStore.stats`.

    ``lookups``: calls served; ``rows``: rows returned (B x L x H); ``local_rows``: of those, gathered straight
    from memory on this host; ``remote_rows``: rows fetched over the network (each (m, h) row where one server
    holds the whole layer, else distinct rows only); ``remote_requests`` and ``remote_bytes``: range reads sent
    and bytes received (a request that carries several layers counts once for each); ``retries``: failover
    rounds after a segment failed; ``placement_refreshes``: times the table placement was resolved from the
    master; ``cache_hits`` / ``cache_misses``: rows found in / missing from the hot-row cache (distinct remote rows
    for a store's layers, every row looked up for a disk layer's); ``pages_read`` / ``bytes_read``: distinct pages
    and their bytes read from a disk layer's files.
    """

    FIELDS = ("lookups", "rows", "local_rows", "remote_rows", "remote_requests", "remote_bytes", "retries",
              "placement_refreshes", "cache_hits", "cache_misses", "pages_read", "bytes_read")

    #: Lookups :meth:`add_remote` keeps aside at most, before it adds them up.
    FOLD_EVERY = 1024

    def __init__(self, row_bytes: int = 0) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)
        self._row_bytes = row_bytes
        self._remote: list[int] = []  # the rows of each add_remote not added up yet

    def forked(self) -> None:
        """In a forked child: a thread the child does not have may have held the lock."""
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def add_remote(self, rows: int) -> None:
        """One lookup whose ``rows`` rows all came in one request. A model step's lookups pass here, every cache
        cold by then, where the lock and five sums of :meth:`add` cost several microseconds: this appends (one
        atomic list operation) and the sums are made when the counters are read, or every FOLD_EVERY lookups."""
        remote = self._remote
        remote.append(rows)
        if len(remote) >= self.FOLD_EVERY:
            with self._lock:
                self._fold()

    def _fold(self) -> None:
        """Add up what add_remote kept aside (under the lock; appends may go on meanwhile, at the end)."""
        remote = self._remote
        n = len(remote)
        if not n:
            return
        rows = sum(remote[:n])
        del remote[:n]
        values = self._values
        values["lookups"] += n
        values["rows"] += rows
        values["remote_requests"] += n
        values["remote_rows"] += rows
        values["remote_bytes"] += rows * self._row_bytes

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            self._fold()
            return dict(self._values)

    def reset(self) -> None:
        with self._lock:
            self._fold()
            self._values = dict.fromkeys(self.FIELDS, 0)


class Layer:
    """One layer of an :class:`~engram_store.EngramStore`: its geometry, its counters, and the state its row source
    keeps for it (``state``: placement, mapped files, an open disk layer; the source's own business)."""

    def __init__(self, layer_id: Any, config: Any, heads: Sequence[int] | None):
        if not isinstance(layer_id, (int, np.integer)) or isinstance(layer_id, bool) or layer_id < 0:
            raise InvalidArgument(f"layer_id: expected a non-negative integer, got {describe(layer_id)}")
        if not isinstance(config, EngramStoreConfig):
            raise InvalidType(f"config: expected an EngramStoreConfig, got {type(config).__name__}")
        sizes, dim = config.validate()
        self.layer_id = int(layer_id)
        self.config = config
        self.layer_sizes = sizes
        self.heads = check_heads(heads, len(sizes))
        self.sizes = [sizes[h] for h in self.heads]
        self.sizes_arr = _kernels.readonly(np.asarray(self.sizes, dtype=np.int64))
        self.num_heads = len(self.sizes)
        self.dim = dim
        self.row_format = config.row_format
        self.dtype = config.dtype
        self._plain_dtype = self.dtype.name not in BIT_VIEWS  # an out of this dtype is itself (check_out)
        self.row_bytes = config.row_bytes
        self.keys = [f"engram:l{self.layer_id}:h{h}" for h in self.heads]
        self.layer_keys = [f"engram:l{self.layer_id}:h{h}" for h in range(len(sizes))]
        self.manifest_key = f"engram:l{self.layer_id}:manifest"
        self.counters = LookupCounters(self.row_bytes)
        self.lock = threading.Lock()
        self.state: Any = None
        self.written: Any = None  # what this store's last populate of the layer wrote (its source's record)

    def forked(self) -> None:
        """In a forked child: a thread the child does not have may have held the locks."""
        self.lock = threading.Lock()
        self.counters.forked()

    @property
    def sharded(self) -> bool:
        """Whether this store owns only some of the layer's heads (a head shard)."""
        return len(self.heads) < len(self.layer_sizes)

    def as_ids(self, row_ids: Any) -> np.ndarray:
        """``[B, L, H]`` row ids as a C-contiguous int64 array of this layer's heads; their range is not checked
        (:meth:`check_ids` checks it)."""
        ids = row_ids
        H = self.num_heads
        # The common case (a C-contiguous int64 array of the right shape) skips the generic conversion.
        if not (type(ids) is np.ndarray and ids.dtype == _INT64 and ids.ndim == 3 and ids.shape[2] == H
                and ids.size and ids.flags.c_contiguous):
            ids = as_row_ids(row_ids, H)
        return ids

    def check_ids(self, row_ids: Any) -> np.ndarray:
        """``[B, L, H]`` row ids, validated: C-contiguous int64, every id in its head's range."""
        return self.check_range(self.as_ids(row_ids))

    def check_range(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` (:meth:`as_ids`' array), once every id is in its head's range; InvalidArgument names the first
        that is not."""
        H = self.num_heads
        bad = _kernels.first_bad_row_unchecked(_kernels.readonly(ids.reshape(-1, H)), self.sizes_arr)
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
        if type(out) is np.ndarray and out.dtype == self.dtype and out.shape == shape and out.flags.c_contiguous \
                and out.flags.writeable and self._plain_dtype:  # what the checks below pass as it is, at once
            return out
        if isinstance(out, (list, tuple, str, bytes)) or out is None:
            raise InvalidType(f"out: expected a writable {self.dtype} buffer of shape {shape} (a NumPy array, "
                              f"a CPU tensor with __dlpack__, or an object with the buffer protocol or "
                              f"__array_interface__), got {type(out).__name__}")
        view = host_array(out, "out", writable=False)
        arr = view.array
        if view.dtype == "bfloat16" and self.row_format != "bfloat16":
            raise InvalidArgument(f"out: expected a writable C-contiguous {self.dtype} array of shape {shape}, got "
                                  f"bfloat16 {arr.shape} (this layer's rows are {self.row_format})")
        if arr.dtype != self.dtype and arr.dtype == np.uint8 and arr.ndim == 1 and arr.flags.c_contiguous \
                and arr.size == int(np.prod(shape)) * self.dtype.itemsize:
            arr = arr.view(self.dtype).reshape(shape)  # a flat byte buffer of the right size
        if arr.dtype != self.dtype or arr.shape != shape or not arr.flags.c_contiguous or not arr.flags.writeable:
            raise InvalidArgument(f"out: expected a writable C-contiguous {self.dtype} array of shape {shape}, got "
                                  f"{arr.dtype} {arr.shape}{'' if arr.flags.c_contiguous else ' (not C-contiguous)'}"
                                  f"{'' if arr.flags.writeable else ' (read-only)'}")
        return arr


def as_row_ids(row_ids: Any, num_heads: int) -> np.ndarray:
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


def sort_key(layer_id: Any) -> Any:
    return (0, int(layer_id)) if isinstance(layer_id, (int, np.integer)) else (1, repr(layer_id))


def check_heads(heads: Sequence[int] | None, num_heads: int) -> list[int]:
    """The sorted, distinct head indices a store owns (all of them for None)."""
    if heads is None:
        return list(range(num_heads))
    if isinstance(heads, (str, bytes)) or not isinstance(heads, (list, tuple, range, np.ndarray)):
        raise InvalidType(f"heads: expected a list of head indices, got {describe(heads)}")
    out = []
    for i, h in enumerate(heads):
        if not is_int(h) or not 0 <= h < num_heads:
            raise InvalidArgument(f"heads[{i}]: expected a head index in [0, {num_heads}), got {describe(h)}")
        out.append(int(h))
    if not out or len(set(out)) != len(out) or out != sorted(out):
        raise InvalidArgument(f"heads: expected a non-empty increasing list of distinct head indices, got {out}")
    return out


def layers_of(layer_id: Any, config: Any, heads: Sequence[int] | None) -> list[Layer]:
    """The layers an EngramStore's first arguments name, in layer order: one (``layer_id, config``, maybe a head
    shard) or a ``{layer_id: EngramStoreConfig}`` mapping of several."""
    if not isinstance(layer_id, Mapping):
        return [Layer(layer_id, EngramStoreConfig() if config is None else config, heads)]
    if config is not None:
        raise InvalidArgument("config: a multi-layer EngramStore takes its configs in the layers mapping; "
                              "pass the store as store=")
    if heads is not None:
        raise InvalidArgument("heads: head shards are for a single-layer EngramStore")
    if not layer_id:
        raise InvalidArgument("layers: expected at least one {layer_id: EngramStoreConfig} entry, got none")
    return [Layer(lid, cfg, None) for lid, cfg in sorted(layer_id.items(), key=lambda kv: sort_key(kv[0]))]


def find_layer(layers: Mapping[Any, Layer], layer: Any) -> Layer:
    """The layer a call names with ``layer=`` among several (None names none of them)."""
    if layer is None:
        raise InvalidArgument(f"layer: this EngramStore holds layers {sorted(layers)}; name one with layer=")
    found = layers.get(layer) if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool) else None
    if found is None:
        raise InvalidArgument(f"layer: unknown Engram layer {describe(layer)}; this EngramStore holds "
                              f"{sorted(layers)}")
    return found


def check_tables(lay: Layer, buffers: Sequence[Any], streams: bool) -> list[Any]:
    """A layer's tables as given to ``populate`` or ``bind_local``, checked head by head (with ``streams``, a head
    may be a ``fill(start_row, out)`` function), each viewed as the layer's dtype."""
    n_heads = lay.num_heads
    if isinstance(buffers, np.ndarray) or not isinstance(buffers, (list, tuple)):
        raise InvalidType(f"embedding_buffers: expected a list of {n_heads} arrays (one per head), "
                          f"got {type(buffers).__name__}")
    if len(buffers) != n_heads:
        raise InvalidArgument(f"embedding_buffers: expected {n_heads} tables (one per head), got {len(buffers)}")
    for h, (t, n) in enumerate(zip(buffers, lay.sizes)):
        if streams and callable(t) and not isinstance(t, np.ndarray):
            continue  # a fill(start_row, out) function, called as the files are written
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
    return [t if callable(t) and not isinstance(t, np.ndarray) else t.view(lay.dtype) for t in buffers]
