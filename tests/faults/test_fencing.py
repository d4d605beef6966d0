"""Trust under faults: stale writers are fenced, dead writers let go, and objects still held are never lost.

Each test runs real ``engram-master`` and ``engram-segment`` processes and, where a writer must stall or die
mid-put, a writer process (``writer_worker.py``) that stops after its first chunk until the test lets it go on.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from engram_store import (
    DistributedStore,
    EngramStore,
    EngramStoreConfig,
    LeaseActive,
    ObjectExists,
    ObjectLost,
    ObjectNotFound,
)
from engram_store.testing import Cluster, wait_ping
from suite_helpers import segment_memory

pytestmark = pytest.mark.timeout(180)

WRITER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_worker.py")
HEADS = 4
ROW_BYTES = 1024
ROWS = 2048  # 2 MiB per head
CONFIG = EngramStoreConfig(table_vocab_sizes=[ROWS] * HEADS, embedding_dim=ROW_BYTES, row_format="bytes")
PUT_TIMEOUT = ["--put-timeout", "2"]


def _tables(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8) for _ in range(HEADS)]


def _ids(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, ROWS, (3, 17, HEADS))


def _expected(tables, ids):
    return np.stack([tables[h][ids[..., h]] for h in range(HEADS)], axis=-2)


def _all_back(status: dict) -> bool:
    return status["objects"] == HEADS + 1 and status["under_replicated"] == 0 and status["lost"] == 0


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class _Writer:
    """``writer_worker.py`` in a process of its own, paused after its first chunk until :meth:`go`."""

    def __init__(self, master: str, path: str, prefix: str, seed: int):
        self.proc = subprocess.Popen(
            [sys.executable, WRITER, master, path, prefix, str(HEADS), str(ROWS * ROW_BYTES), str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.out = b""

    def wait_for(self, word: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while word.encode() not in self.out:
            remaining = deadline - time.monotonic()
            assert remaining > 0 and self.proc.poll() is None or select.select([self.proc.stdout], [], [], 0)[0], \
                f"writer did not print {word}:\n{self.out.decode(errors='replace')}"
            if select.select([self.proc.stdout], [], [], max(0.0, min(remaining, 0.5)))[0]:
                self.out += os.read(self.proc.stdout.fileno(), 65536)

    def go(self) -> str:
        """Let it write the rest; returns everything it printed."""
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)
        self.out += self.proc.stdout.read()
        return self.out.decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


@pytest.mark.parametrize("path", ["direct", "requests"])
@pytest.mark.parametrize("cause", ["master restart", "put expired"])
def test_a_stale_writer_never_lands_in_another_writers_layer(tmp_path, path, cause):
    journal = str(tmp_path / "master.journal")
    tables, ids = _tables(51), _ids(1)
    # Room for two layers: after the writer's puts are forgotten (restart) or fenced (expiry), the second layer
    # is placed where the stale writer's space was, unless that writer still writes straight into the file.
    with Cluster(segments=1, segment_size="20MiB", heartbeat_timeout_s=2.0, journal=journal, extra=PUT_TIMEOUT) as c:
        writer = _Writer(c.address, path, "engram:l50:h", seed=50)
        try:
            writer.wait_for("PAUSED")
            if cause == "master restart":
                c.master.kill()
                c.restart_master(journal=journal, heartbeat_timeout_s=2.0, extra=PUT_TIMEOUT)
            with DistributedStore.connect(c.address, timeout_ms=10_000, local_direct=path == "direct") as store:
                if cause == "put expired":
                    _wait_for(lambda: store.status()["pending"] == 0, 30, "the stalled writer's puts to expire")
                layer = EngramStore(51, CONFIG, store)
                layer.populate(tables)
                out = writer.go()
                assert "FAILED WriteFenced" in out, out
                assert layer.verify() == list(range(HEADS))
                np.testing.assert_array_equal(layer.lookup(ids), _expected(tables, ids))
                assert store.batch_is_exist([f"engram:l50:h{h}" for h in range(HEADS)]) == [False] * HEADS
                # Once the stale writer is gone, its space is free again: a third layer fits.
                _wait_for(lambda: store.status()["fencing_bytes"] == 0, 30, "the fenced space to be released")
                third = EngramStore(52, CONFIG, store)
                third.populate(_tables(52))
                np.testing.assert_array_equal(layer.lookup(ids), _expected(tables, ids))
        finally:
            writer.close()


def test_a_writer_killed_mid_put_lets_go_of_its_keys():
    with Cluster(segments=1, segment_size="40MiB", heartbeat_timeout_s=2.0, extra=PUT_TIMEOUT) as c:
        with DistributedStore.connect(c.address, timeout_ms=10_000) as store:
            for layer_id, release in ((60, "force"), (61, "put timeout")):
                writer = _Writer(c.address, "direct", f"engram:l{layer_id}:h", seed=layer_id)
                try:
                    writer.wait_for("PAUSED")
                finally:
                    writer.close()  # SIGKILL mid-put
                layer = EngramStore(layer_id, CONFIG, store)
                tables = _tables(layer_id)
                with pytest.raises(ObjectExists, match="in progress.*force=True"):
                    layer.populate(tables)
                with pytest.raises(LeaseActive, match="write is in progress"):
                    store.remove(f"engram:l{layer_id}:h0")
                if release == "force":
                    assert layer.remove_from_store(force=True) == HEADS  # at once
                else:
                    _wait_for(lambda: store.status()["pending"] == 0, 15, "the dead writer's puts to expire")
                layer.populate(tables)
                assert layer.verify() == list(range(HEADS))
            _wait_for(lambda: store.status()["fencing_bytes"] == 0, 30, "the dead writers' space to be released")


def _catalogue_synced(c: Cluster, store: DistributedStore) -> bool:
    """Whether every segment holds the catalogue version the master has for it."""
    versions = {s["segment_id"]: s["catalog"] for s in store.status()["segments"]}
    return all(wait_ping(s.address, timeout_s=5)["catalog"] == versions.get(s.segment_id) for s in c.segments)


def test_a_segment_declared_dead_comes_back_with_the_objects_it_can_prove_intact():
    tables, ids = _tables(7), _ids(2)
    with Cluster(segments=1, segment_size="32MiB", heartbeat_timeout_s=1.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            layer = EngramStore(7, CONFIG, store)
            layer.populate(tables)
            store.put("plain", b"p" * 5000)
            store.put("tampered", b"t" * 5000)
            _wait_for(lambda: _catalogue_synced(c, store), 20, "the segment's catalogue")
            (victim,) = store.locate(["tampered"])[0].replicas
            c.segments[0].signal(signal.SIGSTOP)
            _wait_for(lambda: not store.status()["segments"], 20, "the master to drop the paused segment")
            with pytest.raises(ObjectLost, match="missed heartbeats"):
                store.get("plain")
            status = subprocess.run([sys.executable, "-m", "engram_store.master", "status", "--master", c.address],
                                    capture_output=True, text=True, timeout=60)
            assert f"{HEADS + 3} object(s) lost" in status.stdout, status.stdout
            fd = os.open(segment_memory(c.segments[0].pid), os.O_WRONLY)  # one object's bytes change meanwhile
            try:
                os.pwrite(fd, b"X" * 10, victim.offset + 100)
            finally:
                os.close(fd)
            c.segments[0].signal(signal.SIGCONT)
            _wait_for(lambda: store.is_exist("plain"), 20, "the segment to register again")
            assert store.get("plain") == b"p" * 5000
            np.testing.assert_array_equal(layer.lookup(ids), _expected(tables, ids))
            assert layer.verify() == list(range(HEADS))
            with pytest.raises(ObjectLost):  # its checksum no longer matches: not taken back
                store.get("tampered")
            status = subprocess.run([sys.executable, "-m", "engram_store.master", "status", "--master", c.address],
                                    capture_output=True, text=True, timeout=60)
            assert "1 object(s) lost" in status.stdout and "tampered" in status.stdout, status.stdout


def test_a_master_restarted_without_its_journal_gets_every_layer_back():
    tables, ids = _tables(8), _ids(3)
    # a heartbeat timeout a loaded machine does not trip: a segment dropped meanwhile would leave its replicas
    # missing until it registers again
    with Cluster(segments=2, segment_size="32MiB", heartbeat_timeout_s=3.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            layer = EngramStore(8, CONFIG, store)
            layer.populate(tables, replica_num=2)
            _wait_for(lambda: _catalogue_synced(c, store), 20, "the segments' catalogues")
        c.master.kill()
        c.restart_master(heartbeat_timeout_s=3.0)  # no journal: it knows nothing
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            # every object back, with both its replicas (each segment offers its own copies when it registers)
            _wait_for(lambda: _all_back(store.status()), 30, "both segments to offer their objects")
            layer = EngramStore(8, CONFIG, store)
            np.testing.assert_array_equal(layer.lookup(ids), _expected(tables, ids))
            assert layer.verify() == list(range(HEADS))
            status = store.status()
            assert status["under_replicated"] == 0 and status["lost"] == 0
            with pytest.raises(ObjectNotFound):
                store.get("never-written")
