"""Mooncake's Python surface over this project's store.

Code written for ``mooncake.store.MooncakeDistributedStore`` and Mooncake's Python ``EngramStore`` runs
against this module by changing its imports alone::

    from engram_store.compat import EngramStore, EngramStoreConfig, ReplicateConfig, MooncakeDistributedStore
    from engram_store.compat import SoftPinAction

As in Mooncake, the store's methods return integer codes instead of raising (0 or a byte count on success, a
negative :class:`ErrorCode` on failure) and zero-copy calls take raw buffer addresses (``ndarray.ctypes.data``).
The failure behind a code is logged and kept in :attr:`MooncakeDistributedStore.last_error`.

:class:`EngramStore` speaks both API versions of Mooncake's EngramStore, chosen by the first argument:

* a ``{layer_id: EngramStoreConfig}`` dict: the multi-layer API of opaque byte rows (``row_bytes`` per row),
  ``populate(layer_id, buffers, config)``, ``lookup_into(layer_id, row_ids, output)``, ``bind_local``,
  ``local_dir``, ``lookup_many_into``, ``remove_from_store(layer_id)``;
* a layer id ``int``: the single-layer float32 API, ``populate(buffers)``, ``lookup(row_ids)``,
  ``remove_from_store()``.

Both are a translation layer over :class:`engram_store.EngramStore`. Modules: ``_store`` (the store wrapper)
with ``_setup`` (its two ``setup`` overloads and the session they open), ``_replicate`` (``ReplicateConfig``,
``SoftPinAction`` and the checks of a write), ``_reads`` (per-key results over all-or-nothing reads),
``_buffers`` (addresses, registrations, ``BufferHandle``) and ``_codes`` (the return codes); ``_engram`` (the
config and the class that picks an API version), ``_engram_layers`` and ``_engram_single`` (one API version each),
``_errors`` (errors as Mooncake raises them). docs/mooncake-compat.md lists every method of Mooncake's store and
how each behaves here. Errors are raised with the builtin types
Mooncake's binding raises (``RuntimeError`` for what its C++ code reports, ``ValueError`` and ``TypeError`` for
arguments it refuses), as subclasses of the matching :class:`~engram_store.EngramError` class: a populate
over existing keys raises an exception that is both :class:`~engram_store.ObjectExists` and ``RuntimeError``.
"""

from .._config import StoreConfig
from ._buffers import BufferHandle
from ._codes import ErrorCode
from ._engram import EngramStore, EngramStoreConfig
from . import _engram_layers, _engram_single  # noqa: F401  each registers its API version
from ._replicate import ReplicateConfig, SoftPinAction
from ._store import MooncakeConfig, MooncakeDistributedStore

__all__ = [
    "BufferHandle",
    "EngramStore",
    "EngramStoreConfig",
    "ErrorCode",
    "MooncakeConfig",
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "StoreConfig",
]
