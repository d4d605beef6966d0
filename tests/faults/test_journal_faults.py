"""A journalled master and paused segments with real processes: nothing acknowledged is lost, one master owns a
journal."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from engram_store import DistributedStore, EngramError, EngramStore, EngramStoreConfig, OutOfSpace
from engram_store._shared_dirs import shared_base
from engram_store.testing import Cluster, free_port, start_master
from engram_store.wire import Connection

pytestmark = pytest.mark.timeout(180)

SIZES = [1009, 1013, 1019]
DIM = 16


def _tables(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, DIM), dtype=np.float32) for n in SIZES]


def _check(layer: EngramStore, tables: list[np.ndarray]) -> None:
    ids = np.stack([np.arange(32) * 31 % n for n in SIZES], axis=-1)[None]  # [1, 32, H]
    expected = np.stack([tables[h][ids[..., h]] for h in range(len(SIZES))], axis=-2)
    np.testing.assert_array_equal(layer.lookup(ids), expected)


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _config() -> EngramStoreConfig:
    return EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=DIM)


def test_a_journalled_restart_keeps_layers_written_into_the_space_of_removed_ones(tmp_path):
    journal = str(tmp_path / "master.journal")
    extra = ["--reuse-delay", "0.2"]
    with Cluster(segments=2, segment_size="8MiB", journal=journal, extra=extra) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            first = EngramStore(1, _config(), store)
            first.populate(_tables(1))
            first.remove_from_store()
            time.sleep(0.5)  # past the reuse delay: the next layers take the removed layer's space
            layers = {layer_id: EngramStore(layer_id, _config(), store) for layer_id in (2, 3)}
            for layer_id, layer in layers.items():
                layer.populate(_tables(layer_id))
            objects = store.status()["objects"]
        port = int(c.address.rsplit(":", 1)[1])
        assert c.master.terminate() == 0  # a routine stop: SIGTERM
        c.master = start_master(port=port, journal=journal, extra=extra)
        c.procs.append(c.master)
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            status = store.status()
            assert (status["objects"], status["lost"]) == (objects, 0)
            for layer_id in (2, 3):
                _check(EngramStore(layer_id, _config(), store), _tables(layer_id))
        assert "refused" not in c.master.output() and "not restored" not in c.master.output()


def test_a_second_master_refuses_a_journal_in_use_and_leaves_it_alone(tmp_path):
    journal = str(tmp_path / "master.journal")
    with Cluster(segments=1, segment_size="8MiB", journal=journal) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            store.put("before", b"b" * 1000)
        inode = os.stat(journal).st_ino
        for port in (free_port(), int(c.address.rsplit(":", 1)[1])):  # another port, and the same one
            second = subprocess.run([sys.executable, "-m", "engram_store.master", "--host", "127.0.0.1", "--port", str(port),
                                     "--journal", journal], capture_output=True, text=True, timeout=60)
            assert second.returncode != 0
            assert "in use by another process" in second.stderr and f"pid {c.master.pid}" in second.stderr, \
                second.stderr
            assert f"serving {c.address}" in second.stderr
        assert os.stat(journal).st_ino == inode  # not rewritten
        assert not any(os.readlink(f"/proc/{c.master.pid}/fd/{fd}").endswith("(deleted)")
                       for fd in os.listdir(f"/proc/{c.master.pid}/fd"))
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            store.put("after", b"a" * 1000)
        port = int(c.address.rsplit(":", 1)[1])
        c.master.kill()
        c.master = start_master(port=port, journal=journal)
        c.procs.append(c.master)
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            assert store.get("before") == b"b" * 1000 and store.get("after") == b"a" * 1000


@pytest.mark.parametrize("catalogue_knows", [True, False], ids=["told-by-the-writer", "lagging"])
def test_objects_published_just_before_a_segment_pause_survive_it(catalogue_knows):
    with Cluster(segments=1, segment_size="8MiB", heartbeat_timeout_s=2.0) as c:
        segment = c.segments[0]
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            layer = EngramStore(1, _config(), store)
            layer.populate(_tables(1))
            if not catalogue_knows:  # as if paused before the writer told it and before its next heartbeat
                infos = store.locate(layer.get_store_keys() + ["engram:l1:manifest"], lease=False)
                Connection(segment.address).call("catalog_drop", {"objects": [
                    [info.key, info.replicas[0].offset] for info in infos]})
            segment.signal(signal.SIGSTOP)
            try:
                _wait_for(lambda: store.status()["lost"] == len(SIZES) + 1, 30, "the paused segment's drop")
            finally:
                segment.signal(signal.SIGCONT)
            _wait_for(lambda: store.status()["lost"] == 0, 30, "the segment to come back with the layer")
            assert store.status()["objects"] == len(SIZES) + 1
            _check(EngramStore(1, _config(), store), _tables(1))
        if not catalogue_knows:
            assert "restored, their bytes intact" in c.master.output()


def test_a_master_restarted_without_a_journal_at_once_knows_the_last_writes_and_removes():
    """Writers and removers tell the segments before they return, so the catalogues a journal-less master rebuilds
    from already hold the last put and lack the last remove, however soon it restarts."""
    with Cluster(segments=2, segment_size="8MiB", heartbeat_timeout_s=30.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            store.put("gone", b"g" * 1000, replica_num=2)
            layer = EngramStore(1, _config(), store)
            layer.populate(_tables(1), replica_num=2)
            store.remove("gone")
        port = int(c.address.rsplit(":", 1)[1])
        c.master.kill()  # before any heartbeat could carry the news
        c.master = start_master(port=port, heartbeat_timeout_s=30.0)
        c.procs.append(c.master)
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            _wait_for(lambda: len(store.status()["segments"]) == 2, 30, "both segments to register again")
            _check(EngramStore(1, _config(), store), _tables(1))
            assert not store.is_exist("gone")


def test_a_segment_stopped_while_it_waits_for_the_master_exits_cleanly_and_leaves_no_memory_behind():
    """SIGTERM while a segment is still registering (its master is stopped) ends it with status 0, its shared
    memory removed; it died of the signal before, leaving the file for the next start to reap."""
    from engram_store.testing import spawn_segment

    with Cluster(segments=0) as c:
        c.master.signal(signal.SIGSTOP)
        segment = spawn_segment(c.address, "8MiB")
        c.procs.append(segment)

        def memory() -> list[str]:
            own = os.path.join(shared_base(), f"engram-{os.geteuid()}")  # its hand-over socket, gone with its memory
            return [f for f in os.listdir(own) if f.startswith(f"engram-{segment.pid}-")] if os.path.isdir(own) else []

        try:
            _wait_for(memory, 30, "the segment's shared memory")
            time.sleep(0.3)  # inside its registration
            assert segment.terminate() == 0, segment.output()
            assert not memory()
        finally:
            c.master.signal(signal.SIGCONT)


def test_a_layer_whose_manifest_died_with_its_segment_reads_as_lost_and_can_be_written_again():
    """Its readers hear that it was lost (ObjectLost naming the layer), not that it was never published; a writer
    may publish it again."""
    from engram_store import ObjectLost

    with Cluster(segments=1, segment_size="8MiB", heartbeat_timeout_s=1.5) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            EngramStore(1, _config(), store).populate(_tables(1))
            c.segments[0].kill()  # shared memory: the layer dies with it
            c.add_segment("8MiB")
            _wait_for(lambda: store.status()["lost"] == len(SIZES) + 1, 30, "the master to drop the dead segment")
            with pytest.raises(ObjectLost, match="engram:l1:.* was lost"):
                EngramStore(1, _config(), store).lookup(np.zeros((1, 1, len(SIZES)), np.int64))
            layer = EngramStore(1, _config(), store)
            layer.populate(_tables(2))
            _check(layer, _tables(2))


def test_a_lost_manifest_is_reported_lost_to_readers_and_absent_to_writers():
    """Heads alive, manifest lost (the explorer's seed 345: the manifest's segment died): a reader hears that the
    layer is lost, naming the manifest; a writer may publish the layer again."""
    from engram_store import ObjectLost
    from engram_store.tables._keyed import KeyedSource
    from engram_store.tables._layout import Layer

    class ManifestLost(KeyedSource):
        def get_manifest(self, lay):
            raise ObjectLost("object 'engram:l1:manifest' was lost: its last replica was on segment s0")

    source, lay = ManifestLost(None, True), Layer(1, _config(), None)
    with pytest.raises(ObjectLost, match="layer 1 is lost: object 'engram:l1:manifest' was lost"):
        source.check_published(lay)
    assert source.read_manifest(lay, lost_is_absent=True) is None


def test_a_failed_put_of_a_lost_key_leaves_it_lost_and_its_segment_comes_back_with_it(tmp_path):
    """Explorer seed 424236, made deterministic: put_start forgot the loss, so once the put failed the key was gone
    for good, and the durable segment that came back with it intact was told it had been removed."""
    data = str(tmp_path / "a.bin")
    with Cluster(segments=0, heartbeat_timeout_s=2.0) as c:
        a = c.add_segment("8MiB", ["--file", data])
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            store.put("k", b"k" * 4096)
            b = c.add_segment("8MiB")
            a.kill()
            _wait_for(lambda: store.status()["lost_keys"] == ["k"], 30, "the master to drop the killed segment")
            b.signal(signal.SIGSTOP)  # the put goes to b, which does not answer: it fails and is revoked
            try:
                store.timeout_ms = 1000
                with pytest.raises(EngramError) as failed:
                    store.put("k", b"n" * 4096)
                assert not isinstance(failed.value, OutOfSpace), failed.value  # it did start (b was registered)
            finally:
                b.signal(signal.SIGCONT)
            store.timeout_ms = 5000
            assert store.status()["lost_keys"] == ["k"]
            c.add_segment("8MiB", ["--file", data])  # a, restarted on its file
            _wait_for(lambda: store.status()["lost"] == 0, 30, "the segment to come back with the key")
            assert store.get("k") == b"k" * 4096


def _cut(journal: str, records: int) -> None:
    with open(journal, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    with open(journal, "wb") as f:
        f.write(b"".join(lines[:-records]))


def test_a_journal_that_lost_its_last_records_takes_back_what_the_segment_holds_and_one_that_rotted_is_refused(
        tmp_path):
    """Cut at a record boundary, the journal read as a shorter valid one: the master started without a word, layer
    2 disappeared, the durable segment dropped it from its catalogue and the next layer was placed over it; layer 3,
    whose remove was cut, came back listed, and every read of it was refused. A changed byte anywhere is refused at
    start, naming the line."""
    from engram_store import ObjectLost

    journal, data = str(tmp_path / "master.journal"), str(tmp_path / "seg.bin")
    extra = ["--reuse-delay", "0.2"]
    with Cluster(segments=0, journal=journal, extra=extra) as c:
        c.add_segment("8MiB", ["--file", data])
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            EngramStore(1, _config(), store).populate(_tables(1))
            EngramStore(1, _config(), store).remove_from_store()
            time.sleep(0.4)  # past the reuse delay: the next layers take layer 1's space
            EngramStore(3, _config(), store).populate(_tables(3))
            EngramStore(3, _config(), store).remove_from_store()  # one record; the segment marks the layer removed
            EngramStore(2, _config(), store).populate(_tables(2))  # its heads, then its manifest: two records
        c.master.kill()
        _cut(journal, 3)  # layer 3's remove and all of layer 2
        with open(journal, "rb") as f:
            whole = f.read()
        damaged = bytearray(whole)
        damaged[len(whole) // 2] ^= 0x04
        with open(journal, "wb") as f:
            f.write(damaged)
        refused = subprocess.run([sys.executable, "-m", "engram_store.master", "--port", "0", "--journal", journal],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert re.search(r"^engram-master: journal .*: line \d+ does not match its checksum", refused.stderr)
        with open(journal, "wb") as f:
            f.write(whole)  # restored from a copy; still without its last three records
        c.restart_master(journal=journal, extra=extra)
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            _wait_for(lambda: (store.status()["objects"], store.status()["lost"]) == (len(SIZES) + 1,) * 2, 30,
                      "the segment to offer layer 2 back and disown layer 3")
            _check(EngramStore(2, _config(), store), _tables(2))
            with pytest.raises(ObjectLost, match="engram:l3:.* was lost"):
                EngramStore(3, _config(), store).lookup(np.zeros((1, 1, len(SIZES)), np.int64))
            EngramStore(3, _config(), store).remove_from_store()  # a lost layer is removed like any other
            EngramStore(4, _config(), store).populate(_tables(4))
            _check(EngramStore(2, _config(), store), _tables(2))
            _check(EngramStore(4, _config(), store), _tables(4))
        assert "which the journal does not know" in c.master.output()
