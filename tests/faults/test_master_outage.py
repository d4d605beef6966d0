"""Reads outlive the master, and failures say what happened within one timeout."""
from __future__ import annotations

import logging
import signal
import time

import numpy as np
import pytest

from engram_store import DistributedStore, EngramStore, SegmentUnavailable
from engram_store.tables import _placement
from engram_store.testing import Cluster
from faults_helpers import CONFIG, expected_rows, layer_ids, layer_tables

pytestmark = pytest.mark.timeout(180)



def _tables(seed: int) -> list[np.ndarray]:
    return layer_tables(seed)


def _ids(seed: int) -> np.ndarray:
    return layer_ids(seed, (4, 32))


@pytest.mark.parametrize("local_direct", [True, False], ids=["local-direct", "remote"])
def test_published_layers_stay_readable_while_the_master_is_paused_and_gone(tmp_path, local_direct, caplog,
                                                                            monkeypatch):
    # Placements read only through segments are checked every 10 s: checked as often as mapped ones here, so that
    # checks fall due while the master is away on both paths.
    monkeypatch.setattr(_placement, "REMOTE_PLACEMENT_TTL_S", _placement.PLACEMENT_TTL_S)
    monkeypatch.setattr(_placement, "REMOTE_PLACEMENT_STALE_S", _placement.PLACEMENT_STALE_S)
    journal = str(tmp_path / "master.journal")
    tables = _tables(1)
    with Cluster(segments=1, heartbeat_timeout_s=5.0, journal=journal) as c:
        with DistributedStore.connect(c.address, timeout_ms=1000, local_direct=local_direct) as store:
            layer = EngramStore(1, CONFIG, store)
            layer.populate(tables)
            ids = _ids(0)
            np.testing.assert_array_equal(layer.lookup(ids), expected_rows(tables, ids))
            caplog.set_level(logging.WARNING, logger="engram_store.tables._placement")
            c.master.signal(signal.SIGSTOP)
            slowest = 0.0
            for phase in ("paused", "gone"):
                deadline = time.monotonic() + 2.5  # several placement checks fall due meanwhile
                n = 0
                while time.monotonic() < deadline or n < 5:
                    ids = _ids(n)
                    start = time.monotonic()
                    got = layer.prefetch(ids).result() if n % 2 else layer.lookup(ids)
                    slowest = max(slowest, time.monotonic() - start)
                    np.testing.assert_array_equal(got, expected_rows(tables, ids))
                    n += 1
                if phase == "paused":
                    c.master.kill()
            # One lookup at most waits for a placement check (bounded by the store's timeout), none fails.
            assert slowest < 1.0 + 1.5
            assert "the master did not answer a placement check" in caplog.text
            c.restart_master(journal=journal, heartbeat_timeout_s=5.0)
            np.testing.assert_array_equal(layer.lookup(ids), expected_rows(tables, ids))
            other = EngramStore(2, CONFIG, store)
            other.populate(_tables(2))  # writes work again once the segment has registered anew
            np.testing.assert_array_equal(other.lookup(ids), expected_rows(_tables(2), ids))


def test_a_paused_segment_fails_a_lookup_within_one_timeout_and_names_the_segment():
    tables = _tables(3)
    with Cluster(segments=1, heartbeat_timeout_s=30.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=10_000, local_direct=False) as store:
            layer = EngramStore(3, CONFIG, store)
            layer.populate(tables)
            ids = _ids(3)
            np.testing.assert_array_equal(layer.lookup(ids), expected_rows(tables, ids))
            store.timeout_ms = 1000
            c.segments[0].signal(signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(SegmentUnavailable, match=f"segment {c.segments[0].address} holding head"):
                layer.lookup(ids)
            assert time.monotonic() - start < 1.9  # one timeout, not one for the tables and one for the manifest
            store.timeout_ms = 10_000
            c.segments[0].signal(signal.SIGCONT)
            np.testing.assert_array_equal(layer.lookup(ids), expected_rows(tables, ids))


def test_rows_read_again_after_a_failover_are_counted_once():
    tables = _tables(4)
    with Cluster(segments=2, heartbeat_timeout_s=30.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            layer = EngramStore(4, CONFIG, store)
            layer.populate(tables, replica_num=2)
            ids = _ids(4)
            layer.lookup(ids)  # heads are read from both segments
            c.segments[0].kill()
            layer.stats(reset=True)
            np.testing.assert_array_equal(layer.lookup(ids), expected_rows(tables, ids))
            stats = layer.stats()
            assert stats["retries"] == 1 and stats["rows"] == ids.size
            assert stats["remote_rows"] == ids.size  # the attempt that delivered: every row from one segment
            assert stats["remote_requests"] == 1


_CLOSE_DURING_STALL = r"""
import sys, time
import numpy as np
from engram_store import DistributedStore, EngramStore, EngramStoreConfig
sizes = [1009, 1013, 1019, 1021]
store = DistributedStore.connect(sys.argv[1], timeout_ms=3000, local_direct=sys.argv[2] == "1")
layer = EngramStore(1, EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=16), store)
ids = np.zeros((1, 4, 4), dtype=np.int64)
layer.lookup(ids)
print("ready", flush=True)
sys.stdin.readline()  # the master is stopped now
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:  # placement checks fall due and block on the stopped master
    layer.lookup(ids)
    layer.prefetch(ids).result()
layer.close()
store.close()
print("closed", flush=True)
"""


@pytest.mark.parametrize("round_", range(4))
def test_a_client_that_closes_while_the_master_is_stopped_exits_cleanly(round_):
    """Closing a store while its placement checks wait on a stopped master neither aborts nor hangs."""
    import subprocess
    import sys

    with Cluster(segments=1, heartbeat_timeout_s=30.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000) as store:
            EngramStore(1, CONFIG, store).populate(_tables(1))
        client = subprocess.Popen([sys.executable, "-c", _CLOSE_DURING_STALL, c.address, str(round_ % 2),
                                   str(0.6 + 0.3 * round_)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            assert client.stdout.readline().strip() == "ready"
            c.master.signal(signal.SIGSTOP)
            client.stdin.write("go\n")
            client.stdin.flush()
            out, err = client.communicate(timeout=60)
        finally:
            if client.poll() is None:
                client.kill()
                client.wait()
            c.master.signal(signal.SIGCONT)
        assert client.returncode == 0, f"client exited with {client.returncode}:\n{err[-3000:]}"
        assert "closed" in out
