"""Mooncake's Python ``EngramStore``: its config, and the class whose first argument picks the API version."""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Mapping


from ..client import DistributedStore
from ..tables import EngramStore as NativeEngramStore
from ..errors import (
    EngramError,
    InvalidType,
    NotConnected,
    describe,
)
from ._errors import (
    DEFAULT_EMBEDDING_DIM,
    DEFAULT_ROW_BYTES,
    DEFAULT_TABLE_VOCAB_SIZES,
    _as_runtime_error,
    _is_int,
    _RuntimeInvalidType,
)
from ._codes import ErrorCode, error_code
from ._store import MooncakeDistributedStore


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


#: The API versions, by the kind of first argument: "layers" (a dict) and "layer" (an id). Each version's
#: module registers its class here (the package imports both), so this module imports neither.
API_VERSIONS: dict[str, type] = {}


def _api_version(args: tuple, kwargs: dict) -> type:
    """The API version an ``EngramStore(...)`` call speaks: a layers dict, or one layer id."""
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
        return API_VERSIONS["layers"]
    if _is_int(first):
        return API_VERSIONS["layer"]
    raise InvalidType(f"EngramStore: expected a {{layer_id: EngramStoreConfig}} dict (the multi-layer byte-row "
                      f"API) or a layer id int (the single-layer float32 API) as {name}, got {describe(first)}")


class EngramStore:
    """Mooncake's Python ``EngramStore``, either API version, over :class:`engram_store.EngramStore`.

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
            cls = _api_version(args, kwargs)
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
        # its staging buffer, registered with the store's transfer engine, then goes to the next EngramStore on
        # that store, still registered (freed, its memory would be refused as overlapping when a later buffer
        # is allocated there), and nothing calls the store, which may be closed already.
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
