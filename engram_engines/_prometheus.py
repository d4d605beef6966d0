"""engram's metrics in a serving engine's own ``/metrics``: a ``prometheus_client`` custom collector.

The only module of engram that imports ``prometheus_client`` (both engines depend on it; the ``test`` extra
installs it). :class:`EngramCollector` renders, at each scrape:

* ``engram_gathers_total``, ``engram_gather_rows_total``, ``engram_gather_errors_total`` and the histogram
  ``engram_gather_seconds``, labelled ``layer``, ``form`` and ``tier`` (:mod:`._stats`), summed over the
  server's processes;
* each process's tables as :func:`engram_store.metrics_text` renders them (``engram_store_*``: lookups, rows,
  cache hits, the host cache, SSD reads), labelled with the process's ``pid``.

The process that serves ``/metrics`` (vLLM's API server, SGLang's HTTP server) is seldom the one that gathers (a
worker, a scheduler): workers publish their snapshots into the server's metrics directory
(``ENGRAM_METRICS_DIR``, made by the first process of the server and inherited by the others), and the collector
reads every live process's snapshot besides its own.
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from ._stats import BUCKETS_S, local_snapshot, metrics_dir, read_published

LABELS = ["layer", "form", "tier"]


class EngramCollector:
    """engram's metrics (see the module docstring); ``directory``: where the server's processes publish theirs
    (default ``ENGRAM_METRICS_DIR``)."""

    def __init__(self, directory: str | None = None):
        self.directory = directory

    def describe(self) -> list:
        return []  # registered without a scrape

    def collect(self) -> Iterable[Metric]:
        snapshots = [local_snapshot()]
        directory = self.directory or metrics_dir()
        if directory:
            own = snapshots[0]["pid"]
            snapshots += [s for s in read_published(directory) if s.get("pid") != own]
        yield from _gathers([series for s in snapshots for series in s.get("gathers", [])])
        yield from _tables(snapshots)


def _gathers(series: list[dict]) -> Iterable[Metric]:
    summed: dict[tuple[str, str, str], dict] = {}
    for s in series:
        key = (str(s["layer"]), s["form"], s["tier"])
        into = summed.setdefault(key, {"calls": 0, "rows": 0, "errors": 0, "seconds": 0.0,
                                       "buckets": [0] * (len(BUCKETS_S) + 1)})
        for field in ("calls", "rows", "errors", "seconds"):
            into[field] += s[field]
        into["buckets"] = [a + b for a, b in zip(into["buckets"], s["buckets"])]
    calls = CounterMetricFamily("engram_gathers", "Row gathers for the engine's Engram layers (calls).", labels=LABELS)
    rows = CounterMetricFamily("engram_gather_rows", "Rows gathered (tokens x columns, or flat ids).", labels=LABELS)
    errors = CounterMetricFamily("engram_gather_errors", "Gathers that raised.", labels=LABELS)
    seconds = HistogramMetricFamily("engram_gather_seconds", "Host time of a gather (for form=device: launching "
                                    "the kernel that reads the table in place).", labels=LABELS)
    for key, s in sorted(summed.items()):
        labels = list(key)
        calls.add_metric(labels, s["calls"])
        rows.add_metric(labels, s["rows"])
        errors.add_metric(labels, s["errors"])
        cumulative, buckets = 0, []
        for bound, n in zip(BUCKETS_S + (float("inf"),), s["buckets"]):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        seconds.add_metric(labels, buckets, s["seconds"])
    return [calls, rows, errors, seconds]


def _tables(snapshots: list[dict]) -> Iterable[Metric]:
    """Each process's table text, parsed, with a ``pid`` label; one family per name over the processes."""
    families: dict[str, Metric] = {}
    for snapshot in snapshots:
        text = snapshot.get("tables") or ""
        if not text.strip():
            continue
        pid = str(snapshot.get("pid", ""))
        for family in text_string_to_metric_families(text):
            into = families.get(family.name)
            if into is None:
                into = families[family.name] = Metric(family.name, family.documentation, family.type)
            into.samples += [Sample(s.name, {**s.labels, "pid": pid}, s.value, s.timestamp, s.exemplar)
                             for s in family.samples]
    return list(families.values())


_REGISTERED: set[int] = set()


def register(registry=None) -> EngramCollector | None:
    """Register an :class:`EngramCollector` with ``registry`` (default: ``prometheus_client.REGISTRY``), once per
    registry; returns it (None when this registry has one already)."""
    from prometheus_client import REGISTRY

    registry = REGISTRY if registry is None else registry
    if id(registry) in _REGISTERED:
        return None
    collector = EngramCollector()
    registry.register(collector)
    _REGISTERED.add(id(registry))
    return collector


def mount_sglang(app) -> None:
    """SGLang's ``/metrics`` as SGLang mounts it (``add_prometheus_middleware``: prometheus_client's multiprocess
    collector over ``PROMETHEUS_MULTIPROC_DIR``), with engram's collector registered beside it."""
    import re

    from prometheus_client import CollectorRegistry, make_asgi_app, multiprocess
    from starlette.routing import Mount

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    register(registry)
    route = Mount("/metrics", make_asgi_app(registry=registry))
    route.path_regex = re.compile("^/metrics(?P<path>.*)$")  # as SGLang's: no redirect from /metrics
    app.routes.append(route)
