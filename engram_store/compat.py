"""Mooncake's Python surface over this project's store.

Code written for ``mooncake.store.MooncakeDistributedStore`` and Mooncake's Python ``EngramStore`` runs
against this module by changing its imports alone::

    from engram_store.compat import EngramStore, EngramStoreConfig, ReplicateConfig, MooncakeDistributedStore

As in Mooncake, the store's methods return integer codes instead of raising (0 or a byte count on success, a
negative :class:`ErrorCode` on failure) and zero-copy calls take raw buffer addresses (``ndarray.ctypes.data``).
The failure behind a code is logged and kept in :attr:`MooncakeDistributedStore.last_error`.

:class:`EngramStore` speaks both generations of Mooncake's EngramStore, chosen by the first argument:

* a ``{layer_id: EngramStoreConfig}`` dict: the multi-layer API of opaque byte rows (``row_bytes`` per row),
  ``populate(layer_id, buffers, config)``, ``lookup_into(layer_id, row_ids, output)``, ``bind_local``,
  ``local_dir``, ``lookup_many_into``, ``remove_from_store(layer_id)``;
* a layer id ``int``: the single-layer float32 API, ``populate(buffers)``, ``lookup(row_ids)``,
  ``remove_from_store()``.

Both are a translation layer over :class:`engram_store.EngramStore`. Errors are raised with the builtin types
Mooncake's binding raises (``RuntimeError`` for what its C++ code reports, ``ValueError`` and ``TypeError`` for
arguments it refuses), as subclasses of the matching :class:`~engram_store.EngramError` class: a populate
over existing keys raises an exception that is both :class:`~engram_store.ObjectExists` and ``RuntimeError``.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import os
import socket
import sys
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ._client import DistributedStore
from ._config import DEFAULT_EMBEDDED_SEGMENT_SIZE, StoreConfig
from .tables import EngramStore as NativeEngramStore
from .tables import EngramStoreConfig as NativeEngramStoreConfig
from .tables import lookup_many
from ._errors import (
    ConfigError,
    EngramError,
    InvalidArgument,
    InvalidType,
    LeaseActive,
    MasterUnavailable,
    NotConnected,
    ObjectExists,
    ObjectLost,
    ObjectNotFound,
    OutOfSpace,
    ProtocolError,
    RemoteError,
    SegmentUnavailable,
    StoreError,
    Unavailable,
    describe,
)

log = logging.getLogger(__name__)

__all__ = [
    "EngramStore",
    "EngramStoreConfig",
    "ErrorCode",
    "MooncakeConfig",
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "StoreConfig",
]

#: Mooncake reads its configuration with ``MooncakeConfig.load_from_env()``; the fields are the same.
MooncakeConfig = StoreConfig


class ErrorCode(enum.IntEnum):
    """The subset of Mooncake's error codes this layer returns."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    NO_AVAILABLE_HANDLE = -200
    INVALID_PARAMS = -600
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    NOT_SET_UP = -1001


_CODES = [
    (ObjectNotFound, ErrorCode.OBJECT_NOT_FOUND),
    (ObjectExists, ErrorCode.OBJECT_ALREADY_EXISTS),
    (LeaseActive, ErrorCode.OBJECT_HAS_LEASE),
    (OutOfSpace, ErrorCode.NO_AVAILABLE_HANDLE),
    (MasterUnavailable, ErrorCode.RPC_FAIL),
    (Unavailable, ErrorCode.TRANSFER_FAIL),
    (InvalidArgument, ErrorCode.INVALID_PARAMS),
    (InvalidType, ErrorCode.INVALID_PARAMS),
]


def error_code(exc: BaseException) -> int:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return int(code)
    return int(ErrorCode.INTERNAL_ERROR)


class ReplicateConfig:
    """Mooncake's replication settings; ``replica_num`` is honoured, pinning is implied (tables never evict).

    The other fields are accepted so that code setting them runs; placement here is the master's choice.
    """

    def __init__(self, replica_num: int = 1):
        self.replica_num = replica_num
        self.nof_replica_num = 0
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.prefer_alloc_in_same_node = False


def _view(ptr: int, size: int, name: str) -> np.ndarray:
    """A uint8 array over ``size`` bytes at address ``ptr`` (the caller vouches for the memory)."""
    if not isinstance(ptr, int) or ptr <= 0:
        raise InvalidArgument(f"{name}: expected a buffer address (int > 0), got {ptr!r}")
    if not isinstance(size, int) or size < 0:
        raise InvalidArgument(f"{name}: expected a size (int >= 0), got {size!r}")
    if size == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer((ctypes.c_char * size).from_address(ptr), dtype=np.uint8)


