"""One page over plain HTTP (a metrics page), served so that no peer, and no flood, can hold the process.

``http.server``'s threading server gave each connection a thread and waited on it for ever: a user who opened a
thousand connections and sent nothing held a thousand threads and descriptors, until the process could open no
file. :class:`PageServer` serves from one thread (``selectors``: epoll on Linux) with fixed bounds:

* at most :data:`MAX_CONNECTIONS` connections at once, :data:`PER_PEER` of them from one peer (an address, and the
  user for a connection from this host: ``_peers.PeerNames``); a peer past its share loses its oldest connection
  that has not sent a whole request, and when the server is full the peer holding the most loses its oldest;
* a request must arrive whole (at most :data:`MAX_REQUEST_BYTES`) within :data:`REQUEST_TIMEOUT_S` of the connection,
  and its answer be taken within :data:`SEND_TIMEOUT_S` (plus its size at :data:`SEND_MIN_BYTES_PER_S`);
* one request per connection (``Connection: close``); only ``GET`` and ``HEAD`` of the page's path are answered
  200, anything else gets its status (400, 404, 405, 431) and the connection is closed.

The page is rendered in the serving thread when a request is whole, so a scrape sees the values of that moment;
refusals are logged at a bounded rate (``_peers.REFUSALS``).
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from typing import Callable

from ._peers import REFUSALS, Holders, PeerNames

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 32
PER_PEER = 8
REQUEST_TIMEOUT_S = 5.0
SEND_TIMEOUT_S = 10.0
SEND_MIN_BYTES_PER_S = 1 << 20
MAX_REQUEST_BYTES = 8192
#: How often the loop looks for connections past their deadline.
SWEEP_S = 0.25
_LISTENER, _WAKE = object(), object()
_REASONS = {400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 431: "Request Header Fields Too Large",
            500: "Internal Server Error"}


class _Client:
    __slots__ = ("sock", "peer", "deadline", "request", "reply", "sent")

    def __init__(self, sock: socket.socket, peer: str, deadline: float):
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.request = bytearray()
        self.reply: bytes | None = None  # set once the request is whole
        self.sent = 0


class PageServer:
    """``GET path`` on ``host:port`` (0: any free port, in ``.port``) from one daemon thread, answered with what
    ``body()`` returns then (``text/plain`` as Prometheus reads it). Raises OSError when it cannot bind.
    ``close()`` stops it (idempotent)."""

    def __init__(self, host: str, port: int, path: str, body: Callable[[], bytes], *, name: str = "metrics"):
        self.path = path
        self._body = body
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(64)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._where = f"{name} http://{host}:{self.port}{path}"
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._holders = Holders(per_peer=PER_PEER, unproven_per_peer=PER_PEER)
        self._names = PeerNames()
        self._paused_until = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"engram-{name}-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # ---- the loop ------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        next_sweep = time.monotonic() + SWEEP_S
        try:
            while not self._closed:
                for key, mask in self._sel.select(max(0.0, next_sweep - time.monotonic())):
                    try:
                        if key.data is _LISTENER:
                            self._accept()
                        elif key.data is not _WAKE:
                            self._serve(key.data, mask)
                    except Exception:  # a bug: log it, drop that connection, keep serving
                        log.exception("%s: serving a connection failed", self._where)
                        if isinstance(key.data, _Client):
                            self._drop(key.data)
                now = time.monotonic()
                if now >= next_sweep:
                    next_sweep = now + SWEEP_S
                    self._sweep(now)
        finally:
            self._shut()

    def _accept(self) -> None:
        for _ in range(16):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    REFUSALS.refused(self._where, None, f"cannot accept connections: {exc.strerror}")
                    self._sel.unregister(self._listener)  # for a moment, rather than spin on a ready listener
                    self._paused_until = time.monotonic() + 0.1
                return
            named = self._names.name(sock)
            if named is None:
                sock.close()
                continue
            sock.setblocking(False)
            c = _Client(sock, named[0], time.monotonic() + REQUEST_TIMEOUT_S)
            self._holders.add(c, named[1])
            self._sel.register(sock, selectors.EVENT_READ, c)
            self._make_room(c, named[1])

    def _make_room(self, c: _Client, peer: str) -> None:
        """Hold the caps: a peer past its share loses its oldest connection without a whole request (else the new
        one); a full server, the oldest of the peer holding the most such connections (else the new one)."""
        holders = self._holders
        if holders.over_cap(peer):
            victim = holders.oldest_unproven(peer) or c
            REFUSALS.refused(self._where, victim.peer, f"{peer} holds {PER_PEER} connections, as many as one peer "
                                                       "may; closed its oldest")
            self._drop(victim)
        elif holders.count > MAX_CONNECTIONS:
            victim = holders.busiest_unproven() or c
            REFUSALS.refused(self._where, victim.peer, f"{MAX_CONNECTIONS} connections are open, as many as this page "
                                                       "serves at once; closed the oldest of the peer holding most")
            self._drop(victim)

    def _serve(self, c: _Client, mask: int) -> None:
        if c.reply is None:
            try:
                data = c.sock.recv(MAX_REQUEST_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._drop(c)
                return
            c.request += data
            end = c.request.find(b"\r\n\r\n")
            if end < 0 and len(c.request) < MAX_REQUEST_BYTES:
                return
            self._answer(c, bytes(c.request[:end]) if end >= 0 else None)
        self._send(c)

    def _answer(self, c: _Client, head: bytes | None) -> None:
        """Make ``c``'s reply (None: a request past MAX_REQUEST_BYTES without its end)."""
        self._holders.proven(c)
        status, body, method = self._status(head)
        if status == 200:
            try:
                body = self._body()
            except Exception as exc:  # a scrape must get an answer, and the server go on
                log.warning("%s: rendering failed: %s", self._where, exc)
                status, body = 500, f"rendering the page failed: {exc}\n".encode()
        kind = "text/plain; version=0.0.4; charset=utf-8"
        head_lines = (f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\nContent-Type: {kind}\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("ascii")
        c.reply = head_lines + (b"" if method == "HEAD" else body)
        c.deadline = time.monotonic() + SEND_TIMEOUT_S + len(c.reply) / SEND_MIN_BYTES_PER_S
        self._sel.modify(c.sock, selectors.EVENT_WRITE, c)

    def _status(self, head: bytes | None) -> tuple[int, bytes, str]:
        """(status, body for a refusal, method) of a request's head."""
        if head is None:
            return 431, f"a request is at most {MAX_REQUEST_BYTES} bytes\n".encode(), ""
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, b"expected a request line: GET PATH HTTP/1.1\n", ""
        method, target = parts[0].decode("latin-1"), parts[1].decode("latin-1")
        if method not in ("GET", "HEAD"):
            return 405, b"only GET and HEAD are served here\n", method
        if target.split("?", 1)[0] != self.path:
            return 404, f"only {self.path} is served here\n".encode(), method
        return 200, b"", method

    def _send(self, c: _Client) -> None:
        try:
            c.sent += c.sock.send(memoryview(c.reply)[c.sent:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(c)
            return
        if c.sent >= len(c.reply):
            self._drop(c)

    def _sweep(self, now: float) -> None:
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)
        for key in list(self._sel.get_map().values()):
            c = key.data
            if isinstance(c, _Client) and now > c.deadline:
                what = "a request did not arrive whole" if c.reply is None else "the answer was not taken"
                REFUSALS.refused(self._where, c.peer, f"{what} in time; closed")
                self._drop(c)

    def _drop(self, c: _Client) -> None:
        self._holders.remove(c)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    def _shut(self) -> None:
        for key in list(self._sel.get_map().values()):
            if isinstance(key.data, _Client):
                self._drop(key.data)
        self._sel.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._names.close()
