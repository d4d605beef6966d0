"""The harness's own processes (``engram_store.testing``): masters and segments forked from a process that imported
them once behave as the commands would, each a process of its own (pid, signals, exit code, output), and where the
test process's conditions changed since that process started, a server is started as a command again."""
from __future__ import annotations

import os
import signal
import subprocess

import pytest

from engram_store import DistributedStore
from engram_store.testing import (FORK_ENV, Cluster, Forked, ForkServer, segment_ready, spawn_segment,
                                  start_master)

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds need Linux 5.3 or later")]


def _forks_here() -> bool:
    return os.environ.get(FORK_ENV, "1") != "0" and ForkServer.get() is not None


def test_a_forked_cluster_serves_and_its_servers_stop_kill_and_report_as_processes_do():
    if not _forks_here():
        pytest.skip(f"{FORK_ENV}=0: every server is started as a command")
    with Cluster(segments=2, segment_size="16MiB") as c:
        assert all(isinstance(p.popen, Forked) for p in c.procs)
        pids = [p.pid for p in c.procs]
        assert len(set(pids)) == 3 and os.getpid() not in pids and all(os.path.isdir(f"/proc/{p}") for p in pids)
        with DistributedStore.connect(c.address, timeout_ms=10_000) as store:
            store.put("k", b"forked" * 1000)
            first = c.segments[0]
            first.signal(signal.SIGSTOP)  # returns once every thread is stopped (read from /proc)
            first.signal(signal.SIGCONT)
            assert store.get("k") == b"forked" * 1000
        first.kill()
        assert first.popen.returncode == -signal.SIGKILL and first.popen.poll() == -signal.SIGKILL
        first.popen.send_signal(signal.SIGTERM)  # to a process that is gone: nothing happens
        assert c.segments[1].terminate() == 0
        assert "registered" in c.segments[1].output() or "serving" in c.segments[1].output()
        assert c.master.terminate() == 0


def test_a_forked_server_that_refuses_to_start_exits_with_its_code_and_says_why(tmp_path):
    if not _forks_here():
        pytest.skip(f"{FORK_ENV}=0: every server is started as a command")
    master = start_master()
    try:
        missing = tmp_path / "no" / "seg.bin"
        proc = spawn_segment(master.address, "16MiB", ["--file", str(missing)])
        try:
            assert isinstance(proc.popen, Forked)
            assert proc.popen.wait(timeout=60) == 2
            with pytest.raises(RuntimeError):
                segment_ready(proc, 1)
            said = proc.output()
            assert f"--file {missing}: no directory {missing.parent}" in said and "Traceback" not in said
        finally:
            proc.close()
    finally:
        master.close()


def test_a_wait_that_runs_out_raises_as_popens_does():
    if not _forks_here():
        pytest.skip(f"{FORK_ENV}=0: every server is started as a command")
    master = start_master()
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            master.popen.wait(timeout=0.2)
        assert master.popen.poll() is None
    finally:
        master.close()
    assert master.popen.returncode == -signal.SIGKILL


def test_a_server_started_under_other_conditions_is_forked_by_a_fork_server_that_started_under_them(monkeypatch,
                                                                                                      tmp_path):
    """A module may read the environment when it is imported, which a fork server did once: a server started after
    a test changed it (or the umask, or the open-files limit) comes from a fork server started under the new ones,
    and sees them; the first one serves again once they are back."""
    if not _forks_here():
        pytest.skip(f"{FORK_ENV}=0: every server is started as a command")
    before = ForkServer.get()
    monkeypatch.setenv("ENGRAM_TEST_MARK", str(tmp_path))
    master = start_master()
    try:
        assert isinstance(master.popen, Forked) and master.popen.server is not before
        with open(f"/proc/{master.pid}/environ", "rb") as f:
            assert f"ENGRAM_TEST_MARK={tmp_path}".encode() in f.read().split(b"\0")
    finally:
        master.close()
    monkeypatch.delenv("ENGRAM_TEST_MARK")
    again = start_master()
    try:
        assert isinstance(again.popen, Forked) and again.popen.server is before
    finally:
        again.close()


def test_a_server_under_a_prefix_is_a_command():
    """``ip netns exec NAME`` (the explorer's partitions) runs the server in another namespace: no fork there."""
    master = start_master(prefix=["env"])
    try:
        assert isinstance(master.popen, subprocess.Popen)
    finally:
        master.close()


def test_the_fork_server_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(FORK_ENV, "0")
    master = start_master()
    try:
        assert isinstance(master.popen, subprocess.Popen)
    finally:
        master.close()
