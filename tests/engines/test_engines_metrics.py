"""engram's metrics in an engine's ``/metrics``: the ``prometheus_client`` collector, fed by this process's gathers
and tables and by the snapshots the server's other processes publish (``prometheus-client`` is in the ``test``
extra; both engines depend on it)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from engines_helpers import CONFIG, ROOT, hash_ids, load_tables, write_checkpoint

prometheus_client = pytest.importorskip("prometheus_client", reason="prometheus_client is not installed: pip "
                                                                    "install 'engram[test]'")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from engram_engines import STATS, settings_from_env  # noqa: E402
from engram_engines._prometheus import EngramCollector, register  # noqa: E402
from engram_engines._stats import METRICS_DIR, Publisher, local_snapshot  # noqa: E402
from engram_engines._tables import forget_table_dirs, tables_text  # noqa: E402
from engram_engines.v41 import LayerReader, open_layer  # noqa: E402


def _samples(registry) -> dict:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def reader(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "checkpoint")
    load_tables(checkpoint, CONFIG, local_dir=tmp_path / "local")
    settings = settings_from_env({"ENGRAM_TABLES": str(tmp_path / "local")})
    forget_table_dirs()  # this process's tables are this test's alone
    STATS.reset()
    yield LayerReader(settings, open_layer(settings, CONFIG, 1, "m"), CONFIG, 1)
    forget_table_dirs()
    STATS.reset()


def test_the_collector_counts_and_times_gathers_and_renders_the_tables(reader, monkeypatch):
    monkeypatch.delenv(METRICS_DIR, raising=False)
    registry = CollectorRegistry()
    assert register(registry) is not None and register(registry) is None  # once per registry
    for T in (3, 5):
        reader.gather(hash_ids(CONFIG, T, seed=T)[:, 0], np.empty((T, CONFIG.cols, CONFIG.row_bytes), np.uint8))
    got = _samples(registry)
    key = (("form", "packed"), ("layer", "1"), ("tier", "local_dir"))
    assert got[("engram_gathers_total", key)] == 2
    assert got[("engram_gather_rows_total", key)] == 8 * CONFIG.cols
    assert got[("engram_gather_seconds_count", key)] == 2
    assert got[("engram_gather_seconds_bucket", tuple(sorted(key + (("le", "+Inf"),))))] == 2
    assert got[("engram_gather_seconds_sum", key)] > 0
    pid = (("layer", "1"), ("pid", str(os.getpid())))
    assert ("engram_store_lookups_total", pid) in got  # the table's own counters, as metrics_text renders them


def test_the_collector_adds_the_snapshots_the_servers_other_processes_publish(reader, tmp_path, monkeypatch):
    directory = tmp_path / "metrics"
    directory.mkdir()
    monkeypatch.setenv(METRICS_DIR, str(directory))
    reader.gather(hash_ids(CONFIG, 4, seed=1)[:, 0], np.empty((4, CONFIG.cols, CONFIG.row_bytes), np.uint8))
    worker = f"""
import numpy as np
from engram_engines._stats import STATS, Publisher
STATS.record(1, "packed", "local_dir", 96, 0.0002)
STATS.record(14, "bf16", "disk_dir", 48, 0.003)
Publisher({str(directory)!r}, lambda: "", interval_s=60).publish()
print("published", flush=True)
input()  # alive until the test has read it: a dead process's snapshot is not counted
"""
    proc = subprocess.Popen([sys.executable, "-c", worker], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline().strip() == "published"
        got = _samples_of(EngramCollector())
    finally:
        proc.communicate("\n", timeout=60)
    assert got[("engram_gathers_total", (("form", "packed"), ("layer", "1"), ("tier", "local_dir")))] == 2
    assert got[("engram_gathers_total", (("form", "bf16"), ("layer", "14"), ("tier", "disk_dir")))] == 1
    assert _samples_of(EngramCollector())[("engram_gathers_total", (("form", "packed"), ("layer", "1"),
                                                                  ("tier", "local_dir")))] == 1  # it exited


def _samples_of(collector) -> dict:
    registry = CollectorRegistry()
    registry.register(collector)
    return {k: v for k, v in _samples(registry).items() if k[0].startswith("engram_gathers")}


def test_a_publisher_writes_its_snapshot_atomically_and_removes_it_when_closed(reader, tmp_path):
    directory = tmp_path / "metrics"
    directory.mkdir()
    publisher = Publisher(str(directory), tables_text, interval_s=60)
    publisher.publish()
    import json

    record = json.loads((directory / f"{os.getpid()}.json").read_text())
    assert record["pid"] == os.getpid() and record == {**local_snapshot(), "tables": record["tables"]}
    assert "engram_store_lookups_total" in record["tables"]
    publisher.close()
    assert not list(directory.iterdir())