class MooncakeDistributedStore:
    """``mooncake.store.MooncakeDistributedStore`` with this project's store underneath."""

    def __init__(self) -> None:
        self._store: DistributedStore | None = None
        self._registered: dict[int, int] = {}
        self.last_error: EngramError | None = None

    @property
    def native_store(self) -> DistributedStore | None:
        """The :class:`DistributedStore` behind this object (None before ``setup``)."""
        return self._store

    def _fail(self, op: str, exc: BaseException) -> int:
        self.last_error = exc if isinstance(exc, EngramError) else None
        log.warning("%s failed: %s", op, exc)
        return error_code(exc)

    def _require(self) -> DistributedStore:
        if self._store is None:
            raise Unavailable("the store is not set up: call setup(...) first")
        return self._store

    # ---- setup ----------------------------------------------------------------------------------

    def setup(self, local_hostname: str = "127.0.0.1", metadata_server: str = "",
              global_segment_size: int = 16 << 20, local_buffer_size: int = 1 << 30, protocol: str = "tcp",
              rdma_devices: str = "", master_server_addr: str = "", **kwargs: Any) -> int:
        """Connect (and mount ``global_segment_size`` bytes as a segment); 0 on success.

        ``master_server_addr`` may also be passed as ``master_server_address``. An empty master address
        starts an embedded master and segment in this process. ``metadata_server``, ``local_buffer_size``,
        ``protocol`` and ``rdma_devices`` are accepted for compatibility; the transport is ZeroMQ over TCP.
        """
        master = kwargs.pop("master_server_address", master_server_addr)
        kwargs.pop("device_name", None)
        if kwargs:
            return self._fail("setup", InvalidArgument(f"setup: unexpected arguments {sorted(kwargs)}"))
        try:
            config = StoreConfig(master_server_address=master or "", global_segment_size=global_segment_size,
                                 local_buffer_size=local_buffer_size, local_hostname=local_hostname or "127.0.0.1",
                                 metadata_server=metadata_server or "", protocol=protocol or "tcp",
                                 device_name=rdma_devices or "")
            if not config.master_server_address and not config.global_segment_size:
                config.global_segment_size = DEFAULT_EMBEDDED_SEGMENT_SIZE
            self.close()
            self._store = DistributedStore.from_config(config)
            return 0
        except EngramError as exc:
            return self._fail("setup", exc)

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 << 20) -> int:
        """Mooncake's older set-up call: an embedded store with a segment of ``mount_segment_size``."""
        return self.setup("127.0.0.1", "", mount_segment_size, 0, protocol, device_name, "")

    def get_hostname(self) -> str:
        return socket.gethostname()

    def close(self) -> int:
        if self._store is not None:
            self._store.close()
            self._store = None
        self._registered.clear()
        return 0

    # ---- buffers --------------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Accepted for compatibility (no registration is needed here); 0."""
        self._registered[int(buffer_ptr)] = int(size)
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        self._registered.pop(int(buffer_ptr), None)
        return 0

    # ---- writes ---------------------------------------------------------------------------------

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        try:
            self._require().put(key, value, replica_num=_replicas(config))
            return 0
        except EngramError as exc:
            return self._fail("put", exc)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        try:
            self._require().put(key, _view(buffer_ptr, size, "buffer_ptr"), replica_num=_replicas(config))
            return 0
        except EngramError as exc:
            return self._fail("put_from", exc)

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None) -> int:
        try:
            self._require().batch_put_from(keys, values, replica_num=_replicas(config))
            return 0
        except EngramError as exc:
            return self._fail("put_batch", exc)

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        """Each key on its own: one code per key (Mooncake's semantics; the native call is all-or-nothing)."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            self._fail("batch_put_from", InvalidArgument(
                f"batch_put_from: {len(keys)} keys, {len(buffer_ptrs)} pointers, {len(sizes)} sizes"))
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        codes = []
        for key, ptr, size in zip(keys, buffer_ptrs, sizes):
            codes.append(self.put_from(key, ptr, size, config))
        return codes

    # ---- reads ----------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The object's bytes, or ``b""`` when it cannot be read (as Mooncake)."""
        try:
            return self._require().get(key)
        except EngramError as exc:
            self._fail("get", exc)
            return b""

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        try:
            return self._require().get_into(key, _view(buffer_ptr, size, "buffer_ptr"))
        except EngramError as exc:
            return self._fail("get_into", exc)

    def get_into_ranges(self, buffer_ptrs: Sequence[int], all_keys: Sequence[Sequence[str]], all_dst_offsets: Sequence,
                        all_src_offsets: Sequence, all_sizes: Sequence) -> list:
        """Ranged reads into registered buffers; per range the bytes read, or a negative code for all of a call."""
        try:
            store = self._require()
            buffers = []
            for i, ptr in enumerate(buffer_ptrs):
                limit = self._registered.get(int(ptr))
                if limit is None:
                    # Unregistered: size the view to cover exactly the ranges asked of it.
                    ends = [d + n for dsts, ns in zip(all_dst_offsets[i], all_sizes[i]) for d, n in zip(dsts, ns)]
                    limit = max(ends, default=0)
                buffers.append(_view(int(ptr), limit, f"buffer_ptrs[{i}]"))
            return store.get_into_ranges(buffers, all_keys, all_dst_offsets, all_src_offsets, all_sizes)
        except EngramError as exc:
            code = self._fail("get_into_ranges", exc)
            return [[[code] * len(sizes) for sizes in per_buffer] for per_buffer in all_sizes]

    def is_exist(self, key: str) -> int:
        """1 if the key exists, 0 if not, negative on error."""
        try:
            return int(self._require().is_exist(key))
        except EngramError as exc:
            return self._fail("is_exist", exc)

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        try:
            return [int(x) for x in self._require().batch_is_exist(list(keys))]
        except EngramError as exc:
            return [self._fail("batch_is_exist", exc)] * len(keys)

    def get_size(self, key: str) -> int:
        try:
            return self._require().get_size(key)
        except EngramError as exc:
            return self._fail("get_size", exc)

    # ---- removal --------------------------------------------------------------------------------

    def remove(self, key: str, force: bool = False) -> int:
        try:
            self._require().remove(key, force=force)
            return 0
        except EngramError as exc:
            return self._fail("remove", exc)

    def remove_all(self, force: bool = False) -> int:
        """The number of objects removed, or a negative code."""
        try:
            return self._require().remove_all(force=force)
        except EngramError as exc:
            return self._fail("remove_all", exc)


def _replicas(config: ReplicateConfig | None) -> int:
    return 1 if config is None else int(getattr(config, "replica_num", 1))


