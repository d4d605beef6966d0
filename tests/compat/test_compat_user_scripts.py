"""Scripts written for Mooncake's EngramStore run on engram_store.compat with only their import line changed.

Each script in ``user_scripts/`` imports ``mooncake.store`` as its users do; the test swaps that one line for
``engram_store.compat`` and runs the script in its own process, against a master and a segment process. One
script per API form: the single-layer float32 API, the byte-row API with ``store=`` and with
``store_client=`` (lookup_many_into, the packed lookup), ``bind_local`` and ``local_dir``; and processes racing
to publish one layer under a shared ``local_dir``.
"""
from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import numpy as np
import pytest

from compat_helpers import REPO, SCRIPT_TIMEOUT_S, SIZES, byte_config, run_script, script_env, user_script
from engram_store.compat import EngramStore
from engram_store.testing import Cluster

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster():
    with Cluster(segments=1, segment_size="64MiB") as c:
        yield c


def test_single_layer_script(cluster, tmp_path):
    line = run_script(user_script("single_layer.py", tmp_path), cluster.address)
    assert line.startswith("shape=(2, 2, 4, 8) dtype=float32 checksum=")
    assert line.endswith("removed=4 again=0 left=[0, 0, 0, 0]")


def test_byte_rows_script_with_store(cluster, tmp_path):
    line = run_script(user_script("byte_rows_store.py", tmp_path), cluster.address)
    assert line == "layers=[1, 14] removed=[4, 2] left=0"


def test_byte_rows_script_with_store_client(cluster, tmp_path):
    line = run_script(user_script("byte_rows_store_client.py", tmp_path), cluster.address)
    assert line == "removed={2: 4, 15: 4, 20: 1, 21: 1}"


def test_bind_local_script(tmp_path):
    assert run_script(user_script("bind_local.py", tmp_path)) == "released=True"


def test_local_dir_script(tmp_path):
    tables = tmp_path / "tables"
    line = run_script(user_script("local_dir.py", tmp_path), tables)
    assert line == "published=['layer-1'] remove=remove_from_store failed, rc=-600"


def _read_line(proc: subprocess.Popen, deadline: float) -> str:
    """The next line ``proc`` prints; fails at ``deadline`` or if the process exits first."""
    line = b""
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        assert remaining > 0, "a writer did not report in time"
        ready, _, _ = select.select([proc.stdout], [], [], min(remaining, 0.5))
        if ready:
            chunk = os.read(proc.stdout.fileno(), 1)
            assert chunk, f"a writer exited early with code {proc.wait(timeout=10)}"
            line += chunk
    return line.decode().strip()


def test_processes_racing_to_publish_a_layer_have_one_winner(tmp_path):
    directory = tmp_path / "tables"
    reader = EngramStore({1: byte_config(SIZES, 264)}, local_dir=str(directory))  # built before the race
    script = user_script("local_dir_writer.py", tmp_path)
    fills = (11, 22)
    procs = [subprocess.Popen([sys.executable, str(script), str(directory), str(fill)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=script_env())
             for fill in fills]
    try:
        deadline = time.monotonic() + SCRIPT_TIMEOUT_S
        assert [_read_line(proc, deadline) for proc in procs] == ["ready", "ready"]
        for proc in procs:  # start both at once
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        results = [_read_line(proc, deadline) for proc in procs]
        codes = [proc.wait(timeout=SCRIPT_TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()
    assert sorted(codes) == [0, 3], results
    winner = fills[codes.index(0)]
    loser_line = results[codes.index(3)]
    assert loser_line.startswith("lost: local_dir: layer 1 is already published"), loser_line
    ids = np.array([[[16, 18, 22, 28], [0, 1, 2, 3]]], dtype=np.int64)
    output = np.zeros((1, 2, 4, 264), dtype=np.uint8)
    reader.lookup_into(1, ids, output)
    assert (output == winner).all()
    assert sorted(os.listdir(directory)) == ["layer-1"]  # the writer's lock file goes with it
