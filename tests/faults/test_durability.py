"""Faults that must lose nothing: restarts, stalls, dead segments, re-replication."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from suite_helpers import manifest_objects, wait_for
from engram_store import DistributedStore, EngramStore, EngramStoreConfig, MasterUnavailable, SegmentUnavailable
from engram_store.testing import Cluster

pytestmark = pytest.mark.timeout(180)

SIZES = [1009, 1013, 1019, 1021]
DIM = 16


def _tables(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, DIM), dtype=np.float32) for n in SIZES]


def _ids(seed: int, batch: int = 4, length: int = 32) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.integers(0, n, size=(batch, length)) for n in SIZES], axis=-1)


def _expected(tables: list[np.ndarray], ids: np.ndarray) -> np.ndarray:
    return np.stack([tables[h][ids[..., h]] for h in range(len(tables))], axis=-2)



@pytest.mark.parametrize("master_keeps_journal", [True, False])
def test_whole_cluster_restart_with_file_backed_segments_keeps_tables(tmp_path, master_keeps_journal):
    journal = str(tmp_path / "master.journal") if master_keeps_journal else None
    files = [str(tmp_path / f"segment-{i}.bin") for i in range(2)]
    tables = _tables()
    ids = _ids(1)
    with Cluster(segments=0, journal=journal, heartbeat_timeout_s=2.0) as c:
        for f in files:
            c.add_segment("16MiB", ["--file", f])
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            layer = EngramStore(3, EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=DIM), store)
            layer.populate(tables)
            store.put("plain", b"p" * 10_000)
            # Each segment learns its catalogue on a heartbeat and records it next to its data: the tables,
            # the layer's layout manifest and "plain".
            wait_for(lambda: sum(manifest_objects(f) for f in files) == len(SIZES) + 2, 20, "manifests")
        segment_ids = [s.segment_id for s in c.segments]
        for proc in c.procs:  # the whole cluster dies at once
            proc.kill()
        c.restart_master(journal=journal, heartbeat_timeout_s=2.0)
        for f in files:
            c.add_segment("16MiB", ["--file", f])
        assert [s.segment_id for s in c.segments[2:]] == segment_ids  # the manifest keeps the identity
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            layer = EngramStore(3, EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=DIM), store)
            np.testing.assert_array_equal(layer.lookup(ids), _expected(tables, ids))
            assert store.get("plain") == b"p" * 10_000
            assert store.status()["objects"] == len(SIZES) + 2


def test_removed_objects_do_not_come_back_after_a_segment_restart(tmp_path):
    path = str(tmp_path / "segment.bin")
    with Cluster(segments=0, heartbeat_timeout_s=2.0) as c:
        seg = c.add_segment("8MiB", ["--file", path])
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            store.put("kept", b"k" * 1000)
            store.put("gone", b"g" * 1000)
            store.remove("gone", force=True)
            wait_for(lambda: manifest_objects(path) == 1, 20, "the manifest to drop the removed key")
            assert seg.terminate() == 0
            c.add_segment("8MiB", ["--file", path])
            wait_for(lambda: len(store.status()["segments"]) == 1 and store.is_exist("kept"), 20, "re-register")
            assert store.get("kept") == b"k" * 1000
            assert not store.is_exist("gone")


def test_master_sigkill_restart_clients_and_segments_reconnect(tmp_path):
    journal = str(tmp_path / "master.journal")
    tables = _tables(2)
    ids = _ids(3)
    with Cluster(segments=2, journal=journal, heartbeat_timeout_s=2.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            layer = EngramStore(0, EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=DIM), store)
            layer.populate(tables, replica_num=2)
            c.master.kill()
            c.restart_master(journal=journal, heartbeat_timeout_s=2.0)
            # The same client and the same EngramStore keep working, and a new layer can be written.
            np.testing.assert_array_equal(layer.lookup(ids), _expected(tables, ids))
            other = EngramStore(1, EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=DIM), store)
            other.populate(tables)
            np.testing.assert_array_equal(other.lookup(ids), _expected(tables, ids))
            # Segments kept heartbeating through the restart: none is dropped later on.
            time.sleep(2 * 2.0)
            assert len(store.status()["segments"]) == 2
            np.testing.assert_array_equal(layer.lookup(ids), _expected(tables, ids))


def test_master_stall_longer_than_heartbeat_timeout_drops_nothing():
    heartbeat_timeout = 1.0
    with Cluster(segments=2, heartbeat_timeout_s=heartbeat_timeout) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            for i in range(8):
                store.put(f"s{i}", bytes([i]) * 4096, replica_num=1 + i % 2)
            before = store.status()
            c.master.signal(signal.SIGSTOP)
            time.sleep(3.5 * heartbeat_timeout)
            c.master.signal(signal.SIGCONT)
            # Give the resumed master several liveness checks; nothing may be dropped.
            time.sleep(2 * heartbeat_timeout)
            after = store.status()
            assert len(after["segments"]) == 2
            assert after["objects"] == before["objects"] == 8
            for i in range(8):
                assert store.get(f"s{i}") == bytes([i]) * 4096
            assert "not counting that time" in c.master.output()


def test_lookup_survives_a_segment_killed_mid_stream_with_a_second_replica():
    tables = _tables(4)
    with Cluster(segments=2, heartbeat_timeout_s=30.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=1500, local_direct=False) as store:
            layer = EngramStore(2, EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=DIM), store)
            layer.populate(tables, replica_num=2)
            killer = threading.Timer(0.3, c.segments[0].kill)
            killer.start()
            try:
                deadline = time.monotonic() + 2.0
                i = 0
                while time.monotonic() < deadline or c.segments[0].alive():
                    ids = _ids(100 + i)
                    np.testing.assert_array_equal(layer.lookup(ids), _expected(tables, ids))
                    i += 1
            finally:
                killer.cancel()
            assert not c.segments[0].alive()


def test_master_re_replicates_objects_that_lost_a_replica():
    payload = os.urandom(3 << 20)
    with Cluster(segments=2, heartbeat_timeout_s=1.0, extra=["--re-replicate"]) as c:
        with DistributedStore.connect(c.address, timeout_ms=3000, local_direct=False) as store:
            store.put("precious", payload, replica_num=2)
            store.put("single", b"s" * 100)
            holders = {r.segment_id for r in store.locate(["precious"])[0].replicas}
            assert len(holders) == 2
            c.segments[0].kill()
            wait_for(lambda: len(store.status()["segments"]) == 1, 10, "the dead segment to be dropped")
            # No segment to copy to yet: the master reports the object as below its replica count.
            wait_for(lambda: "no segment to copy them to" in c.master.output(), 10, "the unrepairable report")
            assert store.status()["under_replicated"] == 1
            spare = c.add_segment("64MiB")
            wait_for(lambda: len(store.locate(["precious"])[0].replicas) == 2, 20, "the copy")
            assert spare.segment_id in {r.segment_id for r in store.locate(["precious"])[0].replicas}
            assert store.status()["under_replicated"] == 0
            c.segments[1].kill()  # the original survivor goes too: the copy alone must hold the bytes
            wait_for(lambda: len(store.status()["segments"]) == 1, 10, "the second drop")
            assert store.get("precious") == payload


def test_calls_against_dead_servers_leak_no_threads_or_sockets():
    """Timeouts against a hung segment and a dead master leave nothing running once the client is closed."""
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    tables = _tables(5)
    with Cluster(segments=1, heartbeat_timeout_s=30.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000) as warm:  # load everything once
            warm.put("warm", b"w")
        threads, fds = threading.active_count(), open_fds()
        # A generous timeout while the segment is healthy (a loaded machine can take a while to answer the
        # first read), a short one once it hangs: the change reaches the read connection already open.
        store = DistributedStore.connect(c.address, timeout_ms=10_000, local_direct=False)
        layer = EngramStore(9, EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=DIM), store)
        layer.populate(tables)
        layer.prefetch(_ids(6)).result()
        store.timeout_ms = 400
        c.segments[0].signal(signal.SIGSTOP)
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(SegmentUnavailable):
                layer.lookup(_ids(7))
            with pytest.raises(SegmentUnavailable):
                layer.prefetch(_ids(8)).result()
            assert time.monotonic() - start < 8, "the shortened timeout did not reach the open connection"
        c.master.kill()
        with pytest.raises(MasterUnavailable):
            store.status()
        layer.close()
        store.close()
        c.segments[0].signal(signal.SIGCONT)
        wait_for(lambda: threading.active_count() <= threads, 10, "client threads to end")
        # libzmq closes a socket's connections and mailbox (eventfd) in its own I/O thread after zmq_close
        # returns: wait for that as for the threads, then hold the same bound.
        wait_for(lambda: open_fds() <= fds + 2, 10, "closed sockets to be released")
        assert open_fds() <= fds + 2, "sockets or files left open"  # allow the ZeroMQ context's own
