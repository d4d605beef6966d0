"""Masters and segments forked from a process that imported them once (the test harness's fork server).

A master or segment started as ``python -m`` spends half a second importing (NumPy, Numba, ZeroMQ, the store) before
it does anything, and the suite starts hundreds. A fork server imports them once per test process and forks each
server a test asks for: the child runs the same ``main`` with the same arguments, descriptors, directory, umask and
environment, as a process of its own (its own pid, signals, exit code); only its parent is the fork server, which
reports its exit. A module may have read the environment, umask or open-files limit when it was imported, so each
set of them gets a fork server of its own (a test that changes them: see ``ForkServer.get``). A server run in a
network namespace (the prefix ``ip netns exec NAME``: the fault explorer's nodes, as root) is forked the same way
and joins the namespace itself before it runs (``setns``: its network is the namespace's, as under ``ip netns
exec``); any other prefix is a command (:func:`forked` answers None). Scripts a test registers in
:data:`FORKED_SCRIPTS` (the explorer's client) are forked too, run as ``python SCRIPT`` would run them.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

#: How long the fork server may take to import the servers' code.
START_TIMEOUT_S = 60.0

#: ``python -m`` modules that may be forked, and the module whose ``main(argv)`` each runs.
FORKED_MODULES = {"engram_store.master": "engram_store.master.cli",
                  "engram_store.segment.cli": "engram_store.segment.cli"}
#: Scripts (absolute paths) forked as ``python SCRIPT ...`` would run them, with ``sys.path[0]`` their directory: a
#: test adds its own (the fault explorer's client process). Their imports beyond the servers' are made after the fork.
FORKED_SCRIPTS: set[str] = set()
#: Set to 0 to start every server as a command (no fork server).
FORK_ENV = "ENGRAM_TEST_FORK"
#: Fork servers a test process keeps at once, one per set of conditions (see ForkServer.get).
MAX_SERVERS = 3
#: The one prefix a forked process may run under: a network namespace (the explorer's nodes).
NETNS_PREFIX = ["ip", "netns", "exec"]
#: Where ``ip netns`` keeps the namespaces it names, and setns(2)'s flag for a network namespace.
NETNS_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000


def forked(args: list[str], log, stdout_pipe: bool, stdin_pipe: bool) -> "Forked | None":
    """``args`` (``[ip netns exec NAME] python -m MODULE ...`` or ``python SCRIPT ...``, see above) forked from this
    process's fork server for its conditions, with stderr (and stdout unless ``stdout_pipe``) into ``log``; None
    where it cannot be: start it as a command."""
    request = _request(args)
    if request is None or os.environ.get(FORK_ENV, "1") == "0":
        return None
    server = ForkServer.get()
    return server.spawn(args, request, log, stdout_pipe, stdin_pipe) if server is not None else None


def _request(args: list[str]) -> dict | None:
    """What the fork server is asked to run for ``args``; None where it cannot run it."""
    if sys.executable not in args:
        return None
    at = args.index(sys.executable)
    prefix, command = args[:at], args[at + 1:]
    if prefix and (len(prefix) != len(NETNS_PREFIX) + 1 or prefix[:-1] != NETNS_PREFIX or "/" in prefix[-1]):
        return None
    netns = {"netns": prefix[-1]} if prefix else {}
    if len(command) >= 2 and command[0] == "-m" and command[1] in FORKED_MODULES:
        return {"module": FORKED_MODULES[command[1]], "argv": command[2:], "cwd": os.getcwd(), **netns}
    if command and command[0] in FORKED_SCRIPTS:
        return {"script": command[0], "argv": command[1:], "cwd": os.getcwd(), **netns}
    return None


def _conditions() -> tuple:
    """What a forked server inherits from the fork server rather than from the test process at the time."""
    import resource

    mask = os.umask(0)
    os.umask(mask)
    # (not pytest's own variables: they name the test running, which no server reads)
    env = tuple(sorted((k, v) for k, v in os.environ.items() if not k.startswith("PYTEST_")))
    return (env, mask, resource.getrlimit(resource.RLIMIT_NOFILE), sys.executable, os.geteuid(), os.getegid())


class Forked:
    """A server forked by the fork server: the part of ``subprocess.Popen`` that tests use (``pid``, ``poll``,
    ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``, ``stdout``, ``stdin``). Signals go through
    a pidfd (never to another process that took the pid); the exit code comes from the fork server."""

    def __init__(self, server: "ForkServer", args: list[str], pid: int, pidfd: int, stdout, stdin):
        self.server, self.args, self.pid, self.pidfd = server, args, pid, pidfd
        self.stdout, self.stdin, self.returncode = stdout, stdin, None

    def poll(self) -> int | None:
        """The exit code once the process has exited, as ``Popen.poll`` (its pidfd says so at once; the fork
        server's report, which carries the code, follows within moments), else None."""
        if self.returncode is None:
            self.server.wait(self, 0.0)
            if self.returncode is None and select.select([self.pidfd], [], [], 0)[0]:
                self.server.wait(self, START_TIMEOUT_S)
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

    _servers: "dict[tuple, ForkServer]" = {}  # by the conditions each started under, the most recently used last
    _failed = False
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> "ForkServer | None":
        """The fork server for the test process's conditions as they are now: started on first use (a second,
        while it imports), again where it died; one per set of conditions (a test that changed its environment
        gets one of its own, at most :data:`MAX_SERVERS`: the least recently used idle one is stopped for it). None
        where that many are busy, where one failed to start, or where this host has no pidfds (Linux < 5.3)."""
        if cls._failed or not hasattr(os, "pidfd_open"):
            return None
        conditions = _conditions()
        with cls._lock:
            if any(server.owner != os.getpid() for server in cls._servers.values()):
                cls._servers = {}  # a forked test process: its parent's fork servers are not its own
            server = cls._servers.pop(conditions, None)
            if server is not None and not server.alive():
                server.close()
                server = None
            if server is None:
                idle = [c for c, other in cls._servers.items() if not other.children]
                if len(cls._servers) >= MAX_SERVERS and not idle:
                    return None
                if len(cls._servers) >= MAX_SERVERS:
                    cls._servers.pop(idle[0]).close()
                server = cls(conditions)
            cls._servers[conditions] = server
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
        code = f"from engram_store.testing._forks import serve_forks; serve_forks({there.fileno()})"
        self.proc = subprocess.Popen([sys.executable, "-u", "-c", code], pass_fds=[there.fileno()],
                                     stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
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

    def spawn(self, args: list[str], request: dict, log, stdout_pipe: bool, stdin_pipe: bool) -> Forked | None:
        """Fork ``request`` (what ``args`` runs) with its standard streams: stdin /dev/null or a pipe, stdout ``log``
        or a pipe, stderr ``log``."""
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
            with self._io:
                socket.send_fds(self.sock, [json.dumps(request).encode()], theirs)
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
                        raise RuntimeError(f"the fork server died; {' '.join(child.args[:5])} (pid {child.pid}) is "
                                           "orphaned")
                    self._exit(json.loads(data))
                    continue
            if remaining is not None and remaining <= 0:
                return False
        return True


def serve_forks(fd: int) -> None:
    """The fork server's loop (see the fork server): import the servers once, then fork one per request and
    report each exit. It ends when the test process closes its end (it exits), or is gone."""
    sock = socket.socket(fileno=fd)
    try:
        _serve_forks(sock)
    except (BrokenPipeError, ConnectionResetError):
        os._exit(0)


def _serve_forks(sock: socket.socket) -> None:
    import importlib

    for module in FORKED_MODULES.values():
        importlib.import_module(module)
    from engram_store import kernels

    kernels.warmup()  # the store's kernels in memory: a forked process does not load each from the disk cache again
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


def _join_network_namespace(name: str) -> None:
    """Move this (single-threaded, just forked) process into the network namespace ``ip netns`` named ``name``;
    the threads it starts are in it too. Exits 1 saying why where it cannot, as ``ip netns exec`` would."""
    import ctypes

    try:
        fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        print(f"Cannot open network namespace \"{name}\": {exc.strerror}", file=sys.stderr)
        os._exit(1)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        print(f"setting the network namespace \"{name}\" failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        os._exit(1)
    os.close(fd)


def _run_forked(request: dict, fds: list[int]) -> None:
    """In a forked child: become the server or script ``request`` names, as ``python -m`` or ``python SCRIPT`` would
    run it; never returns."""
    import atexit
    import importlib
    import runpy
    import traceback

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGCHLD else signal.default_int_handler)
        for target, f in enumerate(fds):
            os.dup2(f, target)
        if "netns" in request:
            _join_network_namespace(request["netns"])
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # as a command starts: nothing open but its standard streams
        os.chdir(request["cwd"])
        if "script" in request:
            sys.argv = [request["script"]] + list(request["argv"])
            sys.path[0] = os.path.dirname(request["script"])
            runpy.run_path(request["script"], run_name="__main__")
            code = 0
        else:
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
