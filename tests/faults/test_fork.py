"""A process that forks after it has used the store: its child works with connections, pools, AIO contexts and
file locks of its own, and leaves the parent's alone (see ``engram_store._fork``)."""
from __future__ import annotations

import json
import subprocess
import sys

import fork_worker
import pytest

from engram_store import DistributedStore, EngramStore
from engram_store.testing import Cluster

pytestmark = pytest.mark.timeout(120)

WORKER = fork_worker.__file__


def _run(*args: str) -> dict:
    done = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_child_forked_after_connect_makes_its_own_connections():
    config, tables = fork_worker.CONFIG, fork_worker._tables()
    with Cluster(segments=1, heartbeat_timeout_s=30.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000) as store:
            EngramStore(1, config, store).populate(tables)
            store.put("parent", b"p" * 1000)
        assert _run("client", c.address) == {"local-direct": 0, "remote": 0, "children": 2}, \
            "a child failed (its traceback is in the worker's stderr)"


def test_a_child_reads_disk_layers_with_an_aio_context_and_threads_of_its_own(tmp_path):
    config, tables = fork_worker.CONFIG, fork_worker._tables()
    with EngramStore(7, config, disk_dir=tmp_path) as layer:
        layer.populate(tables)
    assert _run("disk", str(tmp_path)) == {"default": 0, "threads": 0}


def test_a_host_cache_users_children_hold_none_of_its_locks(tmp_path):
    got = _run("host_cache", str(tmp_path))
    assert got == {"attached_beside_the_helper": True, "child": 0, "files_kept": True, "fills_skipped": 0}