# ---- EngramStore: both generations of Mooncake's Python EngramStore ---------------------------------------

#: Mooncake's ``EngramStoreConfig()`` defaults. ``row_bytes`` 0 is Mooncake's too: it must be set before a
#: byte-row EngramStore is built.
DEFAULT_TABLE_VOCAB_SIZES = (1024,)
DEFAULT_EMBEDDING_DIM = 64
DEFAULT_ROW_BYTES = 0

_UNSET: Any = object()


def _runtime_twin(cls: type) -> type:
    """``cls``, also a RuntimeError: what Mooncake's binding raises when its C++ code reports a failure."""
    summary = (cls.__doc__ or cls.__name__).strip().splitlines()[0]
    return type(cls.__name__, (cls, RuntimeError),
                {"__module__": __name__, "__doc__": f"{summary} (Also a RuntimeError, as Mooncake raises it.)"})


#: Each engram error class as this layer raises it where Mooncake raises RuntimeError (``except EngramError``,
#: ``except ObjectExists`` and ``except RuntimeError`` all catch it).
_RUNTIME_ERRORS: dict[type, type] = {cls: _runtime_twin(cls) for cls in (
    EngramError, InvalidArgument, ConfigError, InvalidType, StoreError, ObjectNotFound, ObjectExists, LeaseActive,
    OutOfSpace, Unavailable, MasterUnavailable, SegmentUnavailable, ObjectLost, ProtocolError, RemoteError)}
_RuntimeInvalidArgument = _RUNTIME_ERRORS[InvalidArgument]
_RuntimeInvalidType = _RUNTIME_ERRORS[InvalidType]


def _as_runtime_error(exc: EngramError, message: str | None = None) -> EngramError:
    """``exc`` as a RuntimeError of its own class (itself if it is one already and keeps its message)."""
    text = str(exc) if message is None else message
    if isinstance(exc, RuntimeError):
        return exc if message is None else type(exc)(text)
    cls = next(c for c in type(exc).__mro__ if c in _RUNTIME_ERRORS)
    return _RUNTIME_ERRORS[cls](text)


@contextlib.contextmanager
def _runtime_errors() -> Iterator[None]:
    """Raise the engram errors of the block as RuntimeErrors of their own class, as Mooncake does."""
    try:
        yield
    except EngramError as exc:
        mapped = _as_runtime_error(exc)
        if mapped is exc:
            raise
        raise mapped from exc


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _describe_array(value: Any) -> str:
    if not isinstance(value, np.ndarray):
        return type(value).__name__
    return (f"{value.dtype} array of shape {value.shape}" + ("" if value.flags.c_contiguous else " (not C-contiguous)")
            + ("" if value.flags.writeable else " (read-only)"))


class EngramStoreConfig:
    """Mooncake's ``EngramStoreConfig``: the head tables of one layer, described by attributes.

    ``table_vocab_sizes``: the rows of each head (default ``[1024]``). ``row_bytes``: the width of an opaque byte
    row, for the multi-layer API (default 0, so it must be set). ``embedding_dim``: float32 values per row, for
    the single-layer API (default 64). As in Mooncake, ``EngramStoreConfig()`` takes no arguments and the
    fields are set one by one (keywords work too); values are checked when an EngramStore is built, and
    reading ``table_vocab_sizes`` returns a copy.
    """

    def __init__(self, table_vocab_sizes: Iterable[int] | None = None, embedding_dim: int = DEFAULT_EMBEDDING_DIM,
                 row_bytes: int = DEFAULT_ROW_BYTES):
        self.table_vocab_sizes = list(DEFAULT_TABLE_VOCAB_SIZES) if table_vocab_sizes is None else table_vocab_sizes
        self.embedding_dim = embedding_dim
        self.row_bytes = row_bytes

    @property
    def table_vocab_sizes(self) -> list[int]:
        return list(self._table_vocab_sizes)

    @table_vocab_sizes.setter
    def table_vocab_sizes(self, value: Iterable[int]) -> None:
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise InvalidType(f"table_vocab_sizes: expected a list of integer row counts, got {describe(value)}")
        sizes = list(value)
        for h, n in enumerate(sizes):
            if not _is_int(n):
                raise InvalidType(f"table_vocab_sizes[{h}]: expected an integer row count, got {describe(n)}")
        self._table_vocab_sizes = [int(n) for n in sizes]

    @property
    def embedding_dim(self) -> int:
        return self._embedding_dim

    @embedding_dim.setter
    def embedding_dim(self, value: int) -> None:
        if not _is_int(value):
            raise InvalidType(f"embedding_dim: expected an integer, got {describe(value)}")
        self._embedding_dim = int(value)

    @property
    def row_bytes(self) -> int:
        return self._row_bytes

    @row_bytes.setter
    def row_bytes(self, value: int) -> None:
        if not _is_int(value):
            raise InvalidType(f"row_bytes: expected an integer, got {describe(value)}")
        self._row_bytes = int(value)

    def __repr__(self) -> str:
        return (f"EngramStoreConfig(table_vocab_sizes={self._table_vocab_sizes}, row_bytes={self._row_bytes}, "
                f"embedding_dim={self._embedding_dim})")


