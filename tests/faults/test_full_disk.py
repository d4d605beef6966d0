"""A durable segment whose disk fills up keeps serving and heartbeating; its catalogue catches up once there is
room (root only: the disk is a tmpfs this test mounts)."""
from __future__ import annotations

import json
import os
import time

import pytest

from suite_helpers import fill_up
from engram_store import CatalogUnwritable, DistributedStore
from engram_store.testing import Cluster

pytestmark = pytest.mark.timeout(120)


def _catalogue(path: str) -> list[str]:
    with open(path + ".manifest", encoding="utf-8") as f:
        return sorted(o[0] for o in json.load(f)["objects"])


def test_a_durable_segment_on_a_full_disk_takes_no_put_it_cannot_list_and_catches_up(tmpfs):
    """A put whose entry the catalogue cannot take (the disk is full) is refused with CatalogUnwritable, and nothing
    of it stays: its segment's next start would not offer it back (it had acknowledged such puts, which a master
    restarted without a journal then lost). The segment keeps serving and heartbeating, the master lists why it
    takes no puts, and once there is room it takes them again and its catalogue catches up."""
    tmpfs = tmpfs("16m")
    data = str(tmpfs / "segment.bin")
    filler = str(tmpfs / "filler")
    with Cluster(segments=0, heartbeat_timeout_s=2.0) as c:
        c.add_segment("8MiB", ["--file", data])
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            store.put("before", b"b" * 1000)
            deadline = time.monotonic() + 20
            while _catalogue(data) != ["before"]:
                assert time.monotonic() < deadline, "the catalogue never named the first object"
                time.sleep(0.05)
            fill_up(filler)
            with pytest.raises(CatalogUnwritable, match="take none now .*cannot write its catalogue to .*No space"):
                store.put("during", b"d" * 1000)
            assert not store.is_exist("during")
            time.sleep(3 * 2.0)  # past the heartbeat timeout: a segment whose heartbeats stopped is dropped
            status = store.status()
            assert len(status["segments"]) == 1 and status["lost"] == 0, status
            assert "No space left" in status["segments"][0]["refusing_puts"], status
            assert _catalogue(data) == ["before"]  # the old file stays whole
            os.unlink(filler)
            deadline = time.monotonic() + 20
            while True:
                try:
                    store.put("after", b"a" * 1000)
                    break
                except CatalogUnwritable:
                    assert time.monotonic() < deadline, "the segment did not take puts again once there was room"
                    time.sleep(0.05)
            while _catalogue(data) != ["after", "before"]:
                assert time.monotonic() < deadline, "the catalogue did not catch up once there was room"
                time.sleep(0.05)
            assert store.get("after") == b"a" * 1000 and store.status()["segments"][0]["refusing_puts"] == ""
        assert "Traceback" not in c.segments[0].output()


def test_a_durable_segment_restarted_on_a_full_disk_serves_with_a_generation_table(tmpfs):
    """Its data file is whole from the first run; the table file beside it is gone (the next run would take it
    over in place, needing no page) and finds no page now. The segment warns and keeps its table in shared memory
    for this run, so readers on its host keep checking it; a sparse table had killed it with SIGBUS at the first
    write."""
    tmpfs = tmpfs("16m")
    data = str(tmpfs / "segment.bin")
    with Cluster(segments=0, heartbeat_timeout_s=5.0) as c:
        first = c.add_segment("8MiB", ["--file", data])
        first.terminate()
        os.unlink(data + ".gen")  # the next run would take it over in place, needing no page
        fill_up(str(tmpfs / "filler"))
        segment = c.add_segment("8MiB", ["--file", data])
        os.unlink(str(tmpfs / "filler"))  # room for the catalogue again (its table is made already)
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            store.put("k", b"k" * 4096)
            assert store.get("k") == b"k" * 4096
        assert segment.alive(), segment.output()
        assert "not kept for the next run" in segment.output() and "no generation table" not in segment.output()


# ---- the master's journal -------------------------------------------------------------------------------------

def _tables(layer: int) -> list:
    import numpy as np

    return [np.full((n, 8), layer * 1000 + h, dtype=np.float32) for h, n in enumerate((101, 103))]


def _config():
    from engram_store import EngramStoreConfig

    return EngramStoreConfig(table_vocab_sizes=[101, 103], embedding_dim=8)


def _lookup(store, layer: int):
    import numpy as np

    from engram_store import EngramStore

    rows = EngramStore(layer, _config(), store).lookup(np.zeros((1, 2, 2), dtype=np.int64))
    return sorted({float(v) for v in rows[..., 0].ravel()})


def test_a_master_whose_journal_cannot_grow_makes_no_change_it_could_not_record(tmp_path):
    """The master changed its state before it appended the record, and kept the change when the append failed: a
    remove that raised had removed, a put that failed then took the removed object's space, and after a restart on
    the journal a local-direct read of the first key returned the second object's bytes; a layer's remove stopped
    part-way. Here the journal is held at its size (RLIMIT_FSIZE on the master: the kernel refuses every byte past
    it, as a full disk refuses a new page), so every change from then on fails at its append, deterministically."""
    import resource

    from engram_store import EngramStore, JournalError

    journal = str(tmp_path / "master.journal")
    extra = ["--reuse-delay", "0"]  # a removed object's space is taken at once: what made the wrong rows
    with Cluster(segments=1, segment_size="8MiB", journal=journal, extra=extra) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000) as store:
            store.put("a0", b"0" * 4096)
            EngramStore(1, _config(), store).populate(_tables(1))
            size = os.path.getsize(journal)
            resource.prlimit(c.master.pid, resource.RLIMIT_FSIZE, (size, size))
            with pytest.raises(JournalError, match="cannot write a record: File too large; the change was not made"):
                store.remove("a0")
            assert store.get("a0") == b"0" * 4096
            with pytest.raises(JournalError):
                EngramStore(1, _config(), store).remove_from_store()
            assert _lookup(store, 1) == [1000.0, 1001.0]
            with pytest.raises(JournalError):
                store.put("a1", b"1" * 4096)
            with pytest.raises(JournalError):
                EngramStore(2, _config(), store).populate(_tables(2))
            assert not store.is_exist("a1") and store.status()["objects"] == 3 + 1
            assert os.path.getsize(journal) == size
        c.master.kill()
        c.restart_master(journal=journal, extra=extra)
        with DistributedStore.connect(c.address, timeout_ms=5000) as store:
            deadline = time.monotonic() + 20
            while not all(s["confirmed"] for s in store.status()["segments"]):
                assert time.monotonic() < deadline, "the segment did not register again"
                time.sleep(0.05)
            assert store.get("a0") == b"0" * 4096 and _lookup(store, 1) == [1000.0, 1001.0]
            assert not store.is_exist("a1") and store.status()["objects"] == 3 + 1
        assert "Traceback" not in c.master.output()


@pytest.mark.parametrize("disk", ["full", "read-only"])
def test_a_master_refuses_to_start_on_a_journal_it_cannot_write_and_says_why(tmpfs, disk):
    """Before, a raw OSError traceback."""
    import subprocess
    import sys

    from engram_store.master import Journal

    where = tmpfs("1m")
    journal = Journal(str(where / "master.journal"))
    journal.rewrite([{"op": "forget_lost"}])
    journal.release()
    if disk == "full":
        fill_up(str(where / "filler"))
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, timeout=30)
    done = subprocess.run([sys.executable, "-m", "engram_store.master", "--port", "0", "--journal", str(where / "master.journal")],
                          capture_output=True, text=True, timeout=60)
    why = "No space left on device" if disk == "full" else "Read-only file system"
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("engram-master: journal ") and why in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
