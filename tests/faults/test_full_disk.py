"""A durable segment whose disk fills up keeps serving and heartbeating; its catalogue catches up once there is
room (root only: the disk is a tmpfs this test mounts)."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from engram_store import DistributedStore
from engram_store.testing import Cluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "fs"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)], capture_output=True,
                             timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], timeout=30)


def _catalogue(path: str) -> list[str]:
    with open(path + ".manifest", encoding="utf-8") as f:
        return sorted(o[0] for o in json.load(f)["objects"])


def test_a_durable_segment_on_a_full_disk_keeps_heartbeating_and_catches_up(tmpfs):
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
            fd = os.open(filler, os.O_CREAT | os.O_WRONLY)
            try:
                for size in (1 << 20, 64 << 10, 4 << 10):  # every page there is
                    while True:
                        try:
                            os.posix_fallocate(fd, os.fstat(fd).st_size, size)
                        except OSError:
                            break
            finally:
                os.close(fd)
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


def _fill(path: str) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY)
    try:
        for size in (1 << 20, 64 << 10, 4 << 10):  # every page there is
            while True:
                try:
                    os.posix_fallocate(fd, os.fstat(fd).st_size, size)
                except OSError:
                    break
    finally:
        os.close(fd)


def test_a_durable_segment_restarted_on_a_full_disk_serves_without_its_generation_table(tmpfs):
    """Its data file is whole from the first run; the small table beside it finds no page. The segment warns
    and serves (readers on its host then ask the master); a sparse table had killed it with SIGBUS at the first
    write."""
    data = str(tmpfs / "segment.bin")
    with Cluster(segments=0, heartbeat_timeout_s=5.0) as c:
        first = c.add_segment("8MiB", ["--file", data])
        first.terminate()
        _fill(str(tmpfs / "filler"))
        segment = c.add_segment("8MiB", ["--file", data])
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            store.put("k", b"k" * 4096)
            assert store.get("k") == b"k" * 4096
        assert segment.alive(), segment.output()
        assert "no generation table" in segment.output()
