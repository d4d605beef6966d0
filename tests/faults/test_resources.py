"""Resource errors name the resource: a process out of file descriptors, a shared-memory directory that is full,
out of inodes, or not a directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from engram_store import ConfigError, DistributedStore, EngramStore, EngramStoreConfig, OutOfSpace
from engram_store.disk import HostRowCache
from engram_store.testing import Cluster

pytestmark = pytest.mark.timeout(120)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fd_worker.py")


def test_a_client_out_of_file_descriptors_says_so_at_every_stage_it_needs_one():
    """Descriptors run out as ZeroMQ starts its threads, as the client maps a segment, as it opens a raw read
    channel: each says "too many open files", never that a server did not answer, never an abort."""
    config = EngramStoreConfig(table_vocab_sizes=[101, 103], embedding_dim=8)
    with Cluster(segments=1, heartbeat_timeout_s=30.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000) as store:
            EngramStore(1, config, store).populate([np.ones((n, 8), np.float32) for n in (101, 103)])
        outcomes = []
        for local_direct, spare in (("1", 2), ("1", 8), ("0", 12)):
            done = subprocess.run([sys.executable, WORKER, c.address, local_direct, str(spare)], capture_output=True,
                                  text=True, timeout=60)
            assert done.returncode == 0 and done.stdout.strip(), \
                f"spare {spare}: exit {done.returncode}: {done.stdout}{done.stderr[-2000:]}"
            got = json.loads(done.stdout.strip().splitlines()[-1])
            outcomes.append(got["outcome"])
            assert got["outcome"] in ("ok", "ResourceExhausted"), f"spare {spare}: {got}"
            if got["outcome"] != "ok":
                assert got["message"].startswith("too many open files (ulimit -n 64"), got
        assert "ResourceExhausted" in outcomes


def test_a_host_cache_names_a_shared_memory_directory_that_is_not_one(tmp_path, monkeypatch):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    monkeypatch.setenv("ENGRAM_SHM_DIR", str(not_a_dir))
    with pytest.raises(ConfigError, match=rf"{not_a_dir} \(ENGRAM_SHM_DIR: .*expected a directory"):
        HostRowCache(1 << 20, 64, scope=f"resources-{os.getpid()}")
    with pytest.raises(ConfigError, match=r"\(directory=: .*expected a directory"):
        HostRowCache(1 << 20, 64, scope=f"resources-{os.getpid()}", directory=str(not_a_dir / "sub"))


def test_a_host_cache_names_a_shared_memory_directory_out_of_inodes(tmpfs, monkeypatch):
    where = tmpfs("1M", "nr_inodes=3")
    for i in range(8):  # take every inode
        try:
            (where / f"taken-{i}").write_bytes(b"")
        except OSError:
            break
    monkeypatch.setenv("ENGRAM_SHM_DIR", str(where))
    with pytest.raises(OutOfSpace, match=rf"host row cache: {where} \(ENGRAM_SHM_DIR: .*no space left .*inodes"):
        HostRowCache(1 << 16, 64, scope=f"resources-{os.getpid()}")