def _store_client(store: Any) -> Any:
    """The store an EngramStore reads through: None, or a kind of store it knows; anything else is refused."""
    if store is None or isinstance(store, DistributedStore):
        return store
    if isinstance(store, MooncakeDistributedStore):
        if store.native_store is None:
            raise NotConnected("store: this MooncakeDistributedStore is not set up; call store.setup(...) (0 means "
                               "connected) before building an EngramStore on it")
        return store
    mooncake = sys.modules.get("mooncake.store")  # a real Mooncake store means its module is loaded already
    if mooncake is not None and isinstance(store, getattr(mooncake, "MooncakeDistributedStore", ())):
        return store
    raise _RuntimeInvalidType(f"store: expected a MooncakeDistributedStore (engram_store.compat's or "
                              f"mooncake.store's), an engram_store.DistributedStore, or None; "
                              f"got {type(store).__name__}")


def _generation(args: tuple, kwargs: dict) -> type:
    """The API generation an ``EngramStore(...)`` call speaks: a layers dict, or one layer id."""
    if args:
        first, name = args[0], "the first argument"
    elif "layers" in kwargs:
        first, name = kwargs["layers"], "layers"
    elif "layer_id" in kwargs:
        first, name = kwargs["layer_id"], "layer_id"
    else:
        raise InvalidType("EngramStore: expected layers={layer_id: EngramStoreConfig} (byte rows, one or more "
                          "layers) or layer_id=<int> with config= (float32 rows, one layer)")
    if isinstance(first, Mapping):
        return _MultiLayerEngramStore
    if _is_int(first):
        return _SingleLayerEngramStore
    raise InvalidType(f"EngramStore: expected a {{layer_id: EngramStoreConfig}} dict (the multi-layer byte-row "
                      f"API) or a layer id int (the single-layer float32 API) as {name}, got {describe(first)}")


class EngramStore:
    """Mooncake's Python ``EngramStore``, either generation, over :class:`engram_store.EngramStore`.

    Several layers of opaque byte rows (Mooncake's current API)::

        EngramStore({1: config_1, 14: config_14}, store)           # or store=, store_client=
        EngramStore(layers)                                        # then bind_local(layer_id, arrays)
        EngramStore(layers, local_dir="/dev/shm/engram")           # tables in files shared by the host

    One layer of float32 rows (its first API)::

        EngramStore(layer_id, config, store=None)

    ``store`` is a MooncakeDistributedStore (this module's, or a real ``mooncake.store`` one), an
    :class:`engram_store.DistributedStore`, or None. Layers written by Mooncake's own EngramStore (which writes
    no layout manifest) are read as they are. ``native`` is the :class:`engram_store.EngramStore` underneath.
    """

    _es: NativeEngramStore

    def __new__(cls, *args: Any, **kwargs: Any) -> "EngramStore":
        if cls is EngramStore:
            cls = _generation(args, kwargs)
        return super().__new__(cls)

    @property
    def native(self) -> NativeEngramStore:
        """The :class:`engram_store.EngramStore` underneath (``prefetch``, ``lookup_layers``, ``stats``, ...);
        closed with this object."""
        return self._es

    def close(self) -> None:
        """Release mapped tables and bound arrays; safe to call twice (Mooncake releases them with the object)."""
        es = getattr(self, "_es", None)
        if es is not None:
            es.close()

    def __enter__(self) -> "EngramStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # Mooncake's users release an EngramStore by dropping it, never with close(). On a real Mooncake store
        # the native EngramStore keeps a staging buffer registered with the store's transfer engine; left
        # registered, its freed memory is refused (as overlapping) when a later buffer is allocated there.
        try:
            self.close()
        except Exception:  # at interpreter exit the store may be gone already
            pass

    def __repr__(self) -> str:
        es = getattr(self, "_es", None)
        return repr(es) if es is not None else "EngramStore(<not built>)"

    def _remove(self, force: bool, layer_id: int) -> int:
        if self._client is None:
            where = (f"its tables are files under local_dir {self._es.local_dir}; removing one is a deployment "
                     f"step: delete {os.path.join(self._es.local_dir, f'layer-{layer_id}')}"
                     if self._es.local_dir else "it was built with store=None")
            raise NotConnected(f"remove_from_store failed, rc={int(ErrorCode.INVALID_PARAMS)}: layer {layer_id} of "
                               f"this EngramStore has no store client ({where})")
        try:
            return self._es.remove_from_store(bool(force), layer=layer_id)
        except EngramError as exc:
            raise _as_runtime_error(exc, f"remove_from_store failed, rc={error_code(exc)}: {exc}") from exc


