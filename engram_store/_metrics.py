"""Request counters and latency histograms per operation, in the Prometheus text format.

A server's serving thread records into :class:`RequestMetrics`; :class:`MetricsEndpoint` exposes text over HTTP
on ``/metrics`` from a daemon thread: a snapshot the serving thread rebuilds (``publish``: the master's, so the
HTTP thread never reads state that is being changed), or text rendered at each request by a ``render`` callable
(a serving process's EngramStores, whose counters are read under their own locks).
"""

from __future__ import annotations

import bisect
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

log = logging.getLogger(__name__)

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
    ``render()`` returns at each request. A context manager; ``close()`` stops it."""

    def __init__(self, host: str, port: int, render: Callable[[], list[str]] | None = None):
        self._text = b"# no metrics published yet\n"
        self._render = render
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server naming)
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                try:
                    body = endpoint._body()
                except Exception as exc:  # noqa: BLE001 (a scrape must get an answer, and the server go on)
                    log.warning("metrics: rendering failed: %s", exc)
                    self.send_error(500, f"rendering the metrics failed: {exc}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args) -> None:
                log.debug("metrics %s: " + fmt, self.client_address[0], *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="engram-metrics", daemon=True)
        self._thread.start()

    def _body(self) -> bytes:
        return ("\n".join(self._render()) + "\n").encode() if self._render is not None else self._text

    def publish(self, lines: list[str]) -> None:
        self._text = ("\n".join(lines) + "\n").encode()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)

    def __enter__(self) -> "MetricsEndpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
