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

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from engram_store.errors import EngramError, MasterUnavailable, SegmentUnavailable
from engram_store.segment import reap_orphans
from engram_store.wire import Connection, load_keys

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
    (``python -m`` of one of :data:`FORKED_MODULES`) is forked from this process's fork server where it can be
    (:class:`ForkServer`: the same process, started in milliseconds), else started as any command is."""

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


# ---- servers forked from a process that imported them once -----------------------------------------------------------
#
# A master or segment started as ``python -m`` spends half a second importing (NumPy, Numba, ZeroMQ, the store) before
# it does anything, and the suite starts hundreds. A fork server imports them once per test process and forks each
# server a test asks for: the child runs the same ``main`` with the same arguments, descriptors, directory, umask and
# environment, as a process of its own (its own pid, signals, exit code); only its parent is the fork server, which
# reports its exit. Where the test process's environment, umask or open-files limit differ from what the fork server
# started with (a module may have read them when it was imported), or a prefix runs the server (``ip netns exec``),
# the server is started as a command instead.

#: ``python -m`` modules that may be forked, and the module whose ``main(argv)`` each runs.
FORKED_MODULES = {"engram_store.master": "engram_store.master.cli",
                  "engram_store.segment.cli": "engram_store.segment.cli"}
#: Set to 0 to start every server as a command (no fork server).
FORK_ENV = "ENGRAM_TEST_FORK"


def forked(args: list[str], log, stdout_pipe: bool, stdin_pipe: bool) -> "Forked | None":
    """``args`` (``python -m MODULE ...``) forked from this process's fork server, with stderr (and stdout unless
    ``stdout_pipe``) into ``log``; None where it cannot be (see above): start it as a command."""
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-m" or args[2] not in FORKED_MODULES \
            or os.environ.get(FORK_ENV, "1") == "0":
        return None
    server = ForkServer.get()
    return server.spawn(args, log, stdout_pipe, stdin_pipe) if server is not None else None


def _conditions() -> tuple:
    """What a forked server inherits from the fork server rather than from the test process at the time."""
    import resource

    mask = os.umask(0)
    os.umask(mask)
    env = tuple(sorted((k, v) for k, v in os.environ.items() if not k.startswith("PYTEST_")))  # (pytest's own: the
    return (env, mask, resource.getrlimit(resource.RLIMIT_NOFILE), sys.executable, os.geteuid(), os.getegid())  # test)


class Forked:
    """A server forked by the fork server: the part of ``subprocess.Popen`` that tests use (``pid``, ``poll``,
    ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``, ``stdout``, ``stdin``). Signals go through
    a pidfd (never to another process that took the pid); the exit code comes from the fork server."""

    def __init__(self, server: "ForkServer", args: list[str], pid: int, pidfd: int, stdout, stdin):
        self.server, self.args, self.pid, self.pidfd = server, args, pid, pidfd
        self.stdout, self.stdin, self.returncode = stdout, stdin, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.wait(self, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self.server.wait(self, timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:
                pass  # it exited a moment ago: poll() says so next

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _exited(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        os.close(self.pidfd)


class ForkServer:
    """This test process's fork server (see above): a child that imported :data:`FORKED_MODULES`, forks a server
    for each request and reports each one's exit, over a socket pair; it dies with the test process."""

    _current: "ForkServer | None" = None
    _failed = False
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> "ForkServer | None":
        """The fork server for the test process as it is now: started on first use (a second, while it imports),
        again where it died; None where the conditions changed since it started (a test changed them: a command
        it is, this time), where one failed to start, or where this host has no pidfds (Linux < 5.3)."""
        if cls._failed or not hasattr(os, "pidfd_open"):
            return None
        conditions = _conditions()
        with cls._lock:
            server = cls._current
            if server is not None and server.owner == os.getpid() and not server.alive():
                server.close()
                server = None
            if server is None or server.owner != os.getpid():  # (a forked test process starts its own)
                server = cls._current = cls(conditions)
            if server.conditions != conditions:
                return None
            if not server.ready():
                cls._failed = True
                return None
            return server

    def __init__(self, conditions: tuple):
        self.conditions, self.owner = conditions, os.getpid()
        here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = here
        self.children: dict[int, Forked] = {}
        self._io = threading.Lock()
        self._ready: bool | None = None
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-c", f"from engram_store.testing import _serve_forks; _serve_forks({there.fileno()})"],
            pass_fds=[there.fileno()], stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        there.close()

    def alive(self) -> bool:
        return self.proc.poll() is None and self._ready is not False

    def close(self) -> None:
        """Stop the fork server (the servers it forked live on, as a command's children would)."""
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def ready(self) -> bool:
        """Wait (once) for the fork server's imports; False where it failed to start."""
        if self._ready is None:
            with self._io:
                ready, _, _ = select.select([self.sock], [], [], START_TIMEOUT_S)
                message = self.sock.recv(4096) if ready else b""
                self._ready = message == b"ready"
        return self._ready

    def spawn(self, args: list[str], log, stdout_pipe: bool, stdin_pipe: bool) -> Forked | None:
        """Fork ``args``'s server with its standard streams: stdin /dev/null or a pipe, stdout ``log`` or a pipe,
        stderr ``log``."""
        ours, theirs = [], []
        try:
            if stdin_pipe:
                r, w = os.pipe()
                theirs.append(r)
                ours.append(w)
            else:
                theirs.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            if stdout_pipe:
                r, w = os.pipe()
                theirs.append(w)
                ours.append(r)
            else:
                theirs.append(os.dup(log.fileno()))
            theirs.append(os.dup(log.fileno()))
            request = json.dumps({"module": FORKED_MODULES[args[2]], "argv": args[3:], "cwd": os.getcwd()}).encode()
            with self._io:
                socket.send_fds(self.sock, [request], theirs)
                pid, pidfd = self._reply()
        except (OSError, RuntimeError):
            for fd in ours:
                os.close(fd)
            self._ready = False  # (the fork server is gone: the next start makes another)
            return None
        finally:
            for fd in theirs:
                os.close(fd)
        stdin = os.fdopen(ours.pop(0), "wb") if stdin_pipe else None
        stdout = os.fdopen(ours.pop(0), "rb", buffering=0) if stdout_pipe else None
        child = self.children[pid] = Forked(self, args, pid, pidfd, stdout, stdin)
        return child

    def _reply(self) -> tuple[int, int]:
        """The fork server's answer to a spawn (exit reports before it are taken in). Holds ``_io``."""
        while True:
            data, fds, _, _ = socket.recv_fds(self.sock, 4096, 1)
            if not data:
                raise RuntimeError("the fork server closed its socket")
            message = json.loads(data)
            if "exit" in message:
                self._exit(message)
                continue
            if "error" in message or not fds:
                for fd in fds:
                    os.close(fd)
                raise RuntimeError(f"the fork server could not fork: {message.get('error')}")
            return int(message["pid"]), fds[0]

    def _exit(self, message: dict) -> None:
        child = self.children.pop(int(message["exit"]), None)
        if child is not None:
            child._exited(int(message["status"]))

    def wait(self, child: Forked, timeout: float | None) -> bool:
        """Take exit reports until ``child``'s, for up to ``timeout`` seconds (None: without end); whether it came."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while child.returncode is None:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            with self._io:
                if child.returncode is not None:
                    break
                ready, _, _ = select.select([self.sock], [], [], 0.05 if remaining is None else min(remaining, 0.05))
                if ready:
                    data = self.sock.recv(4096)
                    if not data:
                        raise RuntimeError(f"the fork server died; {child.args[2]} (pid {child.pid}) is orphaned")
                    self._exit(json.loads(data))
                    continue
            if remaining is not None and remaining <= 0:
                return False
        return True


def _serve_forks(fd: int) -> None:
    """The fork server's loop (see :class:`ForkServer`): import the servers once, then fork one per request and
    report each exit. It ends when the test process closes its end (it exits)."""
    import importlib

    sock = socket.socket(fileno=fd)
    for module in FORKED_MODULES.values():
        importlib.import_module(module)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the tests and their servers, not for this loop
    sock.send(b"ready" if threading.active_count() == 1 else b"threads")  # (a fork of a threaded process is unsafe)
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                sock.send(json.dumps({"exit": pid, "status": status}).encode())
        if sock in ready:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
            if not data:
                os._exit(0)  # the test process is gone
            request = json.loads(data)
            try:
                pid = os.fork()
            except OSError as exc:
                sock.send(json.dumps({"error": str(exc)}).encode())
                for f in fds:
                    os.close(f)
                continue
            if pid == 0:
                _run_forked(request, fds)
            pidfd = os.pidfd_open(pid)
            socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [pidfd])
            os.close(pidfd)
            for f in fds:
                os.close(f)


def _run_forked(request: dict, fds: list[int]) -> None:
    """In a forked child: become the server ``request`` names, as ``python -m`` would run it; never returns."""
    import atexit
    import importlib
    import traceback

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGCHLD else signal.default_int_handler)
        for target, f in enumerate(fds):
            os.dup2(f, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # as a command starts: nothing open but its standard streams
        os.chdir(request["cwd"])
        sys.argv = [request["module"]] + list(request["argv"])
        code = importlib.import_module(request["module"]).main(list(request["argv"]))
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        threading._shutdown()  # as the interpreter ends: wait for the threads it waits for, then its exit handlers
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


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
