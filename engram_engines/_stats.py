"""Counts and latency of the rows a serving process gathers, per Engram layer, form and tier.

Every gather an engine's Engram module makes through engram is recorded here: how many calls, how many rows, how
long the host spent (a histogram). ``form`` is the buffer's (``bf16``, ``packed``, ``split``; ``device`` where a GPU
reads the table in place and the host only launches the kernel), ``tier`` where the rows were
(``local_dir``, ``disk_dir``). Recording takes a lock and a few additions; reading takes a snapshot.

A process without an engine's endpoint of its own (a vLLM worker, an SGLang scheduler) writes its snapshot, with
the Prometheus text of its tables (:func:`engram_store.metrics_text`), into the server's metrics directory about
once a second (:class:`Publisher`); the collector in the process that serves ``/metrics`` reads every live
process's file (``engram_engines._prometheus``).
"""

from __future__ import annotations

import atexit
import bisect
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

#: Upper bounds (seconds) of the gather latency buckets: a decode step's gather is tens to hundreds of
#: microseconds from memory, milliseconds from SSD; a prefill's up to tens of milliseconds.
BUCKETS_S = (25e-6, 50e-6, 100e-6, 150e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0)
FORMS = ("bf16", "packed", "split", "device")


@dataclass
class Series:
    """One (layer, form, tier)'s gathers."""

    calls: int = 0
    rows: int = 0
    errors: int = 0
    seconds: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))  # the last is +Inf

    def as_dict(self) -> dict:
        return {"calls": self.calls, "rows": self.rows, "errors": self.errors, "seconds": self.seconds,
                "buckets": list(self.buckets)}


class GatherStats:
    """The process's gathers (one instance: :data:`STATS`)."""

    def __init__(self) -> None:
        self._series: dict[tuple[int, str, str], Series] = {}
        self._lock = threading.Lock()

    def record(self, layer: int, form: str, tier: str, rows: int, seconds: float, ok: bool = True) -> None:
        with self._lock:
            s = self._series.get((layer, form, tier))
            if s is None:
                s = self._series[(layer, form, tier)] = Series()
            s.calls += 1
            s.rows += rows
            s.errors += not ok
            s.seconds += seconds
            s.buckets[bisect.bisect_left(BUCKETS_S, seconds)] += 1

    def timed(self, layer: int, form: str, tier: str, rows: int, work: Callable[[], object]) -> object:
        """Run ``work()`` and record it (an error is recorded, then raised)."""
        start = time.perf_counter()
        ok = False
        try:
            result = work()
            ok = True
            return result
        finally:
            self.record(layer, form, tier, rows, time.perf_counter() - start, ok)

    def snapshot(self) -> list[dict]:
        """Every series: ``{"layer", "form", "tier", "calls", "rows", "errors", "seconds", "buckets"}``."""
        with self._lock:
            return [{"layer": k[0], "form": k[1], "tier": k[2], **s.as_dict()}
                    for k, s in sorted(self._series.items())]

    def reset(self) -> None:
        with self._lock:
            self._series.clear()


#: The process's gathers.
STATS = GatherStats()
#: Where a server's processes publish their snapshots (made by its first process; inherited by the others).
METRICS_DIR = "ENGRAM_METRICS_DIR"
#: What renders this process's tables as Prometheus text (set where tables are opened).
_tables_text: Callable[[], str] | None = None
_publisher: "Publisher | None" = None
_lock = threading.Lock()


def metrics_dir() -> str | None:
    return os.environ.get(METRICS_DIR) or None


def ensure_metrics_dir() -> str:
    """The server's metrics directory: ``ENGRAM_METRICS_DIR``, or a new private one (mode 0700, removed when this
    process exits) that this process's children inherit through the variable."""
    found = metrics_dir()
    if found is None:
        found = tempfile.mkdtemp(prefix="engram-metrics-")
        os.environ[METRICS_DIR] = found
        owner = os.getpid()
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(found, ignore_errors=True))
    return found


def local_snapshot(tables_text: Callable[[], str] | None = None) -> dict:
    """This process's snapshot: its gathers and its tables' text (rendered by ``tables_text``, by default what
    :func:`publish_tables` was given)."""
    render = tables_text or _tables_text
    return {"pid": os.getpid(), "gathers": STATS.snapshot(), "tables": render() if render else ""}


def publish_tables(tables_text: Callable[[], str]) -> None:
    """Say how to render this process's tables, and publish them with its gathers into the metrics directory (if
    the server has one) from now on."""
    global _tables_text, _publisher
    with _lock:
        _tables_text = tables_text
        directory = metrics_dir()
        if directory is not None and _publisher is None and os.path.isdir(directory):
            _publisher = Publisher(directory, tables_text)


class Publisher:
    """Writes this process's snapshot (gathers and its tables' text) to ``<directory>/<pid>.json`` every
    ``interval_s`` from a daemon thread, atomically (a rename), until :meth:`close` (which removes the file)."""

    def __init__(self, directory: str, tables_text: Callable[[], str], interval_s: float = 1.0):
        self.path = os.path.join(directory, f"{os.getpid()}.json")
        self.tables_text = tables_text
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engram-metrics-publisher", daemon=True)
        self._thread.start()

    def publish(self) -> None:
        record = local_snapshot(self.tables_text)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, self.path)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.publish()
            except Exception as exc:  # a full disk must not stop serving; say it once in a while
                log.warning("engram metrics: cannot write %s: %s", self.path, exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for path in (self.path, f"{self.path}.tmp"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def read_published(directory: str) -> list[dict]:
    """The snapshots under ``directory`` of processes still alive (a dead one's file is skipped)."""
    out = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if not name.endswith(".json") or not name[:-5].isdigit():
            continue
        pid = int(name[:-5])
        if pid != os.getpid() and not _alive(pid):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue  # being replaced, or gone
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
