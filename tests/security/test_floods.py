"""Connection floods by another local user: every listening socket bounds what idle or slow peers can hold.

The intruder (a second, unprivileged user, ``flood_worker.py``) opens 1,100 connections to 127.0.0.1 and holds them:
plain TCP that says nothing, ZeroMQ handshakes without keys, or raw-channel reads that then idle. The servers run
under a hard open-files limit of 1,024 (as on the host where the floods were found), so no raised limit hides a
missing cap. The victim (this process, root) must keep getting answers within a few seconds from new connections,
and the servers must neither spin a core nor spend a thread or a descriptor per intruding connection.
"""
import os
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from engram_store import DistributedStore, EngramStore, EngramStoreConfig, SegmentUnavailable, serve_metrics
from engram_store.testing import free_port, start_master, start_segment, wait_ping
from engram_store.wire import Connection, keygen, load_keys
from security_helpers import needs_root
from suite_helpers import proc_status

pytestmark = pytest.mark.timeout(240)

FLOOD_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flood_worker.py")
#: Connections the intruder opens, and the open-files limit (soft and hard) the servers run under.
FLOOD = 1100
LIMITED = ["prlimit", "--nofile=1024:1024"]
#: How long one answer may take while the flood stands.
ANSWER_S = 3.0


class Flood:
    """The intruder's connections (``flood_worker.py ACTION PORT COUNT``), held from the start of the ``with`` block
    until its end; ``held``: how many it holds."""

    def __init__(self, action: str, port: int, count: int = FLOOD):
        self.proc = subprocess.Popen([sys.executable, FLOOD_WORKER, action, str(port), str(count)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        if line[:1] != ["held"]:
            self.proc.stdin.close()
            errors = self.proc.stderr.read()
            self.close()
            raise AssertionError(f"the flood did not start: {errors[-2000:]}")
        self.held = int(line[1])

    def close(self) -> None:
        try:
            if not self.proc.stdin.closed:
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()

    def __enter__(self) -> "Flood":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _assert_quiet(pid: int, what: str, window_s: float = 2.0) -> None:
    """``pid`` spends less than half a core over ``window_s`` (no spinning on a listener it cannot serve)."""
    start, began = _cpu_s(pid), time.monotonic()
    time.sleep(window_s)
    used = (_cpu_s(pid) - start) / (time.monotonic() - began)
    assert used < 0.5, f"{what} used {used:.0%} of a core while the flood stood still"


def _status_answers(address: str, auth_dir: str | None, times: int = 3) -> None:
    """A new client connection gets the master's status within ANSWER_S, ``times`` over."""
    curve = load_keys(auth_dir, server=False).client_curve if auth_dir else None
    for _ in range(times):
        conn = Connection(address, curve=curve)
        try:
            began = time.monotonic()
            header, _ = conn.call("status", timeout_ms=int(ANSWER_S * 1000))
            assert "segments" in header and time.monotonic() - began < ANSWER_S
        finally:
            conn.close()


@pytest.fixture
def keys(tmp_path):
    needs_root()
    directory = str(tmp_path / "keys")
    keygen(directory)
    return directory


def test_idle_connections_leave_an_auth_master_answering_its_clients(keys):
    """1,100 silent connections filled an --auth master's 1,024 descriptors within seconds: ``engram-master status
    --auth`` got no reply and the master spun a core. Now a peer's connections without a handshake are capped and
    cut at the handshake deadline."""
    master = start_master(auth_dir=keys, prefix=LIMITED)
    try:
        with Flood("idle", _port(master.address)) as flood:
            assert flood.held > 1024  # more than the master could ever have held at once
            _status_answers(master.address, keys)
            done = subprocess.run([sys.executable, "-m", "engram_store.master", "status", "--master", master.address, "--auth",
                                   keys, "--timeout", str(ANSWER_S)], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            _assert_quiet(master.pid, "the master")
            assert _fds(master.pid) < 512
    finally:
        master.close()


def test_handshaken_connections_of_one_peer_are_capped_on_a_master_without_auth():
    """Without --auth anyone completes the ZeroMQ handshake: 1,100 such connections of one user are cut to that
    user's share, and other users' clients still connect and get answers."""
    needs_root()
    master = start_master(prefix=LIMITED)
    try:
        with Flood("zmtp", _port(master.address)):
            _status_answers(master.address, None)
            _assert_quiet(master.pid, "the master")
            assert _fds(master.pid) < 768
    finally:
        master.close()


def test_idle_connections_to_a_segment_leave_reads_and_writes_working(keys):
    """The same flood against an --auth segment's ZeroMQ port: a new client still writes and reads through it."""
    master = start_master(auth_dir=keys)
    segment = None
    try:
        segment = start_segment(master.address, "16MiB", auth_dir=keys, prefix=LIMITED)
        with Flood("idle", _port(segment.address)):
            with DistributedStore.connect(master.address, auth_dir=keys, local_direct=False,
                                          raw_reads=False) as store:
                store.put("k", b"v" * 4096)
                assert store.get("k") == b"v" * 4096
            _assert_quiet(segment.pid, "the segment")
    finally:
        for proc in (segment, master):
            if proc is not None:
                proc.close()


def test_readers_of_one_peer_are_capped_on_the_raw_channel():
    """Without --auth, 1,100 raw-channel connections of one user that each read once and then idle filled the
    channel (896 under a limit of 1,024): another user's reads were answered busy. Now one peer holds its share."""
    needs_root()
    master = start_master()
    segment = None
    try:
        segment = start_segment(master.address, "16MiB", prefix=LIMITED)
        raw_port = wait_ping(segment.address, unavailable=SegmentUnavailable)["raw_port"]
        with Flood("raw", raw_port):
            before = wait_ping(segment.address, unavailable=SegmentUnavailable)["raw_stats"]
            config = EngramStoreConfig([500, 300], 8)
            tables = [np.arange(n * 8, dtype=np.float32).reshape(n, 8) for n in (500, 300)]
            with DistributedStore.connect(master.address, local_direct=False) as store:
                with EngramStore(1, config, store) as layer:
                    layer.populate(tables)
                    ids = np.stack([np.arange(16) % 300] * 2, axis=-1)[None]
                    np.testing.assert_array_equal(layer.lookup(ids)[0, :, 1], tables[1][ids[0, :, 1]])
            after = wait_ping(segment.address, unavailable=SegmentUnavailable)["raw_stats"]
            assert after["refused_full"] == before["refused_full"], (before, after)
            assert after["connections"] <= after["max_connections"]
    finally:
        for proc in (segment, master):
            if proc is not None:
                proc.close()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=ANSWER_S) as reply:
        return reply.read().decode()


def test_idle_connections_to_the_master_metrics_page_hold_no_thread_each():
    """The metrics page was a thread per connection without a timeout (about 1,008 threads under the flood). Now
    one thread serves it with caps: the flood holds a few descriptors, the page and the master answer."""
    needs_root()
    port = free_port()
    master = start_master(prefix=LIMITED, extra=["--metrics-port", str(port)])
    try:
        with Flood("idle", port):
            assert "engram_master_objects" in _scrape(port)
            _status_answers(master.address, None)
            assert proc_status(master.pid, "Threads") < 32
            assert _fds(master.pid) < 128
            _assert_quiet(master.pid, "the master")
    finally:
        master.close()


def test_idle_connections_to_serve_metrics_leave_a_serving_process_its_files(tmp_path):
    """A serving process's ``serve_metrics`` reached 858 threads and 1,024 descriptors, after which opening a
    ``disk_dir`` failed with a raw EMFILE. Now the flood costs the process no thread and a bounded few descriptors,
    and it goes on opening layers and answering scrapes."""
    needs_root()
    config = EngramStoreConfig([100, 100], 16, row_format="bytes")
    with EngramStore(1, config, disk_dir=tmp_path / "disk") as layer:
        layer.populate([np.zeros((100, 16), np.uint8)] * 2)
        threads, fds = threading.active_count(), _fds(os.getpid())
        with serve_metrics(layer, port=0) as endpoint, Flood("idle", endpoint.port) as flood:
            assert flood.held > 1024
            assert threading.active_count() <= threads + 2, threading.enumerate()
            assert _fds(os.getpid()) < fds + 64
            assert 'engram_store_lookups_total{layer="1"}' in _scrape(endpoint.port)
            with EngramStore(1, config, disk_dir=tmp_path / "disk") as again:
                assert again.lookup(np.zeros((1, 2, 2), np.int64)).shape == (1, 2, 2, 16)
