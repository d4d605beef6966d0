"""Helpers every folder of the suite may use (see conftest.py for the conventions)."""
import json
import os
import threading
import time
from collections import OrderedDict
from typing import Callable, Hashable, Iterable

import zmq


def fill_up(path: str) -> None:
    """Take every page left on the file system of ``path`` (a file that grows until the system says no)."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY)
    try:
        for size in (1 << 20, 64 << 10, 4 << 10):
            while True:
                try:
                    os.posix_fallocate(fd, os.fstat(fd).st_size, size)
                except OSError:
                    break
    finally:
        os.close(fd)


def zmq_request(address: str, frames: list, timeout_ms: int = 5000) -> list[bytes] | None:
    """Send ``frames`` as they are to the ZeroMQ server at ``address`` (a DEALER of its own); the reply's frames,
    or None when none came within ``timeout_ms``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    try:
        sock.send_multipart(frames)
        if not sock.poll(timeout_ms):
            return None
        return sock.recv_multipart()
    finally:
        sock.close(0)


#: A ZMTP 3.0 greeting (signature, version 3.0, mechanism NULL, as-server 0, filler) and the NULL mechanism's READY
#: command (a short command frame naming the socket type DEALER): what a ZeroMQ peer without keys says first.
ZMTP_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + bytes(31)
_READY_BODY = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
ZMTP_READY = b"\x04" + bytes([len(_READY_BODY)]) + _READY_BODY


def proc_status(pid: int, field: str) -> int:
    """A number from /proc/<pid>/status (kB for the memory fields, a count for Threads)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def manifest_objects(path: str) -> int:
    """How many objects the catalogue next to the segment file ``path`` lists; -1 where there is none to read."""
    try:
        with open(path + ".manifest", encoding="utf-8") as f:
            return len(json.load(f)["objects"])
    except (OSError, ValueError):
        return -1


def segment_memory(pid: int) -> str:
    """A path through /proc to the memory of the segment process ``pid`` (its memfd), for a test that changes bytes
    behind the segment's back (it opens even while the segment is stopped)."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"/memfd:engram-segment-{pid}"):
            return f"/proc/{pid}/fd/{fd}"
    raise AssertionError(f"segment process {pid} holds no segment memory")


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms until it holds; fail the test naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def outcome_within(call: Callable[[], object], timeout_s: float, what: str) -> BaseException | None:
    """Run ``call()`` in a thread of its own and return the exception it raised (None if it returned); fail the test
    naming ``what`` if it has not ended after ``timeout_s`` (a reader blocked on a named pipe never would: the
    thread is a daemon, left behind)."""
    ended: list = []

    def run() -> None:
        try:
            call()
            ended.append(None)
        except Exception as exc:  # noqa: BLE001 (handed to the test)
            ended.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert ended, f"{what} was still blocked after {timeout_s:g} s"
    return ended[0]


def flip_byte(path: str, offset: int, mask: int = 0x40) -> None:
    """Flip bits ``mask`` of the byte at ``offset`` of the file ``path`` (bytes that rot at rest); past the end of
    the file, nothing."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        if byte:
            f.seek(offset)
            f.write(bytes([byte[0] ^ mask]))


def run_threads(work: Callable[[int], None], count: int, timeout_s: float, what: str = "a thread") -> None:
    """Run ``work(0)`` .. ``work(count - 1)`` in threads at once and wait for them: a thread still running after
    ``timeout_s`` fails the test, and so does the first exception any of them raised."""
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            work(seed)
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
        assert not t.is_alive(), f"{what} did not finish within {timeout_s:g} s"
    assert not errors, errors[0]


def read_ranges_served(store, timeout_s: float = 10.0) -> int:
    """read_ranges requests the embedded segment of ``store`` has served so far, once the count has held still for
    longer than a serving thread may keep reads it answered in its kernel out of the metrics (it counts them when no
    other read came within ``SETTLE_S`` of the last reply, or after 64)."""
    from engram_store.raw import limits

    def count() -> int:
        return sum(int(float(line.split()[-1])) for line in store.local_segment.server.metrics.render()
                   if line.startswith('engram_requests_total{op="read_ranges"}'))

    quiet_s = limits.SETTLE_S + 0.1
    deadline = time.monotonic() + timeout_s
    last = count()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = count()
        if now == last:
            return now
        last = now
    return last


class TcpProxy:
    """A TCP forwarder to ``upstream`` (``host:port``) on a free port of 127.0.0.1 (``address``), in a thread of its
    own: a client connected through it is cut off from ``upstream`` while it is frozen (:meth:`freeze`: nothing is
    forwarded either way and no connection is answered; the connections stay open, as under a partition that drops
    packets), until :meth:`thaw`. A context manager; :meth:`close` closes every socket and joins the thread."""

    def __init__(self, upstream: str):
        import selectors
        import socket

        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._peers: dict = {}  # socket -> the socket it forwards to
        self._frozen = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="test-tcp-proxy")
        self._thread.start()

    def freeze(self) -> None:
        self._frozen.set()

    def thaw(self) -> None:
        self._frozen.clear()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._frozen.is_set():
                self._stop.wait(0.02)
                continue
            for key, _ in self._selector.select(timeout=0.02):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._forward(key.fileobj)

    def _accept(self) -> None:
        import selectors
        import socket

        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            server = socket.create_connection(self._upstream, timeout=5)
        except OSError:
            client.close()
            return
        for sock, peer in ((client, server), (server, client)):
            sock.setblocking(True)
            self._peers[sock] = peer
            self._selector.register(sock, selectors.EVENT_READ, None)

    def _forward(self, sock) -> None:
        peer = self._peers.get(sock)
        try:
            data = sock.recv(1 << 16)
            if data:
                peer.sendall(data)
                return
        except OSError:
            pass
        for s in (sock, peer):  # one side closed: close both
            if s in self._peers:
                self._selector.unregister(s)
                del self._peers[s]
                s.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for sock in list(self._peers):
            sock.close()
        self._peers.clear()
        self._selector.close()
        self._listener.close()

    def __enter__(self) -> "TcpProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def exact_lru_hits(stream: Iterable[Hashable], size: float) -> int:
    """How many of ``stream``'s keys an exact LRU cache of ``int(size)`` keys finds (the twin miss-ratio curves are
    held to)."""
    lru: OrderedDict = OrderedDict()
    hits = 0
    for key in stream:
        if key in lru:
            hits += 1
            lru.move_to_end(key)
        else:
            lru[key] = None
            if len(lru) > int(size):
                lru.popitem(last=False)
    return hits
