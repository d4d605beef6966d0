"""engram_store: a small distributed memory store for Engram tables, and EngramStore on top of it.

Public surface::

    DistributedStore      the client: connect(master), embedded(), from_env()
    SegmentServer         a memory segment server (also the ``engram-segment`` CLI)
    EngramStore           per-head tables of one or more layers: [B, L, H] -> [B, L, H, D] row lookup
    EngramStoreConfig     table sizes, embedding dimension and row format of one layer
    lookup_many, prefetch_many   rows of several EngramStores at once (one request per segment server)
    metrics_text, serve_metrics  a serving process's Prometheus text: lookups, rows, cache hits, SSD reads
    StoreConfig           store configuration from a JSON file, the environment, or keywords
    EngramError, ...      the exception tree (see ``engram_store.errors``)
"""

import importlib
from typing import TYPE_CHECKING

from ._config import StoreConfig
from . import errors
from .errors import *  # noqa: F403 (the exception tree: errors.__all__)
from .units import format_size, parse_size

if TYPE_CHECKING:
    from .client import DistributedStore, KeyInfo, ObjectInfo, Replica
    from .segment import SegmentServer
    from .tables import (EngramStore, EngramStoreConfig, LookupHandle, lookup_many, metrics_text, prefetch_many,
                         serve_metrics)

#: The names whose rooms are imported when first asked for, not with the package: every server process and
#: command line imports ``engram_store`` (its errors, its wire), and the client's and tables' rooms bring Numba,
#: which costs a master or a ``status`` command half its start-up.
_LAZY = {
    **dict.fromkeys(["DistributedStore", "KeyInfo", "ObjectInfo", "Replica"], "client"),
    **dict.fromkeys(["EngramStore", "EngramStoreConfig", "LookupHandle", "lookup_many", "metrics_text",
                     "prefetch_many", "serve_metrics"], "tables"),
    "SegmentServer": "segment",
}


def __getattr__(name: str):
    room = _LAZY.get(name)
    if room is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{room}"), name)
    globals()[name] = value  # asked once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "DistributedStore",
    "EngramStore",
    "EngramStoreConfig",
    "KeyInfo",
    "LookupHandle",
    "ObjectInfo",
    "Replica",
    "SegmentServer",
    "StoreConfig",
    "errors",
    "format_size",
    "lookup_many",
    "metrics_text",
    "parse_size",
    "prefetch_many",
    "serve_metrics",
    *(name for name in errors.__all__ if name not in ("describe", "is_int")),
]
