"""The harness's own processes (``engram_store.testing``): masters and segments forked from a process that imported
them once behave as the commands would, each a process of its own (pid, signals, exit code, output); where the
test process's conditions changed since that process started, or the server runs in another network namespace,
it comes from a fork server started under those conditions or in that namespace; registered scripts alike."""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys

import pytest

from engram_store import DistributedStore
from engram_store.testing import (FORK_ENV, FORKED_SCRIPTS, Cluster, Forked, ForkServer, Proc, segment_ready,
                                  spawn_segment, start_master)

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


def test_a_server_under_a_prefix_other_than_a_network_namespace_is_a_command():
    master = start_master(prefix=["env"])
    try:
        assert isinstance(master.popen, subprocess.Popen)
    finally:
        master.close()


_SCRIPT = """import os, sys
print(os.stat("/proc/self/ns/net").st_ino, repr(sys.argv[1:]), sys.path[0], flush=True)
sys.exit(3)
"""


def _run_script(script: str, prefix: list[str]) -> tuple[Proc, str]:
    proc = Proc(prefix + [sys.executable, script, "a b", "c"], "script", stdout_pipe=True)
    try:
        assert proc.popen.wait(timeout=60) == 3, proc.output()
        return proc, proc.popen.stdout.read().decode()
    finally:
        proc.close()


def test_a_registered_script_is_forked_and_runs_as_python_would_run_it(tmp_path):
    if not _forks_here():
        pytest.skip(f"{FORK_ENV}=0: every server is started as a command")
    script = str(tmp_path / "probe.py")
    with open(script, "w") as f:
        f.write(_SCRIPT)
    FORKED_SCRIPTS.add(script)
    try:
        proc, said = _run_script(script, [])
    finally:
        FORKED_SCRIPTS.discard(script)
    assert isinstance(proc.popen, Forked)
    assert said == f"{os.stat('/proc/self/ns/net').st_ino} ['a b', 'c'] {tmp_path}\n"
    for _ in range(20):  # once it has exited, poll() has its exit code at once, as Popen's would
        FORKED_SCRIPTS.add(script)
        try:
            proc = Proc([sys.executable, script], "script", stdout_pipe=True)
        finally:
            FORKED_SCRIPTS.discard(script)
        try:
            exited = os.pidfd_open(proc.pid)
            try:
                assert select.select([exited], [], [], 60)[0]
            finally:
                os.close(exited)
            assert proc.popen.poll() == 3
        finally:
            proc.close()
    proc, said = _run_script(script, [])  # not registered: a command, with the same answer
    assert isinstance(proc.popen, subprocess.Popen)
    assert said == f"{os.stat('/proc/self/ns/net').st_ino} ['a b', 'c'] {tmp_path}\n"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and ip")
def test_a_process_under_ip_netns_exec_is_forked_into_that_namespace_and_one_made_again_is_another(tmp_path):
    """The explorer's nodes run under ``ip netns exec NAME``: the forked process joins the namespace as that command
    would (one deleted and made again under the same name is a new namespace), and a name with no namespace ends
    it with exit code 1, saying so."""
    if not _forks_here():
        pytest.skip(f"{FORK_ENV}=0: every server is started as a command")
    script = str(tmp_path / "probe.py")
    with open(script, "w") as f:
        f.write(_SCRIPT)
    name = f"engram-forks-{os.getpid()}"
    FORKED_SCRIPTS.add(script)
    try:
        seen = []
        for _ in range(2):
            subprocess.run(["ip", "netns", "add", name], check=True)
            try:
                proc, said = _run_script(script, ["ip", "netns", "exec", name])
                assert isinstance(proc.popen, Forked) and proc.popen.server is ForkServer.get()
                seen.append(os.stat(f"/run/netns/{name}").st_ino)
                assert said == f"{seen[-1]} ['a b', 'c'] {tmp_path}\n"
            finally:
                subprocess.run(["ip", "netns", "del", name], check=True)
        assert len({*seen, os.stat("/proc/self/ns/net").st_ino}) == 3
        gone = Proc(["ip", "netns", "exec", name, sys.executable, script], "script")
        try:
            assert isinstance(gone.popen, Forked) and gone.popen.wait(timeout=60) == 1
            assert f'Cannot open network namespace "{name}"' in gone.output()
        finally:
            gone.close()
    finally:
        FORKED_SCRIPTS.discard(script)


def test_the_fork_server_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(FORK_ENV, "0")
    master = start_master()
    try:
        assert isinstance(master.popen, subprocess.Popen)
    finally:
        master.close()
