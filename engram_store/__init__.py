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

from .client import DistributedStore, KeyInfo, ObjectInfo, Replica
from ._config import StoreConfig
from .tables import (EngramStore, EngramStoreConfig, LookupHandle, lookup_many, metrics_text, prefetch_many,
                     serve_metrics)
from . import errors
from .errors import *  # noqa: F403 (the exception tree: errors.__all__)
from .segment import SegmentServer
from .units import format_size, parse_size

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