class _MultiLayerEngramStore(EngramStore):
    """Mooncake's multi-layer EngramStore of opaque byte rows: ``EngramStore(layers, store, local_dir)``."""

    def __init__(self, layers: Mapping[int, EngramStoreConfig], store: Any = None,
                 local_dir: str | os.PathLike | None = "", *, store_client: Any = None):
        if store is not None and store_client is not None:
            raise InvalidType("EngramStore: pass the store once, as store= (Mooncake's first byte-row API) or "
                              "store_client= (the later one), not both")
        client = store if store is not None else store_client
        if local_dir is not None and not isinstance(local_dir, (str, os.PathLike)):
            raise InvalidType(f"local_dir: expected a directory path (str), got {describe(local_dir)}")
        local = os.fspath(local_dir) if local_dir is not None else ""
        if client is not None and local:
            raise InvalidArgument(f"store_client and local_dir are mutually exclusive: tables are read from a store "
                                  f"or from files under local_dir, got a {type(client).__name__} and "
                                  f"local_dir={local!r}")
        if not isinstance(layers, Mapping):
            raise InvalidType(f"layers: expected a {{layer_id: EngramStoreConfig}} dict, got {describe(layers)}")
        if not layers:
            raise InvalidArgument("layers: EngramStore requires at least one layer, got an empty dict")
        configs = {}
        for layer_id, config in layers.items():
            if not _is_int(layer_id):
                raise InvalidType(f"layers: expected integer layer ids, got {describe(layer_id)}")
            if layer_id < 0:
                raise InvalidArgument(f"layers: expected non-negative layer ids, got {int(layer_id)}")
            configs[int(layer_id)] = _byte_rows_config(int(layer_id), config)
        self._client = _store_client(client)
        with _runtime_errors():  # a published layer under local_dir that does not match is checked now
            self._es = NativeEngramStore(configs, store=self._client, local_dir=local or None,
                                         require_manifest=False)
        self._layer_ids = frozenset(configs)

    def _layer(self, layer_id: Any) -> int:
        if not _is_int(layer_id):
            raise InvalidType(f"layer_id: expected an integer layer id, got {describe(layer_id)}")
        if int(layer_id) not in self._layer_ids:
            raise InvalidArgument(f"Unknown Engram layer: {int(layer_id)} (layer_id: expected one of this "
                                  f"EngramStore's layers {sorted(self._layer_ids)})")
        return int(layer_id)

    # ---- metadata (no store needed) ---------------------------------------------------------------

    def get_layer_ids(self) -> list[int]:
        return self._es.get_layer_ids()

    def get_num_heads(self, layer_id: int) -> int:
        return self._es.get_num_heads(layer=self._layer(layer_id))

    def get_row_bytes(self, layer_id: int) -> int:
        return self._es.get_row_bytes(layer=self._layer(layer_id))

    def get_table_vocab_sizes(self, layer_id: int) -> list[int]:
        return self._es.get_table_vocab_sizes(layer=self._layer(layer_id))

    def get_store_keys(self, layer_id: int) -> list[str]:
        return self._es.get_store_keys(layer=self._layer(layer_id))

    # ---- tables ---------------------------------------------------------------------------------

    def populate(self, layer_id: int, embedding_buffers: list, config: Any = _UNSET, *,
                 replicate_config: Any = _UNSET) -> None:
        """Copy the layer's head tables into the store, or into files under ``local_dir``; create-only and
        all-or-nothing.

        ``embedding_buffers``: a list of one C-contiguous uint8 ``[N_h, row_bytes]`` NumPy array per head
        (read-only arrays are fine; nothing is cast). ``config`` (or ``replicate_config=``): a ReplicateConfig
        whose ``replica_num`` copies go to distinct segments (None: one; ignored under ``local_dir``). The arrays
        may be released or changed once this returns.
        """
        layer_id = self._layer(layer_id)
        replicas = _replica_num(config, replicate_config)
        tables = self._check_tables(layer_id, embedding_buffers)
        with _runtime_errors():
            self._es.populate(tables, replicas, layer=layer_id)

    def bind_local(self, layer_id: int, embedding_buffers: list) -> None:
        """Read the layer from the caller's own immutable uint8 ``[N_h, row_bytes]`` arrays, in place (no copy).

        The arrays are retained for this EngramStore's lifetime; do not modify, resize or unmap them while bound.
        Only for an EngramStore built without a store or ``local_dir``, once per layer.
        """
        layer_id = self._layer(layer_id)
        tables = self._check_tables(layer_id, embedding_buffers)
        if self._client is not None or self._es.local_dir is not None:
            source = "a store" if self._client is not None else f"local_dir {self._es.local_dir}"
            raise _RuntimeInvalidArgument(f"bind_local requires an unbound layer and no Store client: layer "
                                          f"{layer_id} of this EngramStore is read from {source}; bind_local is for "
                                          "EngramStore(layers) built without one")
        with _runtime_errors():
            self._es.bind_local(tables, layer=layer_id)

    def _check_tables(self, layer_id: int, buffers: Any) -> list[np.ndarray]:
        sizes = self._es.get_table_vocab_sizes(layer=layer_id)
        row_bytes = self._es.get_row_bytes(layer=layer_id)
        H = len(sizes)
        if not isinstance(buffers, list):
            raise InvalidType(f"embedding_buffers: expected a list of {H} uint8 NumPy arrays (one per head of layer "
                              f"{layer_id}), got {type(buffers).__name__}")
        if len(buffers) != H:
            raise _RuntimeInvalidArgument(f"embedding_buffers: expected {H} tables (one per head of layer "
                                          f"{layer_id}), got {len(buffers)}")
        for h, (table, n) in enumerate(zip(buffers, sizes)):
            if not isinstance(table, np.ndarray):
                raise _RuntimeInvalidType(f"embedding_buffers[{h}]: expected a NumPy uint8 array, "
                                          f"got {type(table).__name__}")
            if table.dtype != np.uint8 or not table.flags.c_contiguous:
                raise _RuntimeInvalidType(f"embedding_buffers[{h}]: expected a C-contiguous uint8 array (rows are "
                                          f"opaque bytes; nothing is cast or copied to fit), "
                                          f"got a {_describe_array(table)}")
            if table.shape != (n, row_bytes):
                raise _RuntimeInvalidArgument(f"embedding_buffers[{h}]: expected shape ({n}, {row_bytes}) "
                                              f"(table_vocab_sizes[{h}] rows x row_bytes of layer {layer_id}), "
                                              f"got {table.shape}")
        return buffers

    # ---- lookups --------------------------------------------------------------------------------

    def lookup_into(self, layer_id: int, row_ids: np.ndarray, output: np.ndarray) -> None:
        """``output[b, l, h] = row row_ids[b, l, h] of head h``: int64 ``[B, L, H]`` ids, uint8
        ``[B, L, H, row_bytes]`` output, both C-contiguous NumPy arrays (nothing is converted).

        Every id is checked before anything is read; a failed lookup leaves ``output`` zeroed. An empty batch
        does nothing. The output needs no registration (a registered one works the same).
        """
        layer_id = self._layer(layer_id)
        row_ids, output = self._check_pair(layer_id, row_ids, output, "row_ids", "output", InvalidType)
        if row_ids.size:
            self._read([layer_id], [row_ids], [output])

    def lookup_many_into(self, layer_ids: Sequence[int], row_ids: Sequence[np.ndarray],
                         outputs: Sequence[np.ndarray]) -> None:
        """:meth:`lookup_into` for several (layer, ids, output) at once; the reads of all of them go out together
        (one request per segment server). A bad id anywhere fails them all and leaves every output zeroed."""
        lists = {"layer_ids": layer_ids, "row_ids": row_ids, "outputs": outputs}
        _check_lists(lists)
        layers = [self._layer(layer_id) for layer_id in layer_ids]
        _check_equal_lengths(lists)
        pairs = [self._check_pair(layer_id, ids, out, f"row_ids[{i}]", f"outputs[{i}]", _RuntimeInvalidType)
                 for i, (layer_id, ids, out) in enumerate(zip(layers, row_ids, outputs))]
        _check_disjoint([out for _, out in pairs])
        jobs = [(layer_id, ids, out) for layer_id, (ids, out) in zip(layers, pairs) if ids.size]
        if jobs:
            self._read(*(list(column) for column in zip(*jobs)))

    def lookup_many_into_registered(self, layer_ids: Sequence[int], row_ids: Sequence[np.ndarray],
                                    output_addresses: Sequence[int], output_sizes: Sequence[int]) -> None:
        """:meth:`lookup_many_into` with each output given as a raw address and its size in bytes: memory the
        caller owns (a framework's pinned or registered buffer), written as ``[B, L, H, row_bytes]`` uint8.

        The addresses must stay valid for the call; nothing checks that they point at memory the caller may
        write. This store reads into any memory, so registering it with the store is not required."""
        lists = {"layer_ids": layer_ids, "row_ids": row_ids, "output_addresses": output_addresses,
                 "output_sizes": output_sizes}
        _check_lists(lists)
        layers = [self._layer(layer_id) for layer_id in layer_ids]
        _check_equal_lengths(lists)
        jobs, outs = [], []
        for i, (layer_id, ids, address, size) in enumerate(zip(layers, row_ids, output_addresses, output_sizes)):
            H = self._es.get_num_heads(layer=layer_id)
            row_bytes = self._es.get_row_bytes(layer=layer_id)
            if not (isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.flags.c_contiguous
                    and ids.ndim == 3 and ids.shape[2] == H):
                raise _RuntimeInvalidArgument(f"lookup_many_into_registered requires contiguous int64 IDs [B,L,H]: "
                                              f"expected row_ids[{i}] of shape [B, L, {H}] (layer {layer_id}), got "
                                              f"{_describe_array(ids)}")
            for name, value in (("output_addresses", address), ("output_sizes", size)):
                if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                    raise _RuntimeInvalidArgument(f"{name}[{i}]: expected a non-negative integer, got {value!r}")
            outs.append(np.empty(0, dtype=np.uint8))
            if ids.size == 0:
                continue
            if address == 0:
                raise _RuntimeInvalidArgument(f"output_addresses[{i}]: registered output address must be nonzero")
            shape = ids.shape + (row_bytes,)
            need = ids.size * row_bytes
            if size != need:
                raise _RuntimeInvalidArgument(f"output_sizes[{i}]: expected {need} bytes ([B, L, H, row_bytes] = "
                                              f"{list(shape)} for layer {layer_id}), got {size}")
            out = np.ctypeslib.as_array((ctypes.c_uint8 * need).from_address(int(address))).reshape(shape)
            jobs.append((layer_id, ids, out))
            outs[i] = out
        if jobs:
            _check_disjoint(outs, "output_addresses")
            self._read(*(list(column) for column in zip(*jobs)))

    def lookup(self, table_ids: Sequence[int], row_ids: np.ndarray, output: np.ndarray) -> None:
        """Mooncake's packed lookup: ``output[i, t] = row row_ids[i, t] of layer table_ids[i]``, for layers of
        one head each; an id of -1 leaves ``output[i, t]`` as it is.

        ``row_ids``: C-contiguous int64 ``[len(table_ids), tokens]``; ``output``: writable C-contiguous uint8
        ``[len(table_ids), tokens, row_bytes]``. Every id is checked before anything is written.
        """
        if not isinstance(table_ids, (list, tuple)):
            raise InvalidType(f"table_ids: expected a list of layer ids, got {type(table_ids).__name__}")
        layers = [self._layer(layer_id) for layer_id in table_ids]
        if not layers:
            raise InvalidArgument("table_ids: expected at least one layer id, got an empty list")
        for layer_id in layers:
            if self._es.get_num_heads(layer=layer_id) != 1:
                raise InvalidArgument(f"table_ids: layer {layer_id} has {self._es.get_num_heads(layer=layer_id)} "
                                      "heads; lookup(table_ids, ...) reads layers of one head (lookup_into reads "
                                      "[B, L, H] ids of any layer)")
        row_bytes = self._es.get_row_bytes(layer=layers[0])
        for layer_id in layers[1:]:
            if self._es.get_row_bytes(layer=layer_id) != row_bytes:
                raise InvalidArgument(f"table_ids: layer {layer_id} has rows of "
                                      f"{self._es.get_row_bytes(layer=layer_id)} bytes, layer {layers[0]} of "
                                      f"{row_bytes}; one output holds rows of one width")
        n = len(layers)
        if not (isinstance(row_ids, np.ndarray) and row_ids.dtype == np.int64 and row_ids.flags.c_contiguous
                and row_ids.ndim == 2 and row_ids.shape[0] == n):
            raise InvalidArgument(f"lookup requires contiguous int64 IDs [heads,tokens]: expected row_ids of shape "
                                  f"({n}, tokens), got {_describe_array(row_ids)}")
        T = row_ids.shape[1]
        if not (isinstance(output, np.ndarray) and output.dtype == np.uint8 and output.flags.c_contiguous
                and output.flags.writeable and output.shape == (n, T, row_bytes)):
            raise InvalidArgument(f"output must be contiguous writable uint8 of shape [heads,tokens,row_bytes]: "
                                  f"expected ({n}, {T}, {row_bytes}), got {_describe_array(output)}")
        if T == 0:
            return
        for i, layer_id in enumerate(layers):
            rows = self._es.get_table_vocab_sizes(layer=layer_id)[0]
            bad = np.flatnonzero((row_ids[i] < -1) | (row_ids[i] >= rows))
            if bad.size:
                t = int(bad[0])
                raise _RuntimeInvalidArgument(f"row_ids[{i}, {t}] = {int(row_ids[i, t])} is out of range: layer "
                                              f"{layer_id} has {rows} rows (expected -1 to skip, or 0 <= id < "
                                              f"{rows})")
        requests, request_layers, targets, holes = [], [], [], []
        for i, layer_id in enumerate(layers):
            keep = row_ids[i] != -1
            if keep.all():  # read straight into the output
                requests.append((self._es, row_ids[i].reshape(1, T, 1)))
                targets.append(output[i].reshape(1, T, 1, row_bytes))
            elif keep.any():  # read the rows asked for, then put them in place around the holes
                positions = np.flatnonzero(keep)
                requests.append((self._es, np.ascontiguousarray(row_ids[i, positions]).reshape(1, -1, 1)))
                targets.append(np.empty((1, positions.size, 1, row_bytes), dtype=np.uint8))
                holes.append((i, positions, targets[-1]))
            else:
                continue
            request_layers.append(layer_id)
        if requests:
            with _runtime_errors():
                lookup_many(requests, layers=request_layers, out=targets).result()
        for i, positions, rows in holes:
            output[i, positions] = rows.reshape(-1, row_bytes)

    def _check_pair(self, layer_id: int, row_ids: Any, output: Any, ids_name: str, out_name: str,
                    type_error: type) -> tuple[np.ndarray, np.ndarray]:
        """Validate one lookup's ids and output as Mooncake does: no conversion, no copy."""
        H = self._es.get_num_heads(layer=layer_id)
        row_bytes = self._es.get_row_bytes(layer=layer_id)
        if not (isinstance(row_ids, np.ndarray) and row_ids.dtype == np.int64 and row_ids.flags.c_contiguous):
            raise type_error(f"{ids_name}: expected a C-contiguous int64 NumPy array [B, L, {H}] (nothing is "
                             f"converted), got {_describe_array(row_ids)}")
        if not isinstance(output, np.ndarray):
            raise type_error(f"{out_name}: expected a writable C-contiguous uint8 NumPy array [B, L, {H}, "
                             f"{row_bytes}], got {type(output).__name__}")
        if row_ids.ndim != 3 or row_ids.shape[2] != H:
            raise _RuntimeInvalidArgument(f"{ids_name}: expected shape [B, L, {H}] ({H} heads in layer {layer_id}), "
                                          f"got {row_ids.shape}")
        shape = row_ids.shape + (row_bytes,)
        if (output.dtype != np.uint8 or output.shape != shape or not output.flags.c_contiguous
                or not output.flags.writeable):
            raise _RuntimeInvalidArgument(f"{out_name}: expected a writable C-contiguous uint8 array of shape "
                                          f"{shape} (row_bytes = {row_bytes} for layer {layer_id}), "
                                          f"got a {_describe_array(output)}")
        return row_ids, output

    def _read(self, layer_ids: list[int], row_ids: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        """Read checked lookups; on failure zero every output (as Mooncake) unless the layer has no tables at all."""
        try:
            if len(layer_ids) == 1:
                self._es.lookup_into(row_ids[0], outputs[0], layer=layer_ids[0])
            else:
                lookup_many([(self._es, ids) for ids in row_ids], layers=layer_ids, out=outputs).result()
        except NotConnected:
            raise  # no store, and the layer neither bound nor under local_dir: nothing was read or written
        except EngramError as exc:
            for output in outputs:
                output[...] = 0  # never a partly written output
            raise _lookup_error(exc, from_store=self._client is not None) from exc

    def remove_from_store(self, layer_id: int, force: bool = False) -> int:
        """Remove the layer's head tables from the store; the number removed (missing ones are skipped).

        Other layers are untouched. Without a store this fails (rc=-600, as in Mooncake): layers published under
        ``local_dir`` are files, removed by deleting their directory.
        """
        return self._remove(force, self._layer(layer_id))


def _byte_rows_config(layer_id: int, config: Any) -> NativeEngramStoreConfig:
    """The native config of a byte-row layer, its fields checked (and named) as this layer's."""
    if not isinstance(config, EngramStoreConfig):
        raise InvalidType(f"layers[{layer_id}]: expected an EngramStoreConfig, got {type(config).__name__}")
    if config.row_bytes <= 0:
        raise InvalidArgument(f"layers[{layer_id}].row_bytes: expected a positive row width in bytes, "
                              f"got {config.row_bytes}")
    try:
        return NativeEngramStoreConfig(config.table_vocab_sizes, config.row_bytes, row_format="bytes")
    except InvalidArgument as exc:
        raise InvalidArgument(f"layers[{layer_id}].{exc}") from None


def _replica_num(config: Any, alias: Any) -> int:
    """``replica_num`` of populate's ReplicateConfig, given as ``config`` or ``replicate_config`` (None: 1)."""
    if config is not _UNSET and alias is not _UNSET:
        raise InvalidType("populate: pass the ReplicateConfig once, as config= or replicate_config=")
    chosen = alias if config is _UNSET else config
    if chosen is _UNSET or chosen is None:
        return 1
    replicas = getattr(chosen, "replica_num", None)
    if not _is_int(replicas):
        raise InvalidType(f"config: expected a ReplicateConfig or None, got {type(chosen).__name__}")
    if replicas < 1:
        raise InvalidArgument(f"config.replica_num: expected an integer >= 1, got {int(replicas)}")
    return int(replicas)


def _lookup_error(exc: EngramError, from_store: bool) -> EngramError:
    """A failed lookup's error as Mooncake raises it (a RuntimeError); a missing table says what that means."""
    if from_store and isinstance(exc, ObjectNotFound):
        return _as_runtime_error(exc, f"{exc}: the layer is not in the store (never populated, or removed)")
    return _as_runtime_error(exc)


def _check_lists(lists: dict[str, Any]) -> None:
    """Each named argument of a many-lookup call is a list (or tuple)."""
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)):
            raise _RuntimeInvalidType(f"{name}: expected a list, got {type(value).__name__}")


