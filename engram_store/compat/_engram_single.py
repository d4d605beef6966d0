"""Mooncake's first EngramStore: one layer of float32 rows, ``populate(buffers)`` and ``lookup(row_ids)``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..tables import EngramStore as NativeEngramStore
from ..tables import EngramStoreConfig as NativeEngramStoreConfig
from ..errors import (
    EngramError,
    InvalidType,
)
from ._engram import API_VERSIONS, EngramStore, EngramStoreConfig, _store_client
from ._errors import _lookup_error, _runtime_errors, _RuntimeInvalidArgument, _RuntimeInvalidType


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


API_VERSIONS["layer"] = _SingleLayerEngramStore
