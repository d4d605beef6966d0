"""Request counters and latency histograms per operation, in the Prometheus text format.

A server's serving thread records into :class:`RequestMetrics`; :class:`MetricsEndpoint` exposes text over HTTP
on ``/metrics`` from one daemon thread for every connection (with caps and deadlines: ``_http``): a snapshot the
serving thread rebuilds (``publish``: the master's, so the HTTP thread never reads state that is being changed), or
text rendered at each request by a ``render`` callable (a serving process's EngramStores, whose counters are read
under their own locks).
"""

from __future__ import annotations

import bisect
import threading
from typing import Callable

from ._http import PageServer


#: Upper bounds (seconds) of the latency histogram buckets.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _OpStats:
    __slots__ = ("count", "errors", "total_s", "buckets")

    def __init__(self) -> None:
        self.count = 0
        self.errors = 0
        self.total_s = 0.0
        self.buckets = [0] * (len(BUCKETS) + 1)  # the last one is +Inf


def _copy(stats: _OpStats) -> _OpStats:
    out = _OpStats()
    out.count, out.errors, out.total_s, out.buckets = stats.count, stats.errors, stats.total_s, list(stats.buckets)
    return out


class RequestMetrics:
    """Per-operation request counts, error counts and latency histograms of one server."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._ops: dict[str, _OpStats] = {}
        self._lock = threading.Lock()  # several threads serve requests (raw read connections)

    def record(self, op: str, seconds: float, ok: bool) -> None:
        with self._lock:
            stats = self._ops.get(op)
            if stats is None:
                if len(self._ops) >= 64:  # ops come from clients: never let them grow the table without bound
                    op = "other"
                stats = self._ops.setdefault(op, _OpStats())
            stats.count += 1
            stats.errors += not ok
            stats.total_s += seconds
            stats.buckets[bisect.bisect_left(BUCKETS, seconds)] += 1

    def render(self) -> list[str]:
        p = self.prefix
        lines = [f"# HELP {p}_requests_total Requests served, by operation.",
                 f"# TYPE {p}_requests_total counter"]
        with self._lock:
            ops = sorted((op, _copy(stats)) for op, stats in self._ops.items())
        lines += [f'{p}_requests_total{{op="{op}"}} {s.count}' for op, s in ops]
        lines += [f"# HELP {p}_request_errors_total Requests answered with an error, by operation.",
                  f"# TYPE {p}_request_errors_total counter"]
        lines += [f'{p}_request_errors_total{{op="{op}"}} {s.errors}' for op, s in ops]
        lines += [f"# HELP {p}_request_seconds Time to serve a request, by operation.",
                  f"# TYPE {p}_request_seconds histogram"]
        for op, s in ops:
            cumulative = 0
            for bound, n in zip(BUCKETS + (float("inf"),), s.buckets):
                cumulative += n
                le = "+Inf" if bound == float("inf") else repr(bound)
                lines.append(f'{p}_request_seconds_bucket{{op="{op}",le="{le}"}} {cumulative}')
            lines.append(f'{p}_request_seconds_sum{{op="{op}"}} {s.total_s:.9f}')
            lines.append(f'{p}_request_seconds_count{{op="{op}"}} {s.count}')
        return lines


def gauge(name: str, help_text: str, samples: list[tuple[str, float]], kind: str = "gauge") -> list[str]:
    """Lines of one gauge (or ``kind="counter"``): ``samples`` are ``(labels, value)`` with labels like
    ``'segment="a"'`` or ``''``."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{{{labels}}} {value}" if labels else f"{name} {value}" for labels, value in samples]
    return lines


def labels(**values: object) -> str:
    """``key="value",...`` with the values escaped as the text format wants (backslash, quote, newline)."""
    esc = lambda v: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return ",".join(f'{k}="{esc(v)}"' for k, v in values.items())


class MetricsEndpoint:
    """``GET /metrics`` on ``host:port`` from a daemon thread, answering the last published text, or what
    ``render()`` returns at each request. A context manager; ``close()`` stops it.

    One thread serves every connection, with caps per peer and in all and deadlines on each (``_http.PageServer``):
    connections that send nothing cost neither threads nor, past a few dozen, descriptors."""

    def __init__(self, host: str, port: int, render: Callable[[], list[str]] | None = None):
        self._text = b"# no metrics published yet\n"
        self._render = render
        self._server = PageServer(host, port, "/metrics", self._body)
        self.port = self._server.port

    def _body(self) -> bytes:
        return ("\n".join(self._render()) + "\n").encode() if self._render is not None else self._text

    def publish(self, lines: list[str]) -> None:
        self._text = ("\n".join(lines) + "\n").encode()

    def close(self) -> None:
        self._server.close()

    def __enter__(self) -> "MetricsEndpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

__all__ = ["MetricsEndpoint", "gauge", "labels"]
