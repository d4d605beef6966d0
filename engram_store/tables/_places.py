"""The place an EngramStore's arguments name (a store, ``local_dir``, ``disk_dir`` or none), the row source built for it,
and what the facade asks of its source over its layers.

:func:`source_for` checks the place arguments (a store, ``local_dir``, ``disk_dir`` or none of them; the row cache,
its scope and the gather threads) and builds the :class:`~._source.Source` for them, importing only the module of
the kind asked for. :func:`sum_stats` adds the layers' counters up, head by head where they are per head,
:func:`warm_cache` pins a profile's rows in a ``disk_dir`` layer's cache, and :func:`release` closes the source. The
facade (``_store``) keeps to checking what its callers pass and handing the rest on.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from ..errors import InvalidArgument, InvalidType, describe, is_int
from ._layout import Layer, LookupCounters
from ._source import Source


def check_options(cache_scope: Any, disk_dir: Any, row_cache_bytes: Any, threads: Any) -> None:
    """The checks of an EngramStore's cache and thread arguments, before anything is built."""
    if cache_scope not in ("process", "host"):
        raise InvalidArgument(f"cache_scope: expected 'process' or 'host', got {describe(cache_scope)}")
    if cache_scope == "host" and (disk_dir is None or os.fspath(disk_dir) == ""):
        raise InvalidArgument("cache_scope: 'host' shares the row cache of disk_dir layers between the host's "
                              "processes; pass disk_dir= (or cache_scope='process')")
    if not is_int(row_cache_bytes) \
            or row_cache_bytes < 0:
        raise InvalidArgument(f"row_cache_bytes: expected a byte count >= 0, got {describe(row_cache_bytes)}")
    if not is_int(threads) or not 1 <= threads <= 256:
        raise InvalidArgument(f"threads: expected an integer in [1, 256], got {describe(threads)}")


def source_for(store: Any, local_dir: Any, disk_dir: Any, require_manifest: bool, row_cache_bytes: int,
               threads: int, layers: list[Layer], cache_scope: str = "process") -> Source:
    """The row source an EngramStore's arguments name (each kind of place for tables is one module)."""
    local_dir = local_dir if local_dir is not None and os.fspath(local_dir) != "" else None
    disk_dir = disk_dir if disk_dir is not None and os.fspath(disk_dir) != "" else None
    if store is not None and (local_dir is not None or disk_dir is not None):
        name = "local_dir" if local_dir is not None else "disk_dir"
        raise InvalidArgument(f"{name}: tables are either in a store or under {name}, not both; pass store=None to "
                              f"use {name}")
    if local_dir is not None and disk_dir is not None:
        raise InvalidArgument("disk_dir: tables are either under local_dir (in memory) or under disk_dir (on disk), "
                              "not both")
    if disk_dir is not None:
        from ._source_disk import DiskSource

        return DiskSource(disk_dir, row_cache_bytes, [lay.row_bytes for lay in layers], threads, cache_scope)
    if local_dir is not None:
        from ._source_memory import DirSource

        return DirSource(local_dir, threads)
    if store is None:
        from ._source_memory import ArraySource

        return ArraySource(threads)
    native = _native_store(store)
    if native is not None:
        from ._source_store import StoreSource

        return StoreSource(native, store, require_manifest, row_cache_bytes, threads)
    if all(callable(getattr(store, name, None)) for name in
           ("batch_put_from", "get_into_ranges", "batch_is_exist", "remove", "register_buffer")):
        from ._source_mooncake import MooncakeSource

        return MooncakeSource(store, require_manifest, threads)
    raise InvalidType(f"store: expected a DistributedStore, a MooncakeDistributedStore or None, "
                      f"got {type(store).__name__}")


def release(source: Source, layers: list[Layer]) -> None:
    """Close an EngramStore's source: reads and opens refused from now on (TableClosed, for tables on this host),
    every layer let go (a read still running keeps what it reads until it ends), then what the source holds beyond
    its layers (its directory, its caches)."""
    source.closing()
    for lay in layers:
        source.detach(lay)
    source.close()


def _native_store(store: Any):
    """The DistributedStore behind ``store`` (itself, or the one a compat wrapper holds), else None."""
    from ..client import DistributedStore

    if isinstance(store, DistributedStore):
        return store
    inner = getattr(store, "native_store", None)
    return inner if isinstance(inner, DistributedStore) else None


def sum_stats(source: Source, layers: list[Layer], reset: bool) -> dict[str, Any]:
    """The layers' lookup counters and their source's, summed (lists per head summed head by head); ``reset``
    zeroes them after reading."""
    total: dict[str, Any] = dict.fromkeys(LookupCounters.FIELDS, 0)
    for lay in layers:
        for counts in (lay.counters.snapshot(), source.stats(lay, reset)):
            for name, value in counts.items():
                if isinstance(value, list):  # per head: summed head by head
                    have = total.setdefault(name, [])
                    have.extend([0] * (len(value) - len(have)))
                    total[name] = [a + b for a, b in zip(have, value)] + have[len(value):]
                else:
                    total[name] = total.get(name, 0) + value
        if reset:
            lay.counters.reset()
    return source.finish_stats(total, layers, reset)


def warm_cache(source: Source, lay: Layer, profile: Any, max_rows: int | None) -> int:
    """Pin the most frequent rows of ``profile`` (a path or a loaded ``{layer_id: LayerProfile}``) in the row
    cache of ``lay``, a ``disk_dir`` layer; returns how many were pinned."""
    warm = getattr(source, "warm", None)
    if warm is None:
        raise InvalidArgument(f"warm_cache: only layers under disk_dir have a row cache to warm; this store's "
                              f"tables are in {source.where}")
    from ..disk import load_profile

    profiles = load_profile(profile) if isinstance(profile, (str, os.PathLike)) else profile
    if not isinstance(profiles, Mapping) or lay.layer_id not in profiles:
        raise InvalidArgument(f"profile: expected a profile of layer {lay.layer_id}, got "
                              f"{describe(sorted(profiles) if isinstance(profiles, Mapping) else profiles)}")
    return warm(lay, profiles[lay.layer_id], max_rows)
