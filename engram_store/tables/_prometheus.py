"""Prometheus text for a serving process: what its EngramStores looked up, where the rows came from, how long the
SSD tier's reads took, the row caches, and the hit rate every cache size would have had.

The master serves its own metrics (``engram-master --metrics-port``); a serving process, where lookups happen,
exposes these with :func:`serve_metrics` (a port of its own) or renders them with :func:`metrics_text` into an
endpoint it already has. Every value is read from ``EngramStore.stats()`` (never reset here) and, for a
``disk_dir`` store, from its row caches; each metric is listed with its meaning in docs/operating.md.

Latency is measured only once metrics are asked for: the first :func:`metrics_text` or :func:`serve_metrics`
of a store starts timing its SSD reads (two clock reads a read, which a process nobody watches does not pay).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ..errors import InvalidArgument, InvalidType, describe
from ..metrics import MetricsEndpoint, RequestMetrics, gauge, labels
from ..disk import SIZE_LADDER
from ._layout import LookupCounters
from ._store import EngramStore

PREFIX = "engram_store"
#: Per layer: what each of ``stats()``'s counters counts (LookupCounters' fields).
LAYER_COUNTERS = {
    "lookups": "Lookups of the layer's rows (calls).",
    "rows": "Rows looked up (B x L x H).",
    "local_rows": "Rows gathered straight from this host's memory.",
    "remote_rows": "Rows fetched over the network.",
    "remote_requests": "Range reads sent to segments.",
    "remote_bytes": "Bytes received from segments.",
    "retries": "Failover rounds after a segment failed.",
    "placement_refreshes": "Times the layer's placement was resolved from the master.",
    "cache_hits": "Rows served from the hot-row cache.",
    "cache_misses": "Rows the hot-row cache did not hold.",
    "pages_read": "Pages read from the layer's files on SSD (disk_dir).",
    "bytes_read": "Bytes read from the layer's files on SSD (disk_dir).",
}
assert set(LAYER_COUNTERS) == set(LookupCounters.FIELDS), "every counter of stats() has its metric"
#: The host cache's own counters (every process of the host together), from ``stats()['host_cache_<name>']``.
HOST_COUNTERS = {
    "hits": "Rows served from the host's shared row cache, by every process.",
    "misses": "Rows the host's shared row cache did not hold.",
    "fills": "Fills of the host cache (one a lookup that missed).",
    "inserted": "Rows inserted into the host cache.",
    "fills_skipped": "Fills skipped: another process held the cache's lock for longer than fill_wait_ms.",
    "repairs": "Sets a process that died mid-fill left half-written, emptied by the next.",
    "attaches": "Processes that attached to the host cache since it was created.",
}
HOST_GAUGES = {"capacity_rows": "Rows the host cache can hold.", "held_rows": "Rows the host cache holds now.",
               "pinned_rows": "Rows pinned by a warm start.", "bytes": "Bytes of the host cache's shared file."}

HeadLabels = Callable[[int, int], Mapping[str, Any]]


def metrics_text(stores: EngramStore | Sequence[EngramStore], head_labels: HeadLabels | None = None) -> str:
    """The Prometheus text of ``stores`` (one EngramStore or several: a ``store`` label tells them apart).

    ``head_labels(layer_id, head)`` adds labels to the per-head series (``engram_model.v41.order_labels``
    gives a V4.1 layer's columns their n-gram ``order``)."""
    return "\n".join(_lines(_checked(stores), head_labels)) + "\n"


def serve_metrics(stores: EngramStore | Sequence[EngramStore], port: int = 0, host: str = "127.0.0.1",
                  head_labels: HeadLabels | None = None) -> MetricsEndpoint:
    """Serve :func:`metrics_text` on ``http://host:port/metrics`` (``port=0``: any free port, in ``.port``) from a
    daemon thread, rendered at each request; ``close()`` the returned endpoint (or use it as a context manager)
    to stop it."""
    checked = _checked(stores)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgument(f"port: expected a port number in [0, 65535], got {describe(port)}")
    _lines(checked, head_labels)  # starts the timing now, and fails here on bad labels rather than at a scrape
    try:
        return MetricsEndpoint(host, port, render=lambda: _lines(checked, head_labels))
    except OSError as exc:
        raise InvalidArgument(f"port: cannot serve metrics on {host}:{port}: {exc.strerror}") from None


def _checked(stores: Any) -> list[EngramStore]:
    out = [stores] if isinstance(stores, EngramStore) else list(stores) if isinstance(stores, (list, tuple)) else None
    if not out or not all(isinstance(s, EngramStore) for s in out):
        raise InvalidType(f"stores: expected an EngramStore or a non-empty list of them, got {describe(stores)}")
    return out


def _lines(stores: list[EngramStore], head_labels: HeadLabels | None) -> list[str]:
    series: dict[tuple[str, str, str], list[tuple[str, float]]] = {}  # (name, kind, help) -> samples

    def add(name: str, kind: str, help_text: str, label: str, value: float) -> None:
        series.setdefault((f"{PREFIX}_{name}", kind, help_text), []).append((label, value))

    host_seen: set[str] = set()
    latency: list[str] = []
    for i, store in enumerate(stores):
        who = {"store": i} if len(stores) > 1 else {}
        source = store._source
        if getattr(source, "read_metrics", False) is None:
            source.read_metrics = RequestMetrics(f"{PREFIX}_disk")  # from now on every read is timed
        for lid in store.get_layer_ids():
            _layer(add, store.stats(layer=lid), {**who, "layer": lid}, store.get_heads(lid), head_labels, lid)
        for cache in getattr(source, "caches", {}).values():
            _cache(add, cache, {**who, "row_bytes": cache.row_bytes}, host_seen)
        if getattr(source, "read_metrics", None) is not None:
            latency += [line.replace('op="read"', labels(op="read", **who)) for line in source.read_metrics.render()]
    lines = []
    for (name, kind, help_text), samples in series.items():
        lines += gauge(name, help_text, samples, kind)
    return lines + _grouped(latency)


def _grouped(lines: list[str]) -> list[str]:
    """Several stores' renderings of the same families as one family each (one HELP and TYPE, then every
    sample): the text format allows a family once."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for line in lines:
        if line.startswith(("# HELP ", "# TYPE ")):
            head, _ = families.setdefault(line.split()[2], ([], []))
            if not any(h.startswith(line[:7]) for h in head):
                head.append(line)
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for suffix in ("_bucket", "_sum", "_count"):
            if name not in families and name.endswith(suffix):
                name = name[:-len(suffix)]
        families.setdefault(name, ([], []))[1].append(line)
    return [line for head, samples in families.values() for line in head + samples]


def _layer(add, stats: dict, where: dict, heads: list[int], head_labels: HeadLabels | None, lid: int) -> None:
    for field, help_text in LAYER_COUNTERS.items():
        add(f"{field}_total", "counter", help_text, labels(**where), stats.get(field, 0))
    for name, key in (("cache_hits_by_head_total", "cache_hits_per_head"),
                      ("cache_misses_by_head_total", "cache_misses_per_head")):
        for i, value in enumerate(stats.get(key, [])):
            extra = dict(head_labels(lid, heads[i])) if head_labels is not None else {}
            add(name, "counter", f"{LAYER_COUNTERS[key[:-9]]} By head (a V4.1 layer's column).",
                labels(**where, head=heads[i], **extra), value)
    for prefix, who in (("", "this process's"), ("host_cache_", "the host's")):
        for share, entry in zip(SIZE_LADDER, stats.get(f"{prefix}hit_rate_by_size", [])):
            add(f"{prefix}predicted_hit_rate", "gauge", f"The hit rate {who} lookups of the layer would have had "
                "with a row cache of row_cache_bytes=bytes, share of the rows it serves (an LRU; sampled, SHARDS).",
                labels(**where, share=share, bytes=entry["bytes"]), entry["hit_rate"])


def _cache(add, cache: Any, where: dict, host_seen: set[str]) -> None:
    stats = cache.stats()
    path = getattr(cache, "path", None)
    if path is None:
        for name in ("capacity_rows", "held_rows", "pinned_rows"):
            add(f"row_cache_{name}", "gauge", f"This process's row cache: {name.replace('_', ' ')}.",
                labels(**where), stats[name])
        return
    if path in host_seen:  # two stores of one disk_dir share the host's cache: count it once
        return
    host_seen.add(path)
    for name, help_text in HOST_COUNTERS.items():
        add(f"host_cache_{name}_total", "counter", help_text, labels(**where), stats[name])
    for name, help_text in HOST_GAUGES.items():
        add(f"host_cache_{name}", "gauge", help_text, labels(**where), stats[name])
