"""The tables room: ``EngramStore``, the per-head tables of one or more Engram layers, read by row id.

``EngramStore`` (``_store``) is a facade that checks arguments; the work is done by small collaborators:

* ``_layout``: a layer's configuration, heads and keys; checks of row ids and output buffers;
* ``_manifest``: the layer manifest (layout and checksums) written last and read first;
* ``_plan``: read planning (rounds, output-order vs distinct rows, failover) and the background handle;
* ``_placement``: where a store layer's tables are, checked with the master;
* ``_source`` and one module per row source: in-process arrays and ``local_dir`` files (``_source_memory``), this
  project's store (``_source_store``), a Mooncake store (``_source_mooncake``), files on SSD (``_source_disk``);
* ``_sizing``: the hit rate at every cache size of a ``disk_dir`` store's layers (``stats()['hit_rate_by_size']``);
* ``_prometheus``: a serving process's metrics (``metrics_text``, ``serve_metrics``).
"""

from ._layout import ROW_FORMATS, EngramStoreConfig, LookupCounters
from ._plan import LookupHandle
from ._prometheus import metrics_text, serve_metrics
from ._store import EngramStore, lookup_many, prefetch_many

__all__ = [
    "ROW_FORMATS",
    "EngramStore",
    "EngramStoreConfig",
    "LookupCounters",
    "LookupHandle",
    "lookup_many",
    "metrics_text",
    "prefetch_many",
    "serve_metrics",
]