def _check_equal_lengths(lists: dict[str, Any]) -> None:
    """The named lists of a many-lookup call are of one length (one entry per lookup)."""
    lengths = [len(value) for value in lists.values()]
    if len(set(lengths)) > 1:
        names = list(lists)
        raise _RuntimeInvalidArgument(f"{', '.join(names[:-1])} and {names[-1]} must have equal lengths, got "
                                      f"{', '.join(map(str, lengths[:-1]))} and {lengths[-1]}")


def _check_disjoint(outputs: list[np.ndarray], name: str = "outputs") -> None:
    """Refuse outputs that share memory: one lookup would overwrite another's rows."""
    spans = sorted((out.ctypes.data, out.ctypes.data + out.nbytes, i) for i, out in enumerate(outputs) if out.nbytes)
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            raise _RuntimeInvalidArgument(f"{name}[{min(i, j)}] and {name}[{max(i, j)}] overlap in memory; each "
                                          "lookup needs its own output")


class _SingleLayerEngramStore(EngramStore):
    """Mooncake's first EngramStore: one layer of float32 rows, ``EngramStore(layer_id, config, store)``."""

    def __init__(self, layer_id: int, config: EngramStoreConfig, store: Any = None):
        if not isinstance(config, EngramStoreConfig):
            raise InvalidType(f"config: expected an EngramStoreConfig, got {type(config).__name__}")
        native_config = NativeEngramStoreConfig(config.table_vocab_sizes, config.embedding_dim)
        self._client = _store_client(store)
        self._es = NativeEngramStore(layer_id, native_config, self._client, require_manifest=False)

    def get_table_vocab_sizes(self) -> list[int]:
        return self._es.get_table_vocab_sizes()

    def get_store_keys(self) -> list[str]:
        return self._es.get_store_keys()

    def get_num_heads(self) -> int:
        return self._es.get_num_heads()

    def get_embedding_dim(self) -> int:
        return self._es.get_embedding_dim()

    def populate(self, embedding_buffers: list) -> None:
        """Write one ``[N_h, embedding_dim]`` table per head to the store; create-only and all-or-nothing.

        Each table is converted to C-contiguous float32 first (as Mooncake does).
        """
        sizes, dim = self._es.get_table_vocab_sizes(), self._es.get_embedding_dim()
        if not isinstance(embedding_buffers, list):
            raise InvalidType(f"embedding_buffers: expected a list of {len(sizes)} NumPy arrays (one per head), "
                              f"got {type(embedding_buffers).__name__}")
        if len(embedding_buffers) != len(sizes):
            raise _RuntimeInvalidArgument(f"embedding_buffers: expected {len(sizes)} tables (one per head), "
                                          f"got {len(embedding_buffers)}")
        tables = []
        for h, (buffer, n) in enumerate(zip(embedding_buffers, sizes)):
            if not isinstance(buffer, np.ndarray):
                raise _RuntimeInvalidType(f"embedding_buffers[{h}]: expected a NumPy array, "
                                          f"got {type(buffer).__name__}")
            try:
                table = np.ascontiguousarray(buffer, dtype=np.float32)
            except (TypeError, ValueError):
                raise _RuntimeInvalidType(f"embedding_buffers[{h}]: expected values convertible to float32, "
                                          f"got dtype {buffer.dtype}") from None
            if table.shape != (n, dim):
                raise _RuntimeInvalidArgument(f"embedding_buffers[{h}]: expected shape ({n}, {dim}) "
                                              f"(table_vocab_sizes[{h}] rows x embedding_dim), got {buffer.shape}")
            tables.append(table)
        with _runtime_errors():
            self._es.populate(tables)

    def lookup(self, row_ids: Any) -> np.ndarray:
        """Rows for ``[B, L, H]`` row ids (nested lists or an integer array) as a new float32 ``[B, L, H, D]``."""
        try:
            return self._es.lookup(row_ids)
        except EngramError as exc:
            mapped = _lookup_error(exc, from_store=True)
            if mapped is exc:
                raise
            raise mapped from exc

    def remove_from_store(self, force: bool = False) -> int:
        """Remove the layer's head tables from the store; the number removed (missing ones are skipped)."""
        return self._remove(force, self._es.layer_id)
