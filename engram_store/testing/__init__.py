"""Start real ``engram-master`` and ``engram-segment`` processes on 127.0.0.1 for tests and benchmarks.

Every process is waited on until it answers a ping (never a fixed sleep) and is killed and reaped by
:meth:`Cluster.close` (or the ``with`` block). Use it in your own integration tests::

    from engram_store.testing import Cluster

    with Cluster(segments=2, segment_size="256MiB") as cluster:
        store = DistributedStore.connect(cluster.address)
        ...
        cluster.segments[0].kill()    # SIGKILL and reap: a fault to test against
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

from engram_store.errors import EngramError, MasterUnavailable, SegmentUnavailable
from engram_store.segment import reap_orphans
from engram_store.wire import Connection, load_keys

from ._forks import FORK_ENV, FORKED_MODULES, FORKED_SCRIPTS, Forked, ForkServer, forked

__all__ = ["Cluster", "FORK_ENV", "FORKED_MODULES", "FORKED_SCRIPTS", "ForkServer", "Forked", "Proc", "START_TIMEOUT_S",
           "free_port", "forked", "segment_ready", "spawn_segment", "start_master", "start_segment", "wait_ping"]

START_TIMEOUT_S = 60.0


def free_port(count: int = 1, *, reserve: bool = True) -> int:
    """A TCP port of 127.0.0.1 that nothing listens on, for a server started next (the first of ``count`` free in a
    row: a segment's reader sockets take the ports after its own).

    ``reserve`` (the default) keeps the port from being handed out again for a minute, so that tests running side by
    side (pytest-xdist's workers, another run on the host) never get the same one: it is left with a closed
    connection in TIME_WAIT, which the kernel's choice of a port (``bind`` to port 0, an outgoing ``connect``) passes
    over, while a server that binds it with ``SO_REUSEADDR`` (every engram server, ZeroMQ's) takes it at once. A
    server that binds without ``SO_REUSEADDR`` cannot take a reserved port: ``reserve=False`` gives a port that was
    merely free a moment ago."""
    if not reserve:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    while True:
        port = _reserve_port(0)
        try:
            for following in range(port + 1, port + count):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", following))  # no SO_REUSEADDR: a reserved port is refused too
                _reserve_port(following)
            return port
        except OSError:
            continue  # one of the ports after it is taken: another start


def _reserve_port(port: int) -> int:
    """Bind ``port`` (0: one the kernel picks) and leave it in TIME_WAIT (see :func:`free_port`); returns it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(1)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            accepted, _ = listener.accept()
            accepted.close()  # the listening side closes first: its end, on this port, waits in TIME_WAIT
    return port


def wait_ping(address: str, timeout_s: float = START_TIMEOUT_S, unavailable=MasterUnavailable,
              auth_dir: str | None = None, proc: "Proc | None" = None) -> dict:
    """Ping ``address`` until it answers; raise if it does not within ``timeout_s``, or once ``proc`` (the server's
    process, if given) has exited.

    ``auth_dir``: the key directory of a server started with ``--auth``.
    """
    deadline = time.monotonic() + timeout_s
    curve = load_keys(auth_dir, server=False).client_curve if auth_dir else None
    conn = Connection(address, unavailable=unavailable, curve=curve)
    try:
        while True:
            try:
                header, _ = conn.call("ping", timeout_ms=500 if proc is None else 100)
                return header
            except EngramError:
                if proc is not None and not proc.alive():
                    raise RuntimeError(f"it exited with code {proc.popen.returncode}") from None
                if time.monotonic() > deadline:
                    raise
    finally:
        conn.close()


class Proc:
    """A child process with its output in a log file; ``kill()`` and ``close()`` reap it. A master or segment
    (``python -m`` of one of :data:`FORKED_MODULES`, here or in a network namespace), or a script in
    :data:`FORKED_SCRIPTS`, is forked from a fork server where it can be (:class:`ForkServer`: the same process,
    started in milliseconds), else started as any command is."""

    def __init__(self, args: list[str], name: str, stdout_pipe: bool = False, stdin_pipe: bool = False):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"engram-{name}-", suffix=".log", delete=False)
        self.popen = forked(args, self.log, stdout_pipe, stdin_pipe) or subprocess.Popen(
            args, stdout=subprocess.PIPE if stdout_pipe else self.log, stderr=self.log,
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.address = ""
        self.read_addresses: list[str] = []  # a segment's reader sockets, from its ready line

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int, timeout_s: float = 30.0) -> None:
        """Send ``sig``. For SIGSTOP, return only once every thread of the process is stopped: ``kill()``
        returns before the stop takes effect, and a thread already on a CPU may still answer a request."""
        if not self.alive():
            return
        self.popen.send_signal(sig)
        if sig == signal.SIGSTOP:
            self._wait_stopped(timeout_s)

    def _wait_stopped(self, timeout_s: float) -> None:
        task_dir = f"/proc/{self.pid}/task"
        if not os.path.isdir(task_dir):
            return  # no procfs: nothing to look at
        deadline = time.monotonic() + timeout_s
        while True:
            states = []
            for tid in os.listdir(task_dir):
                try:
                    with open(f"{task_dir}/{tid}/stat", encoding="ascii", errors="replace") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except (OSError, IndexError):
                    continue  # the thread exited meanwhile
            if states and all(state in ("T", "t") for state in states):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} (pid {self.pid}) did not stop within {timeout_s} s: "
                                   f"thread states {states}")
            time.sleep(0.001)

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.alive():
            self.popen.kill()
        self.popen.wait(timeout=30)

    def terminate(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, wait for a clean exit (SIGKILL after ``timeout_s``); returns the exit code."""
        if self.alive():
            self.popen.send_signal(signal.SIGCONT)
            self.popen.terminate()
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.popen.returncode

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def close(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGCONT)  # a stopped process cannot die of SIGTERM
            self.kill()
        for stream in (self.popen.stdout, self.popen.stdin):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass  # a pipe to a process that is gone
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


def start_master(*, port: int | None = None, heartbeat_timeout_s: float = 10.0, lease_ttl_s: float = 5.0,
                 journal: str | None = None, extra: list[str] | None = None, auth_dir: str | None = None,
                 host: str = "127.0.0.1", prefix: list[str] | None = None) -> Proc:
    """Start ``engram-master`` on ``host`` and wait until it answers. ``prefix``: a command to run it under (e.g.
    ``["ip", "netns", "exec", NAME]`` to start it inside a network namespace)."""
    port = port or free_port()
    args = (prefix or []) + [sys.executable, "-m", "engram_store.master", "--host", host, "--port", str(port),
            "--heartbeat-timeout", str(heartbeat_timeout_s), "--lease-ttl", str(lease_ttl_s),
            "--log-level", "INFO"]
    if journal:
        args += ["--journal", journal]
    if auth_dir:
        args += ["--auth", str(auth_dir)]
    proc = Proc(args + (extra or []), "master")
    proc.address = f"{host}:{port}"
    try:
        wait_ping(proc.address, auth_dir=auth_dir, proc=proc)
    except BaseException as exc:
        out = proc.output()
        proc.close()
        if not isinstance(exc, Exception):
            raise  # Ctrl-C or a stop signal (KeyboardInterrupt): the caller is stopping, not a master that failed
        raise RuntimeError(f"master did not start ({exc}):\n{out}") from None
    return proc


def spawn_segment(master: str, size: str = "64MiB", extra: list[str] | None = None,
                  auth_dir: str | None = None, host: str = "127.0.0.1", prefix: list[str] | None = None) -> Proc:
    """Start ``engram-segment`` on ``host`` for ``master`` and return at once; :func:`segment_ready` says when it
    has registered (it prints its ready line then)."""
    args = (prefix or []) + [sys.executable, "-m", "engram_store.segment.cli", "--master", master, "--size", size,
                             "--host", host, "--port", "0", "--log-level", "INFO"]
    if auth_dir:
        args += ["--auth", str(auth_dir)]
    proc = Proc(args + (extra or []), "segment", stdout_pipe=True)
    proc.ready_line = b""
    return proc


def segment_ready(proc: Proc, timeout_s: float = 0.0) -> bool:
    """Take what a spawned segment printed, waiting up to ``timeout_s`` for it; True once its ready line is in
    (``proc.address``, ``segment_id`` and ``read_addresses`` are set then). Raises if it exited without one."""
    deadline = time.monotonic() + timeout_s
    while not proc.ready_line.endswith(b"\n"):
        remaining = max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([proc.popen.stdout], [], [], min(remaining, 0.5))
        if ready:
            chunk = os.read(proc.popen.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError("stdout closed")
            proc.ready_line += chunk
        elif not proc.alive():
            raise RuntimeError("it exited")
        elif remaining <= 0:
            return False
    # "engram-segment ready on HOST:PORT segment_id=ID size=N readers=HOST:PORT,HOST:PORT" ("readers=-": none)
    fields = proc.ready_line.decode().split()
    proc.address = fields[3]
    proc.segment_id = fields[4].split("=", 1)[1]
    readers = next((f.split("=", 1)[1] for f in fields[6:] if f.startswith("readers=")), "-")
    proc.read_addresses = [] if readers == "-" else readers.split(",")
    return True


def start_segment(master: str, size: str = "64MiB", extra: list[str] | None = None,
                  auth_dir: str | None = None, host: str = "127.0.0.1", prefix: list[str] | None = None) -> Proc:
    """Start ``engram-segment`` on ``host``, registered with ``master``; returns once it answers a ping."""
    proc = spawn_segment(master, size, extra, auth_dir, host, prefix)
    try:
        if not segment_ready(proc, START_TIMEOUT_S):
            raise RuntimeError("no ready line")
        wait_ping(proc.address, unavailable=SegmentUnavailable, auth_dir=auth_dir)
    except BaseException as exc:
        out = proc.output()
        proc.close()
        if not isinstance(exc, Exception):
            raise  # Ctrl-C or a stop signal: the caller is stopping
        raise RuntimeError(f"segment did not start ({exc}):\n{proc.ready_line.decode(errors='replace')}{out}") \
            from None
    return proc


class Cluster:
    """A master and segments as separate processes; ``close()`` kills and reaps them all.

    ``auth_dir`` (a directory from ``engram-master keygen``) starts every server with ``--auth``;
    ``segment_extra`` are more ``engram-segment`` arguments for the first ``segments`` (e.g. ``["--readers", "2"]``).
    """

    def __init__(self, segments: int = 1, segment_size: str = "64MiB", auth_dir: str | None = None,
                 segment_extra: list[str] | None = None, **master_kwargs):
        self.procs: list[Proc] = []
        self.auth_dir = auth_dir
        self.master = start_master(auth_dir=auth_dir, **master_kwargs)
        self.procs.append(self.master)
        self.segments: list[Proc] = []
        try:
            for _ in range(segments):
                self.add_segment(segment_size, segment_extra)
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        return self.master.address

    def add_segment(self, size: str = "64MiB", extra: list[str] | None = None) -> Proc:
        proc = start_segment(self.master.address, size, extra, auth_dir=self.auth_dir)
        self.procs.append(proc)
        self.segments.append(proc)
        return proc

    def restart_master(self, **kwargs) -> Proc:
        port = int(self.master.address.rsplit(":", 1)[1])
        self.master.close()
        kwargs.setdefault("auth_dir", self.auth_dir)
        self.master = start_master(port=port, **kwargs)
        self.procs.append(self.master)
        return self.master

    def close(self) -> None:
        for proc in self.procs:
            proc.close()
        reap_orphans()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
