"""A durable segment whose disk fills up keeps serving and heartbeating; its catalogue catches up once there is
room (root only: the disk is a tmpfs this test mounts)."""
from __future__ import annotations

import json
import os
import time

import pytest

from suite_helpers import fill_up
from engram_store import DistributedStore
from engram_store.testing import Cluster

pytestmark = pytest.mark.timeout(120)


def _catalogue(path: str) -> list[str]:
    with open(path + ".manifest", encoding="utf-8") as f:
        return sorted(o[0] for o in json.load(f)["objects"])


def test_a_durable_segment_on_a_full_disk_keeps_heartbeating_and_catches_up(tmpfs):
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
            store.put("during", b"d" * 1000)  # its catalogue cannot be written now
            time.sleep(3 * 2.0)  # past the heartbeat timeout: a segment whose heartbeats stopped is dropped
            status = store.status()
            assert len(status["segments"]) == 1 and status["lost"] == 0, status
            assert _catalogue(data) == ["before"]  # the old file stays whole
            os.unlink(filler)
            deadline = time.monotonic() + 20
            while _catalogue(data) != ["before", "during"]:
                assert time.monotonic() < deadline, "the catalogue did not catch up once there was room"
                time.sleep(0.05)
            assert store.get("during") == b"d" * 1000
        assert "Traceback" not in c.segments[0].output()


def test_a_durable_segment_restarted_on_a_full_disk_serves_without_its_generation_table(tmpfs):
    """Its data file is whole from the first run; the small table beside it (kept for the next run, but deleted
    here) finds no page. The segment warns and serves (readers on its host then ask the master); a sparse table
    had killed it with SIGBUS at the first write."""
    tmpfs = tmpfs("16m")
    data = str(tmpfs / "segment.bin")
    with Cluster(segments=0, heartbeat_timeout_s=5.0) as c:
        first = c.add_segment("8MiB", ["--file", data])
        first.terminate()
        os.unlink(data + ".gen")  # the next run would take it over in place, needing no page
        fill_up(str(tmpfs / "filler"))
        segment = c.add_segment("8MiB", ["--file", data])
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            store.put("k", b"k" * 4096)
            assert store.get("k") == b"k" * 4096
        assert segment.alive(), segment.output()
        assert "no generation table" in segment.output()
