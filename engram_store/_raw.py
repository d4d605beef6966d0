"""The raw read channel: range reads over plain TCP sockets, for lookups at the speed of the network stack.

A ZeroMQ request passes through I/O threads on both ends; on loopback a bare pyzmq round trip costs ~100 us
where a blocking TCP socket answers in ~30 us. Lookups are small reads on the critical path of every model
step, so segments also serve ``read_ranges`` on a plain TCP port. Everything else (writes, pings, metadata)
stays on ZeroMQ, and a client reads over ZeroMQ wherever the raw channel is off, unreachable, full or busy.

Wire format, version 2 (little-endian). Every message starts with a 24-byte header ``<4sHHQQ``: magic
``b"ENGR"``, version, op or status, request id, count; then the body:

* request ``op=2`` (hello): ``count`` = 32 and a 32-byte one-time token. A segment started with CURVE keys
  requires it as a connection's first message, so what a stranger can make it read is one fixed 56-byte
  message;
* request ``op=1`` (read): ``count`` pairs of int64 (offset, length), the ranges of the segment to send back;
* reply: status 0 and ``count`` bytes of the gathered ranges, back to back; or an error status (1 invalid
  argument, 2 protocol, 3 authentication, 4 other, 5 busy) and ``count`` bytes of a UTF-8 message naming what
  was wrong and the endpoint.

Busy (5) means "read this over ZeroMQ", not "the segment is down": a segment whose channel is full answers a
new connection busy (request id 0) and closes it; a read whose ranges would take the segment past its bound on
request bytes in flight has its ranges read and dropped and is answered busy on a connection that stays open.
A client may send several requests before it receives (a client reading a large object does); replies come
in order. Version 1 took tokens of any length up to 1 KiB and had no busy status. A header of another version
is answered with a protocol error naming both versions, and the connection is closed; segments say their
version in their ping (``raw_version``), and a client of another version reads over ZeroMQ.

Authentication: when the segment runs with ``--auth``, a client first asks for a token on the segment's ZeroMQ
socket, main or reader (``op: "channel_token"``, so only a client holding the cluster's CURVE keys gets one),
then opens the TCP connection with it. A token is good for one connection within ``TOKEN_TTL_S``. The channel
authenticates who may read but does not encrypt; clients that need encryption read over ZeroMQ
(``raw_reads=False``).

Serving. One event-loop thread (``selectors``: epoll on Linux) holds every connection that is idle or has a
message only partly received: a socket and a 56-byte header buffer each, no thread and no other buffer. It
receives headers; before authentication it accepts only a hello, and a read is answered with an authentication
error and closed with its ranges unread. A read header goes to one of at most ``SERVING_THREADS`` serving
threads, which receives the ranges (they come with the header) into a buffer of its own, checks them, gathers
(GIL-free) and sends the reply, serves the requests that came behind it, then waits on the same connection for
the next: ``LINGER_S`` in a blocking receive (one call per request, so a client reading in a loop is served as
by a thread of its own), then up to ``STICKY_S`` in poll, giving the thread up at once when another request
waits for one; a connection that stays quiet goes back to the loop. Ranges that come slowly go back to the loop too, which receives them
into a buffer counted against ``BODY_BYTES_IN_FLIGHT`` (as are ranges beyond ``REQUEST_KEEP_BYTES``); past it a
read is answered busy. A reply above ``STREAM_MIN_BYTES`` goes out in pieces of at most ``STREAM_PIECE_BYTES``
through two halves of the thread's reply buffer (a helper gathers piece k + 1 while piece k is sent), and a
range of a piece's size or more goes out straight from the segment's memory; so a serving thread keeps at most
``STREAM_MIN_BYTES + REQUEST_KEEP_BYTES`` of buffers, and drops them after ``SERVING_IDLE_S`` without work.

Deadlines: a new connection must complete its first message (its hello, with ``--auth``) within
``HELLO_TIMEOUT_S``; any message must arrive whole within ``MESSAGE_TIMEOUT_S`` of its first byte (a drip
cannot outlive it); a connection idle for ``IDLE_TIMEOUT_S`` is closed (clients reconnect and ask again,
reads being idempotent); a reply must be taken within ``SEND_TIMEOUT_S`` plus its size at
``SEND_MIN_BYTES_PER_S``. At ``MAX_CONNECTIONS`` (or what the open-files limit allows) a new connection first
displaces the oldest one that has not completed a message, else it is answered busy. Refusals and deadlines
are counted (:meth:`RawReadServer.stats`, in the segment's ping as ``raw_stats``) and logged at WARNING at most
once per peer and reason every ``_auth.REFUSAL_LOG_INTERVAL_S``.

A bad request gets an error reply and the connection keeps serving; a message whose framing cannot be
trusted (wrong magic or version, an absurd count, a read before the token) gets the reply and then the
connection is closed.
"""

from __future__ import annotations

import collections
import errno
import logging
import mmap
import os
import queue
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from . import kernels as _kernels
from ._auth import REFUSALS
from ._errors import AuthError, EngramError, InvalidArgument, ProtocolError, RemoteError, SegmentUnavailable

log = logging.getLogger(__name__)

MAGIC = b"ENGR"
VERSION = 2
HEADER = struct.Struct("<4sHHQQ")
OP_READ = 1
OP_HELLO = 2
STATUS_OK = 0
STATUS_BUSY = 5
#: A token's bytes: a hello is one fixed message of HELLO_BYTES.
TOKEN_BYTES = 32
HELLO_BYTES = HEADER.size + TOKEN_BYTES
#: Error statuses and the exception a client raises for each.
_STATUS_ERRORS = {1: InvalidArgument, 2: ProtocolError, 3: AuthError, 4: RemoteError}
_ERROR_STATUS = {InvalidArgument: 1, ProtocolError: 2, AuthError: 3}

#: How long a token handed out over ZeroMQ may wait for its connection, and how many may wait at once.
TOKEN_TTL_S = 60.0
MAX_TOKENS = 4096
#: A new connection must complete its first message (the hello, with --auth) within this: a client sends it as
#: soon as it connects, so only a stranger or a wedged client waits this long.
HELLO_TIMEOUT_S = 5.0
#: Any message must arrive whole within this of its first byte (a header and up to 64 MiB of ranges: 6 s at
#: 10 MB/s), however slowly it drips.
MESSAGE_TIMEOUT_S = 10.0
#: A connection with no request for this long is closed (clients reconnect transparently).
IDLE_TIMEOUT_S = 60.0
#: A reply must be taken by the client within SEND_TIMEOUT_S plus its size at SEND_MIN_BYTES_PER_S (a 256 MiB
#: reply: 26 s); a client that stops reading loses its connection, not a serving thread.
SEND_TIMEOUT_S = 10.0
SEND_MIN_BYTES_PER_S = 16 << 20
#: After a reply, a serving thread waits on the connection for its next request, LINGER_S in a blocking receive
#: (one call per request: a client reading in a loop keeps a thread, as with a thread per connection), then up
#: to STICKY_S more in poll, ready to give the thread up at once to a request that waits for one; then the
#: connection goes back to the event loop. A model step's lookups come tens of ms apart: one thread hand-off
#: less each.
LINGER_S = 0.05
STICKY_S = 5.0
#: Connections held at once (at most the open-files limit less FD_RESERVE); past this a new one displaces the
#: oldest that has not completed a message yet, else it is answered busy and the client reads over ZeroMQ.
MAX_CONNECTIONS = 4096
FD_RESERVE = 128
#: Threads that gather and send replies: the gather releases the GIL, so a few serve many clients.
SERVING_THREADS = 16
#: A serving thread with no request for this long drops its buffers.
SERVING_IDLE_S = 10.0
#: Bytes of request ranges in buffers of their own (ranges that come slowly, or past REQUEST_KEEP_BYTES) at once,
#: over all connections: four of the largest lookup rounds (2^20 ranges, 16 MiB), or one request of the most
#: ranges (64 MiB). Past it a read is answered busy.
BODY_BYTES_IN_FLIGHT = 64 << 20
#: A reply larger than this is sent in pieces of at most STREAM_PIECE_BYTES (a range of a piece's size or more
#: is a piece of its own, sent straight from the segment), gathered into two halves of a serving thread's
#: buffer, which therefore never exceeds this; the client receives one piece while the next is gathered.
STREAM_MIN_BYTES = 2 << 20
STREAM_PIECE_BYTES = STREAM_MIN_BYTES // 2
#: A serving thread receives a request's ranges into a buffer of its own (kept while it serves) up to this size
#: (65536 ranges: a full-size prefill lookup of one layer, reused without a page fault); larger ones, and ranges
#: the loop receives, get a buffer of their own, counted in flight. The buffer starts with room for SMALL_RANGES.
REQUEST_KEEP_BYTES = 1 << 20
SMALL_RANGES = 4096
#: Request buffers at least this large are mapped on their own, so their memory goes back to the system at once.
MMAP_MIN_BYTES = 256 << 10
#: How often the event loop looks for connections past a deadline.
SWEEP_S = 0.25

# Receiving states of a connection, and what advancing it can end in.
_HEAD, _TOKEN, _BODY, _DROP = range(4)
_READY, _WAIT, _GONE = range(3)
_LISTENER, _WAKE = object(), object()
_NO_PAIRS = np.zeros(0, dtype=np.uint8)


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False if the peer closed the connection before the first byte."""
    got = 0
    n = view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return False
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return True


def _request_buffer(n: int) -> np.ndarray:
    """A writable uint8 buffer of ``n`` bytes; a large one is a mapping of its own, unmapped when dropped."""
    if n < MMAP_MIN_BYTES:
        return np.empty(n, dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)


def _open_files_cap(requested: int) -> int:
    """``requested`` connections, or fewer where the process's open-files limit would run out first."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return requested
    if soft == resource.RLIM_INFINITY:
        return requested
    return min(requested, max(16, soft - FD_RESERVE))


class _Buffers:
    """A serving thread's buffers, grown on demand and dropped when it is idle: the reply (at most
    STREAM_MIN_BYTES) and the requests received from the connection it serves (a header and at most
    REQUEST_KEEP_BYTES of ranges; ``request[start:end]`` holds bytes received and not used yet: the start of the
    next request, or whole requests a client sent ahead)."""

    __slots__ = ("reply", "request", "start", "end")

    def __init__(self) -> None:
        self.reply: np.ndarray | None = None
        self.request: np.ndarray | None = None
        self.start = self.end = 0

    def drop(self) -> None:
        self.reply = self.request = None
        self.start = self.end = 0

    def room(self, nbytes: int) -> np.ndarray | None:
        """The request buffer, with room for ``request[start:start + nbytes]`` and ``start`` 8-byte aligned (the
        bytes not used yet kept), or None past a header and REQUEST_KEEP_BYTES."""
        if nbytes > HEADER.size + REQUEST_KEEP_BYTES:
            return None
        buf = self.request
        if buf is None or buf.size < nbytes:
            size = HEADER.size + min(REQUEST_KEEP_BYTES, max(nbytes - HEADER.size, 16 * SMALL_RANGES,
                                                             0 if buf is None else 2 * (buf.size - HEADER.size)))
            grown = np.empty(size, dtype=np.uint8)
            if self.end > self.start:
                grown[:self.end - self.start] = buf[self.start:self.end]
            buf, self.request, self.end, self.start = grown, grown, self.end - self.start, 0
        elif self.start + nbytes > buf.size or self.start % 8:
            buf[:self.end - self.start] = buf[self.start:self.end].copy()
            self.end, self.start = self.end - self.start, 0
        return buf


class _Conn:
    """One connection's state: a few fields and a hello-sized buffer (the loop may hold thousands)."""

    __slots__ = ("sock", "peer", "head", "got", "state", "body", "reserved", "borrowed", "slow", "left",
                 "request_id", "count", "accepted", "msg_start", "last_active", "authenticated", "pending",
                 "in_loop", "fed")

    def __init__(self, sock: socket.socket, peer: str, now: float, authenticated: bool):
        self.sock = sock
        self.peer = peer
        self.head = bytearray(HELLO_BYTES)  # a header, or a hello's header and token
        self.got = 0  # bytes of the current part received
        self.state = _HEAD
        self.body: np.ndarray | None = None  # the ranges of a read being received (None: no buffer yet)
        self.reserved = 0  # bytes of BODY_BYTES_IN_FLIGHT held for ``body``
        self.borrowed = False  # ``body`` is a serving thread's buffer
        self.slow = False  # the ranges did not come with the header: the loop receives them
        self.left = 0  # bytes still to drop (_DROP)
        self.request_id = 0
        self.count = 0
        self.accepted = now
        self.msg_start = 0.0  # when the current message's first byte came; 0: between messages
        self.last_active = now
        self.authenticated = authenticated
        self.pending = True  # no complete message yet
        self.in_loop = True  # held by the event loop (else by a serving thread)
        self.fed = 0  # bytes _advance took from the data it was given

    def complete(self) -> bool:
        """Whether a whole read request is in (its ranges in ``body``)."""
        return self.state == _BODY and self.body is not None and self.got == 16 * self.count

    def next_message(self) -> None:
        self.state = _HEAD
        self.got = 0
        self.msg_start = 0.0
        self.slow = False


class RawReadServer:
    """Serves range reads of ``segment`` (a flat uint8 array) on a TCP port of ``host``; see the module docstring.

    ``max_ranges`` and ``max_bytes`` bound one request (as the ZeroMQ handler's limits do); ``require_token``
    makes a connection present a token from :meth:`issue_token` first; ``max_connections`` defaults to
    MAX_CONNECTIONS. The deadlines and bounds are the module's constants as they are when the server is built.
    """

    def __init__(self, host: str, segment: np.ndarray, *, port: int = 0, max_ranges: int, max_bytes: int,
                 require_token: bool = False, name: str = "segment", metrics: Any = None,
                 max_connections: int | None = None):
        if max_connections is not None and (isinstance(max_connections, bool) or not isinstance(max_connections, int)
                                            or max_connections < 1):
            raise InvalidArgument(f"max_connections: expected an integer >= 1, got {max_connections!r}")
        self.segment = _kernels.readonly(segment)
        self.metrics = metrics  # a RequestMetrics: raw reads count as op "read_ranges" with the ZeroMQ ones
        self.max_ranges = max_ranges
        self.max_bytes = max_bytes
        self.require_token = require_token
        self.name = name
        self.max_connections = _open_files_cap(MAX_CONNECTIONS if max_connections is None else max_connections)
        self.hello_timeout_s = HELLO_TIMEOUT_S
        self.message_timeout_s = MESSAGE_TIMEOUT_S
        self.idle_timeout_s = IDLE_TIMEOUT_S
        self.send_timeout_s = SEND_TIMEOUT_S
        self.serving_threads = SERVING_THREADS
        self.body_budget = BODY_BYTES_IN_FLIGHT
        self._sweep_s = min(SWEEP_S, self.hello_timeout_s / 4, self.message_timeout_s / 4, self.idle_timeout_s / 4)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
            self._listener.listen(1024)
            self._listener.setblocking(False)
        except OSError as exc:
            self._listener.close()
            raise SegmentUnavailable(f"{name}: cannot bind the raw read channel on {host}:{port}: {exc}") from exc
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._where = f"{name} raw read channel {self.address}"
        self._tokens: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # A byte here asks one lingering serving thread to give up its connection: a request waits for a thread.
        self._need_r, self._need_w = os.pipe()
        os.set_blocking(self._need_r, False)
        os.set_blocking(self._need_w, False)
        self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._accept_paused_until = 0.0
        # Held by the loop thread only: every open connection, and those with no complete message yet (oldest first).
        self._conns: set[_Conn] = set()
        self._pending: dict[_Conn, None] = {}
        # Shared under _lock: connections a serving thread holds, the hand-backs, the threads and the budget.
        self._busy: set[_Conn] = set()
        self._returns: collections.deque = collections.deque()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = 0
        self._idle_threads = 0
        self._queued = 0
        self._lingering = 0
        self._in_flight = 0
        self._drop_buf = bytearray(1 << 16)  # dropped bytes land here (any thread: their content is discarded)
        self._counts = collections.Counter()
        self._pool: ThreadPoolExecutor | None = None  # gathers the pieces of streamed replies
        self._thread = threading.Thread(target=self._loop, name=f"engram-raw-{name}", daemon=True)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "RawReadServer":
        self._thread.start()
        return self

    def issue_token(self) -> str:
        """A one-time token for one connection (hex), valid for TOKEN_TTL_S."""
        token = secrets.token_bytes(TOKEN_BYTES)
        now = time.monotonic()
        with self._lock:
            self._tokens = {t: exp for t, exp in self._tokens.items() if exp > now}
            while len(self._tokens) >= MAX_TOKENS:  # the oldest unused token goes first
                del self._tokens[next(iter(self._tokens))]
            self._tokens[token] = now + TOKEN_TTL_S
        return token.hex()

    def _take_token(self, token: bytes) -> bool:
        with self._lock:
            expires = self._tokens.pop(token, None)
        return expires is not None and expires > time.monotonic()

    def stats(self) -> dict[str, int]:
        """Connections, threads and bytes in flight now, and counts of refusals and deadlines since the start:
        ``refused_full`` (answered busy: the channel was full), ``displaced`` (closed to make room before a
        first message), ``busy`` (reads answered busy: too many request bytes in flight), ``refused_auth``
        (a read before the token, or a bad token), ``timeout_hello``, ``timeout_message``, ``timeout_idle``,
        ``timeout_send``, ``accept_errors``."""
        with self._lock:
            counts = dict(self._counts)
            out = {"connections": len(self._conns), "pending": sum(c.pending for c in list(self._pending)),
                   "serving": len(self._busy),
                   "serving_threads": self._threads, "body_bytes_in_flight": self._in_flight,
                   "max_connections": self.max_connections}
        for name in ("refused_full", "displaced", "busy", "refused_auth", "timeout_hello", "timeout_message",
                     "timeout_idle", "timeout_send", "accept_errors"):
            out[name] = counts.get(name, 0)
        return out

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    # ---- the event loop: accepting, receiving, deadlines -----------------------------------------

    def _loop(self) -> None:
        sel = self._sel
        next_sweep = time.monotonic() + self._sweep_s
        try:
            while not self._closed:
                events = sel.select(max(0.0, min(self._sweep_s, next_sweep - time.monotonic())))
                for key, _ in events:
                    data = key.data
                    try:
                        if data is _LISTENER:
                            self._accept()
                        elif data is _WAKE:
                            self._take_back()
                        elif data.in_loop:
                            self._on_readable(data)
                    except Exception:  # a bug: log it, drop that connection, keep serving the others
                        log.exception("%s: serving a connection failed", self._where)
                        if isinstance(data, _Conn):
                            self._forget(data)
                now = time.monotonic()
                if now >= next_sweep:
                    next_sweep = now + self._sweep_s
                    try:
                        self._sweep(now)
                    except Exception:  # a bug: log it, keep serving
                        log.exception("%s: looking for connections past a deadline failed", self._where)
        finally:
            self._shut_loop()

    def _accept(self) -> None:
        for _ in range(64):  # then back to the connections that have bytes
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._closed:
                    return
                self._count("accept_errors")
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self._displace_pending():
                        continue  # a descriptor is free again
                    REFUSALS.refused(self._where, None, f"cannot accept connections: {exc.strerror}")
                    self._sel.unregister(self._listener)  # for a moment, rather than spin on a ready listener
                    self._accept_paused_until = time.monotonic() + 0.1
                    return
                log.warning("%s: accept failed: %s", self._where, exc)
                return
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            if len(self._conns) >= self.max_connections and not self._displace_pending():
                self._count("refused_full")
                REFUSALS.refused(self._where, peer, f"the channel is full ({self.max_connections} connections); "
                                                    "answered busy, the client reads over ZeroMQ")
                message = (f"raw read channel {self.address}: busy ({self.max_connections} connections open); "
                           "read over ZeroMQ").encode()
                try:
                    sock.send(HEADER.pack(MAGIC, VERSION, STATUS_BUSY, 0, len(message)) + message,
                              socket.MSG_DONTWAIT)
                except OSError:
                    pass
                sock.close()
                continue
            try:
                sock.setblocking(True)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # Kernel-side timeouts for the serving threads' blocking calls (the loop never blocks: it
                # passes MSG_DONTWAIT): a lingering receive waits LINGER_S, a send that moves nothing fails.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(LINGER_S))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.send_timeout_s))
            except OSError:
                sock.close()
                continue
            c = _Conn(sock, peer, time.monotonic(), authenticated=not self.require_token)
            self._conns.add(c)
            self._pending[c] = None
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _displace_pending(self) -> bool:
        """Close the oldest connection that has not completed a message (a stranger holding a slot); False if none."""
        for c in list(self._pending):
            if not c.pending:  # completed a message in a serving thread since
                del self._pending[c]
            elif c.in_loop:
                self._count("displaced")
                REFUSALS.refused(self._where, c.peer, "closed a connection that had not completed a message, "
                                                      "to make room for a new one")
                self._forget(c)
                return True
        return False

    def _on_readable(self, c: _Conn) -> None:
        result = self._advance(c, socket.MSG_DONTWAIT, loop=True)
        if not c.pending:
            self._pending.pop(c, None)
        if result == _GONE:
            self._forget(c)
        elif result == _READY:  # a whole read, or its header with the ranges still to come
            self._sel.unregister(c.sock)
            c.in_loop = False
            self._dispatch(c)

    def _sweep(self, now: float) -> None:
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)
        for c in list(self._conns):
            if not c.in_loop:
                continue  # a serving thread's: bounded by LINGER_S and the send deadline
            if c.pending and now - c.accepted > self.hello_timeout_s:
                self._count("timeout_hello")
                if self.require_token:
                    REFUSALS.refused(self._where, c.peer, f"no token within {self.hello_timeout_s:g} s")
                else:
                    log.debug("%s: %s sent no complete request within %g s", self._where, c.peer,
                              self.hello_timeout_s)
            elif c.msg_start and now - c.msg_start > self.message_timeout_s:
                self._count("timeout_message")
                REFUSALS.refused(self._where, c.peer, f"a message did not arrive whole within "
                                                      f"{self.message_timeout_s:g} s")
            elif not c.msg_start and now - c.last_active > self.idle_timeout_s:
                self._count("timeout_idle")
                log.debug("%s: closing a connection from %s idle for %g s", self._where, c.peer,
                          self.idle_timeout_s)
            else:
                continue
            self._forget(c)

    def _forget(self, c: _Conn) -> None:
        """Close a connection the loop holds."""
        c.in_loop = False  # an event for it later in the same batch is ignored
        self._conns.discard(c)
        self._pending.pop(c, None)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        self._drop(c)

    def _drop(self, c: _Conn) -> None:
        self._release(c)
        try:
            c.sock.close()
        except OSError:
            pass

    def _take_back(self) -> None:
        """Connections the serving threads are done with: watch the live ones again, forget the closed ones."""
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._returns:
            c, alive = self._returns.popleft()
            if not alive:
                self._conns.discard(c)
                continue
            if not c.pending:
                self._pending.pop(c, None)
            c.in_loop = True
            self._sel.register(c.sock, selectors.EVENT_READ, c)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0", socket.MSG_DONTWAIT)
        except OSError:
            pass  # full: the loop has wake-ups to read already; closed: it is gone

    def _shut_loop(self) -> None:
        while self._returns:  # handed back but not watched yet
            c, alive = self._returns.popleft()
            if alive:
                self._drop(c)
        for c in list(self._conns):
            if c.in_loop:
                self._forget(c)
        for sock in (self._listener, self._wake_r):
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass
        self._listener.close()
        self._sel.close()

    # ---- receiving a message (the loop: MSG_DONTWAIT; a serving thread: MSG_WAITALL, LINGER_S at most) ----

    def _advance(self, c: _Conn, flags: int, data: memoryview | None = None, into: np.ndarray | None = None,
                 loop: bool = False) -> int:
        """Receive what ``c``'s current message still needs: _READY when a read request is complete (or, for the
        ``loop``, its header: a serving thread receives the ranges), _WAIT when more bytes must come first, _GONE
        when the connection must close (any error reply has been sent).

        ``data``: bytes a serving thread already received on ``c``, taken before the socket's (``c.fed`` says how
        many were taken: a request may be followed by the next). ``into``: a serving thread's request buffer, for
        ranges that fit (not counted in flight; moved out if ``c`` goes back to the loop half-way)."""
        sock = c.sock
        pos = c.fed = 0
        while True:
            state = c.state
            if state == _BODY and c.body is None:
                nbytes = 16 * c.count
                if loop and not c.slow:
                    return _READY  # the header: a serving thread receives the ranges (they come with it)
                if into is not None and nbytes <= into.size - HEADER.size:
                    c.body, c.borrowed = into[HEADER.size:HEADER.size + nbytes], True
                elif self._reserve(nbytes):
                    c.body, c.reserved = _request_buffer(nbytes), nbytes
                else:  # no room: receive and drop the ranges, answer busy
                    state = c.state = _DROP
                    c.left = nbytes - c.got
            if state == _HEAD:
                view = memoryview(c.head)[c.got:HEADER.size]
            elif state == _TOKEN:
                view = memoryview(c.head)[HEADER.size + c.got:HELLO_BYTES]
            elif state == _BODY:
                view = memoryview(c.body)[c.got:]
            else:
                view = memoryview(self._drop_buf)[:min(c.left, len(self._drop_buf))]
            want = len(view)
            fed = data is not None and pos < len(data)
            if fed:
                n = min(want, len(data) - pos)
                view[:n] = data[pos:pos + n]
                pos = c.fed = pos + n
            else:
                try:
                    n = sock.recv_into(view, want, flags)
                except (BlockingIOError, InterruptedError):
                    return self._wait(c)
                except OSError as exc:
                    log.debug("%s: connection from %s ended: %s", self._where, c.peer, exc)
                    return _GONE
                if n == 0:
                    return _GONE
            if not c.msg_start:
                c.msg_start = time.monotonic()
            if state == _DROP:
                c.left -= n
                done = c.left == 0
            else:
                c.got += n
                done = n == want
            if not done:
                if n < want and not fed:
                    return self._wait(c)  # nothing more has arrived (or a serving thread's wait ran out)
                continue  # the rest from the socket
            if state == _HEAD:
                result = self._on_header(c)
                if result is not None:
                    return result
            elif state == _TOKEN:
                if not self._on_token(c):
                    return _GONE
            elif state == _BODY:
                c.pending = False
                return _READY
            else:  # the ranges of a read refused for lack of room are dropped: answer busy, keep serving
                self._count("busy")
                REFUSALS.refused(self._where, c.peer, "requests in flight exceed the bound on their bytes; "
                                                      "answered busy, the client reads over ZeroMQ")
                message = (f"raw read channel {self.address}: busy (more than {self.body_budget} bytes of "
                           "requests in flight); read over ZeroMQ").encode()
                if not self._send_small(c, HEADER.pack(MAGIC, VERSION, STATUS_BUSY, c.request_id, len(message))
                                        + message):
                    return _GONE
                c.next_message()
                c.last_active = time.monotonic()

    def _wait(self, c: _Conn) -> int:
        """_WAIT: a read's ranges that are only partly in go on in the loop, in a buffer of their own."""
        if c.state == _BODY:
            c.slow = True
            if c.borrowed:
                c.borrowed = False
                partial, c.body = c.body, None
                nbytes = 16 * c.count
                if c.got and self._reserve(nbytes):
                    c.body, c.reserved = _request_buffer(nbytes), nbytes
                    c.body[:c.got] = partial[:c.got]
                elif c.got:
                    c.state, c.left = _DROP, nbytes - c.got
        return _WAIT

    def _on_header(self, c: _Conn) -> int | None:
        """Act on a complete header: None to go on receiving (a token, the ranges or bytes to drop), _READY for
        a read without ranges, _GONE after an error reply that closes the connection."""
        magic, version, op, request_id, count = HEADER.unpack_from(c.head)
        c.request_id = request_id
        if magic != MAGIC:
            return self._refuse(c, ProtocolError(f"raw read channel {self.address}: expected magic {MAGIC!r}, got "
                                                 f"{bytes(magic)!r}"))
        if version != VERSION:
            return self._refuse(c, ProtocolError(
                f"raw read channel {self.address}: this segment speaks version {VERSION}, the request is version "
                f"{version} (upgrade the older side, or read over ZeroMQ)"))
        if op == OP_HELLO:
            if count != TOKEN_BYTES:
                return self._refuse(c, ProtocolError(f"raw read channel {self.address}: hello: expected a token of "
                                                     f"{TOKEN_BYTES} bytes, got a count of {count}"))
            c.state, c.got = _TOKEN, 0
            return None
        if not c.authenticated:
            self._count("refused_auth")
            REFUSALS.refused(self._where, c.peer, "a request before the token")
            return self._refuse(c, AuthError(f"raw read channel {self.address}: this segment requires a token "
                                             "first (it runs with --auth)"))
        if op != OP_READ:
            return self._refuse(c, ProtocolError(f"raw read channel {self.address}: unknown op {op} (expected "
                                                 f"{OP_READ}, read, or {OP_HELLO}, hello)"))
        if count > self.max_ranges:
            return self._refuse(c, InvalidArgument(
                f"read_ranges: at most {self.max_ranges} ranges per request, got {count} ({self.address})"))
        c.count = count
        c.state, c.got, c.body = _BODY, 0, None
        if count == 0:
            c.body = _NO_PAIRS
            c.pending = False
            return _READY
        return None

    def _on_token(self, c: _Conn) -> bool:
        token = bytes(c.head[HEADER.size:HELLO_BYTES])
        if self.require_token and not self._take_token(token):
            self._count("refused_auth")
            REFUSALS.refused(self._where, c.peer, "an unknown or expired token")
            self._refuse(c, AuthError(f"raw read channel {self.address}: unknown or expired token (ask the segment "
                                      "for one with channel_token)"))
            return False
        c.authenticated = True
        c.pending = False
        if not self._send_small(c, HEADER.pack(MAGIC, VERSION, STATUS_OK, c.request_id, 0)):
            return False
        c.next_message()
        c.last_active = time.monotonic()
        return True

    def _refuse(self, c: _Conn, exc: Exception) -> int:
        """Answer ``exc`` on a connection whose framing can no longer be trusted; it closes."""
        self._send_small(c, _error_reply(c.request_id, exc))
        if self.metrics is not None:
            self.metrics.record("read_ranges", 0.0, False)
        return _GONE

    @staticmethod
    def _send_small(c: _Conn, data: bytes) -> bool:
        """Send a short reply without blocking: a client that does not take a few bytes is not reading."""
        try:
            return c.sock.send(data, socket.MSG_DONTWAIT) == len(data)
        except OSError:
            return False

    def _reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self._in_flight + nbytes > self.body_budget:
                return False
            self._in_flight += nbytes
            return True

    def _release(self, c: _Conn) -> None:
        c.body = None
        c.borrowed = False
        if c.reserved:
            with self._lock:
                self._in_flight -= c.reserved
            c.reserved = 0

    # ---- serving threads ------------------------------------------------------------------------

    def _dispatch(self, c: _Conn) -> None:
        with self._lock:
            self._busy.add(c)
            self._queued += 1
            short = self._queued > self._idle_threads
            spawn = short and self._threads < self.serving_threads
            if spawn:
                self._threads += 1
            nudge = short and not spawn and self._lingering > 0
        self._work.put(c)
        if nudge:
            try:
                os.write(self._need_w, b"\0")
            except OSError:
                pass  # full: lingering threads have been asked already
        if spawn:
            threading.Thread(target=self._serving_thread, name=f"engram-raw-{self.name}-serve",
                             daemon=True).start()

    def _serving_thread(self) -> None:
        bufs = _Buffers()
        while True:
            with self._lock:
                self._idle_threads += 1
            try:
                c = self._work.get(timeout=SERVING_IDLE_S)
            except queue.Empty:
                c = False
            with self._lock:
                self._idle_threads -= 1
                if c:
                    self._queued -= 1
            if c is None:
                return  # closing
            if c is False:
                bufs.drop()  # idle: give the buffers back
                continue
            self._serve(c, bufs)

    def _serve(self, c: _Conn, bufs: "_Buffers") -> None:
        """Answer ``c``'s read (receiving its ranges first where the loop handed over a header), then the reads
        that follow: those already received at once, and while no other connection waits for a thread, those
        that come within LINGER_S (then STICKY_S); then hand ``c`` back to the loop (or close it)."""
        alive = False
        sticky = False  # counted in _lingering: this thread waits on c between requests
        try:
            if c.complete():
                result = _READY
            else:
                result = self._advance(c, socket.MSG_WAITALL, into=bufs.room(HEADER.size + 16 * c.count))
            if result != _READY:
                alive = result == _WAIT  # the ranges are slow: the loop receives the rest
            else:
                request_id, pairs = c.request_id, c.body.view(np.int64).reshape(c.count, 2)
                while True:
                    self._answer(c.sock, request_id, pairs, bufs)
                    self._release(c)
                    c.next_message()
                    ahead = bufs.end > bufs.start  # sent before this reply: served now, whatever waits
                    if not ahead:
                        if self._closed or self._queued or not (sticky or self._start_linger()):
                            alive = True
                            break
                        sticky = True
                    request = self._next_request(c, bufs, wait=sticky)
                    if not isinstance(request, tuple):
                        alive = request == _WAIT  # quiet, or part of a message: the loop waits for the rest
                        break
                    request_id, pairs = request
        except TimeoutError as exc:
            self._count("timeout_send")
            REFUSALS.refused(self._where, c.peer, str(exc))
        except OSError as exc:
            if isinstance(exc, BlockingIOError):  # a send that moved nothing for SEND_TIMEOUT_S
                self._count("timeout_send")
                REFUSALS.refused(self._where, c.peer, f"a reply was not taken within {self.send_timeout_s:g} s")
            else:
                log.debug("%s: connection from %s ended: %s", self._where, c.peer, exc)
        except Exception:  # a bug: log it, drop this connection, keep serving the others
            log.exception("%s: serving a read from %s failed", self._where, c.peer)
        bufs.start = bufs.end = 0
        if not alive or self._closed:
            self._drop(c)
            alive = False
        c.last_active = time.monotonic()
        with self._lock:
            self._busy.discard(c)
            if sticky:
                self._lingering -= 1
        self._returns.append((c, alive))
        self._wake()

    def _start_linger(self) -> bool:
        """Whether this thread may wait on its connection for the next request: not while requests wait for a
        thread, and never as the last thread that does not."""
        with self._lock:
            if self._queued or self._lingering + 1 >= self.serving_threads:
                return False
            self._lingering += 1
            return True

    def _linger_more(self, c: _Conn) -> bool:
        """After LINGER_S: wait up to STICKY_S more for ``c`` to become readable (True), unless a request needs
        this thread first or the server closes (False)."""
        poller = select.poll()
        poller.register(c.sock, select.POLLIN)
        poller.register(self._need_r, select.POLLIN)
        deadline = time.monotonic() + STICKY_S
        while not self._closed and not self._queued:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for fd, _ in poller.poll(remaining * 1000):
                if fd != self._need_r:
                    return True
                try:
                    os.read(self._need_r, 1)
                    return False  # this thread goes to the waiting request
                except BlockingIOError:
                    pass  # another lingering thread went
        return False

    def _next_request(self, c: _Conn, bufs: "_Buffers", wait: bool) -> tuple | int:
        """The next read on ``c``: ``(request_id, pairs)``, or _WAIT (nothing, or part of a message: the loop
        takes over) or _GONE (closed). Bytes come into this thread's buffer as they are (a read of up to
        REQUEST_KEEP_BYTES of ranges is served from there, the hot path; a client may have sent several);
        anything else takes the general way. ``wait``: wait LINGER_S for bytes in a blocking receive, then
        STICKY_S in poll; else take only what has come."""
        sock = c.sock
        while True:
            start = bufs.start
            have = bufs.end - start
            if have >= HEADER.size:
                rq = bufs.request
                magic, version, op, request_id, count = HEADER.unpack_from(rq, start)
                need = HEADER.size + 16 * count
                if op != OP_READ or magic != MAGIC or version != VERSION or count > self.max_ranges:
                    return self._general(c, bufs, wait)
                if have >= need and not start % 8:  # the hot path: a whole read, its ranges aligned
                    bufs.start = start + need
                    return request_id, rq[start + HEADER.size:start + need].view(np.int64).reshape(count, 2)
                if bufs.room(need) is None:  # too large for this thread's buffer
                    return self._general(c, bufs, wait)
                if have >= need:
                    continue  # moved to an aligned start
            elif have == 0 and bufs.request is not None:
                bufs.start = bufs.end = 0  # nothing kept: receive from the buffer's start
            else:
                bufs.room(HEADER.size + 16 * SMALL_RANGES)
            view = memoryview(bufs.request)[bufs.end:]
            try:
                try:
                    n = sock.recv_into(view, 0, 0 if wait else socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    if not (wait and have == 0 and self._linger_more(c)):
                        raise
                    n = sock.recv_into(view, 0, socket.MSG_DONTWAIT)  # readable now: bytes, or the end
            except (BlockingIOError, InterruptedError):
                return self._general(c, bufs, False) if have else _WAIT
            except OSError as exc:
                log.debug("%s: connection from %s ended: %s", self._where, c.peer, exc)
                return _GONE
            if n == 0:
                return _GONE
            bufs.end += n

    def _general(self, c: _Conn, bufs: "_Buffers", wait: bool) -> tuple | int:
        """The next message of ``c`` by _advance, from the bytes in this thread's buffer on: anything but a read
        that fits the buffer, or part of a message going back to the loop."""
        data = memoryview(bufs.request)[bufs.start:bufs.end]
        result = self._advance(c, socket.MSG_WAITALL if wait else socket.MSG_DONTWAIT, data)
        bufs.start += c.fed
        if result != _READY:
            return result
        return c.request_id, c.body.view(np.int64).reshape(c.count, 2)

    def _answer(self, sock: socket.socket, request_id: int, pairs: np.ndarray, bufs: "_Buffers") -> None:
        """Check and gather ``pairs``, send the reply (through ``bufs.reply``, grown up to STREAM_MIN_BYTES).

        The request is counted in the metrics before its reply goes out (so a client that has the reply sees it
        counted)."""
        start = time.perf_counter()
        bad, total = _kernels.check_pairs(self.segment, pairs)
        if bad >= 0:
            return self._reply_error(sock, request_id, InvalidArgument(
                f"read_ranges: range {bad} (offset {int(pairs[bad, 0])}, length {int(pairs[bad, 1])}) is outside "
                f"the segment of {self.segment.size} bytes ({self.address})"))
        if total > self.max_bytes:
            return self._reply_error(sock, request_id, InvalidArgument(
                f"read_ranges: {total} bytes requested, at most {self.max_bytes} per request ({self.address})"))
        head = HEADER.pack(MAGIC, VERSION, STATUS_OK, request_id, total)
        timeout_s = self.send_timeout_s + total / SEND_MIN_BYTES_PER_S
        if total > STREAM_MIN_BYTES or (pairs.shape[0] == 1 and total >= STREAM_PIECE_BYTES):
            return self._stream(sock, head, pairs, total, start, bufs, timeout_s)
        buf = bufs.reply
        if buf is None or buf.size < total:
            buf = bufs.reply = np.empty(min(STREAM_MIN_BYTES, max(total, 1 << 16, 2 * (0 if buf is None else
                                                                                         buf.size))), dtype=np.uint8)
        _kernels.gather_pairs_unchecked(self.segment, pairs, buf[:total])
        if self.metrics is not None:
            self.metrics.record("read_ranges", time.perf_counter() - start, True)
        _sendmsg_all(sock, [head, buf[:total]], timeout_s)

    def _stream(self, sock: socket.socket, head: bytes, pairs: np.ndarray, total: int, start: float,
                bufs: "_Buffers", timeout_s: float) -> None:
        """Send a large reply in pieces (see :func:`_kernels.plan_pieces`): a range of STREAM_PIECE_BYTES or more
        straight from the segment, the others gathered into alternate halves of ``bufs.reply`` by a helper thread,
        piece k + 1 while piece k is sent, so the client receives while the rest is gathered. The reply on the
        wire is the same as in one piece."""
        bounds, sizes = _kernels.plan_pieces(pairs, total, STREAM_PIECE_BYTES)
        lone = [(hi - lo == 1 and n >= STREAM_PIECE_BYTES) for lo, hi, n in
                zip(bounds[:-1].tolist(), bounds[1:].tolist(), sizes.tolist())]
        halves: tuple = ()
        if not all(lone):
            buf = bufs.reply
            if buf is None or buf.size < 2 * STREAM_PIECE_BYTES:
                buf = bufs.reply = np.empty(2 * STREAM_PIECE_BYTES, dtype=np.uint8)
            halves = (buf[:STREAM_PIECE_BYTES], buf[STREAM_PIECE_BYTES:2 * STREAM_PIECE_BYTES])
        half = []  # the half each gathered piece goes into: gathered pieces alternate
        g = 0
        for is_lone in lone:
            half.append(-1 if is_lone else g % 2)
            g += not is_lone
        segment = self.segment
        pool = self._gather_pool() if g > 1 else None

        def gather(k: int) -> np.ndarray:
            out = halves[half[k]][:int(sizes[k])]
            _kernels.gather_pairs_unchecked(segment, pairs[bounds[k]:bounds[k + 1]], out)
            return out

        def begin(k: int) -> Any:
            if half[k] < 0:
                offset = int(pairs[bounds[k], 0])
                return segment[offset:offset + int(sizes[k])]
            return pool.submit(gather, k) if pool is not None else gather(k)

        deadline = time.monotonic() + timeout_s
        pending = begin(0)
        try:
            for k in range(len(lone)):
                piece = pending.result() if isinstance(pending, Future) else pending
                # The other half's piece has been sent: gather piece k + 1 into it while this one goes out.
                pending = begin(k + 1) if k + 1 < len(lone) else None
                if k == 0:  # the header goes out with the first piece
                    if self.metrics is not None:
                        self.metrics.record("read_ranges", time.perf_counter() - start, True)
                    _sendmsg_all(sock, [head, piece], deadline=deadline)
                else:
                    _sendmsg_all(sock, [piece], deadline=deadline)
        finally:
            if isinstance(pending, Future):  # a failed send: let the gather finish before its buffer is reused
                pending.exception()

    def _gather_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1),
                                                thread_name_prefix=f"engram-raw-{self.name}-gather")
            return self._pool

    def _reply_error(self, sock: socket.socket, request_id: int, exc: Exception) -> None:
        """An error reply for a read whose framing holds: the connection keeps serving."""
        if self.metrics is not None:
            self.metrics.record("read_ranges", 0.0, False)
        _sendmsg_all(sock, [_error_reply(request_id, exc)], self.send_timeout_s)

    def close(self) -> None:
        """Stop accepting, close every connection, stop the threads; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if not self._thread.is_alive():
            if self._thread.ident is None:  # never started: close what the loop would have
                self._shut_loop()
            for sock in (self._wake_r, self._wake_w):
                sock.close()
        with self._lock:
            busy = list(self._busy)
            threads = self._threads
            pool, self._pool = self._pool, None
        for c in busy:  # serving threads see their connection fail, and then the stop
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _ in range(threads):
            self._work.put(None)
        for fd in (self._need_r, self._need_w):
            try:
                os.close(fd)
            except OSError:
                pass
        if pool is not None:
            pool.shutdown(wait=False)


def _error_reply(request_id: int, exc: Exception) -> bytes:
    message = str(exc).encode()[:4096]
    return HEADER.pack(MAGIC, VERSION, _ERROR_STATUS.get(type(exc), 4), request_id, len(message)) + message


def _sendmsg_all(conn: socket.socket, buffers: list, timeout_s: float | None = None,
                 deadline: float | None = None) -> None:
    """sendmsg until every byte of ``buffers`` is sent (a large reply may take several calls). Past ``deadline``
    (monotonic), or ``timeout_s`` after the first call that leaves bytes behind, raise TimeoutError (checked
    between calls, each bounded by the socket's send timeout)."""
    sent = conn.sendmsg(buffers)
    if sent == sum(memoryview(b).nbytes for b in buffers):
        return
    if deadline is None and timeout_s is not None:
        deadline = time.monotonic() + timeout_s
    views = [memoryview(b).cast("B") for b in buffers]
    while True:
        while views and sent >= views[0].nbytes:  # drop what went out
            sent -= views[0].nbytes
            views.pop(0)
        if not views:
            return
        if sent:
            views[0] = views[0][sent:]
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"a reply was not taken in time ({sum(v.nbytes for v in views)} bytes left)")
        sent = conn.sendmsg(views)


def _timeval(seconds: float) -> bytes:
    """A ``struct timeval`` for SO_RCVTIMEO / SO_SNDTIMEO."""
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def _set_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel-side timeouts of ``seconds`` on each send and receive of a blocking ``sock``."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))


class RawChannelRefused(SegmentUnavailable):
    """The raw read channel did not take a read, though the segment may be well: it answered busy (``busy``), or
    a new connection was refused or closed before any answer. The client reads over ZeroMQ instead (``pairs``:
    that read's ranges); a segment that does not answer a ZeroMQ ping either is unavailable. ``first``: False for
    a read sent ahead on a connection that a refusal of an earlier read closed."""

    def __init__(self, message: str, busy: bool = False, first: bool = True):
        super().__init__(message)
        self.busy = busy
        self.first = first
        self.pairs: np.ndarray | None = None
        self.reported = False  # raised to the caller once: the reads it orphaned say first=False


class _Stale(Exception):
    """A connection that had served reads was closed by the segment (while idle): ask again on a new one."""


class RawChannel:
    """A client's TCP connection to one segment's raw read port; one thread uses it at a time.

    :meth:`send_read` and :meth:`recv_read` are split so a client can have requests out to several segments at
    once, and several to one (answered in order). Reads on a connection the segment has closed (it closes idle
    ones) are sent again on a new one: reads are idempotent. A busy answer, or a new connection refused or
    closed before answering, raises :class:`RawChannelRefused` (for that read and for every read sent after it
    on the connection); any other failure closes the connection (a late reply can never be read as the answer
    to a later request) and raises :class:`SegmentUnavailable`; the next use connects again. Sends and receives
    block with a kernel-side timeout of ``timeout_s`` each (no poll per call) and the caller's deadline is
    checked between them, so no call waits much past it.
    """

    _ids = iter(range(1, 1 << 62))

    def __init__(self, address: str, host: str, port: int, token_source=None, timeout_s: float = 10.0):
        self.address = address  # the segment's ZeroMQ address: the name errors and failover use
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self._token_source = token_source
        self.sock: socket.socket | None = None
        self._served = 0  # replies received on this connection: after one, a closed connection is stale
        self._pending: dict[int, np.ndarray] = {}  # reads sent on this connection, not answered yet (in order)
        self._orphans: dict[int, tuple[np.ndarray, Exception]] = {}  # reads whose connection is gone, and why
        self._header = bytearray(HEADER.size)
        self._buf = np.empty(1 << 16, dtype=np.uint8)

    def set_timeout(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` per send or receive from now on, on the open connection too."""
        self.timeout_s = timeout_s
        sock = self.sock
        if sock is not None:
            try:
                _set_timeouts(sock, timeout_s)
            except OSError:
                pass  # closed meanwhile: the next connection takes the new timeout

    def _connect(self, deadline: float) -> socket.socket:
        if self.sock is None:
            # The token first: a new connection sends its hello at once (the segment gives it HELLO_TIMEOUT_S).
            token = bytes.fromhex(self._token_source()) if self._token_source is not None else None
            if token is not None and len(token) != TOKEN_BYTES:
                raise ProtocolError(f"read_ranges: {self.address} handed out a token of {len(token)} bytes, "
                                    f"expected {TOKEN_BYTES}")
            try:
                sock = socket.create_connection((self.host, self.port),
                                                timeout=max(0.001, deadline - time.monotonic()))
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _set_timeouts(sock, self.timeout_s)
            except ConnectionRefusedError as exc:
                raise RawChannelRefused(f"read_ranges: the raw read channel of {self.address} ({self.host}:"
                                        f"{self.port}) refused the connection") from exc
            except OSError as exc:
                raise SegmentUnavailable(f"read_ranges: cannot connect to the raw read channel of {self.address} "
                                         f"({self.host}:{self.port}): {exc}") from exc
            self.sock = sock
            self._served = 0
            if token is not None:
                try:
                    self._send(HEADER.pack(MAGIC, VERSION, OP_HELLO, 0, TOKEN_BYTES) + token)
                    self._recv_reply(0, deadline)
                except BaseException:
                    self.close()
                    raise
        return self.sock

    def _send(self, data: Any) -> None:
        try:
            if isinstance(data, list):
                _sendmsg_all(self.sock, data)
            else:
                self.sock.sendall(data)
        except OSError as exc:
            self._closed_early(exc)
            self._fail(exc, f"sending failed: {exc}")

    def _closed_early(self, exc: BaseException | None) -> None:
        """Raise for a connection the segment closed before answering (``exc``: the error, None for an orderly
        close): stale if it had served reads, else refused."""
        if exc is not None and not isinstance(exc, (ConnectionResetError, BrokenPipeError)):
            return
        if self._served:
            self._close_socket()  # the reads sent on it are sent again
            raise _Stale() from exc
        refused = RawChannelRefused(f"read_ranges: the raw read channel of {self.address} closed a new connection "
                                    "before answering")
        self.close(refused)
        raise refused from exc

    def send_read(self, pairs: np.ndarray, deadline: float) -> int:
        """Send a read of ``pairs`` (int64 ``[R, 2]``, C-contiguous); returns its request id."""
        request_id = next(self._ids)
        try:
            try:
                self._send_request(request_id, pairs, deadline)
            except _Stale:  # closed while idle: ask again on a new connection, with the reads sent before
                self._pending[request_id] = pairs
                self._send_again(deadline)
                self._raise_orphan(request_id)
        except RawChannelRefused as exc:
            self._orphans.pop(request_id, None)
            exc.pairs, exc.reported = pairs, True
            raise
        except BaseException:
            self._orphans.pop(request_id, None)
            raise
        return request_id

    def _send_request(self, request_id: int, pairs: np.ndarray, deadline: float) -> None:
        self._connect(deadline)
        head = HEADER.pack(MAGIC, VERSION, OP_READ, request_id, pairs.shape[0])
        if pairs.nbytes <= 4096:
            self._send(head + pairs.tobytes())
        else:
            self._send([head, pairs])
        self._pending[request_id] = pairs

    def _send_again(self, deadline: float) -> None:
        """Send the pending reads again, in order, on a new connection (a failure orphans the rest)."""
        reads, self._pending = list(self._pending.items()), {}
        for k, (request_id, pairs) in enumerate(reads):
            try:
                self._send_request(request_id, pairs, deadline)
            except BaseException as exc:
                why = exc if isinstance(exc, EngramError) else SegmentUnavailable(
                    f"read_ranges: {self.address}: {exc}")
                for rid, p in reads[k:]:
                    self._orphans[rid] = (p, why)
                return

    def _raise_orphan(self, request_id: int) -> None:
        """If the connection that carried ``request_id`` is gone, raise why (a refusal: for this read too)."""
        orphan = self._orphans.pop(request_id, None)
        if orphan is None:
            return
        pairs, why = orphan
        if isinstance(why, RawChannelRefused):  # the first read to hear of it handles it (a ping, a hold-off)
            exc = RawChannelRefused(str(why), busy=why.busy, first=not why.reported)
            exc.pairs, exc.reported, why.reported = pairs, True, True
            raise exc
        raise SegmentUnavailable(str(why))

    def recv_read(self, request_id: int, expected: int, deadline: float, out: np.ndarray | None = None) -> np.ndarray:
        """The reply to ``request_id``: ``expected`` bytes, received into ``out`` (a flat writable uint8 array of
        that size) or else into this channel's buffer (valid until its next read)."""
        self._raise_orphan(request_id)
        if request_id not in self._pending:
            raise SegmentUnavailable(f"read_ranges: {self.address}: no read {request_id} in flight on its raw "
                                     "read connection")
        try:
            try:
                data = self._recv_read(request_id, expected, deadline, out)
            except _Stale:  # closed while idle, before our reads got there: ask again on a new connection
                self._send_again(deadline)
                self._raise_orphan(request_id)
                data = self._recv_read(request_id, expected, deadline, out)
        except RawChannelRefused as exc:
            orphan = self._orphans.pop(request_id, None)
            if orphan is not None:
                exc.pairs = orphan[0]
            exc.reported = True
            raise
        except BaseException:
            self._orphans.pop(request_id, None)
            raise
        del self._pending[request_id]
        return data

    def _recv_read(self, request_id: int, expected: int, deadline: float, out: np.ndarray | None) -> np.ndarray:
        if out is None:
            if self._buf.size < expected:
                self._buf = np.empty(max(expected, 2 * self._buf.size), dtype=np.uint8)
            out = self._buf[:expected]
        sock = self.sock
        if sock is None:
            raise SegmentUnavailable(f"read_ranges: the raw read connection to {self.address} was reset")
        header = memoryview(self._header)
        try:
            # Header and rows in one receive where they have arrived together. Past the deadline a reply that
            # has arrived is still taken (the caller may have been busy with another server), but not waited for.
            got = sock.recvmsg_into([header, out], 0, self._late(deadline))[0]
            if got == 0:
                self._closed_early(None)
            if got < HEADER.size:
                _recv_exact(sock, header[got:])
                got = HEADER.size
        except (OSError, ConnectionError) as exc:
            self._closed_early(exc)
            self._fail(exc)
        count = self._reply_count(request_id, bytes(out[:max(0, got - HEADER.size)]))
        if count != expected:
            self.close()
            raise ProtocolError(f"read_ranges: {self.address} sent {count} bytes, expected {expected}")
        have = got - HEADER.size
        if have < expected:
            try:
                _recv_exact(sock, memoryview(out)[have:])
            except (OSError, ConnectionError) as exc:
                self._fail(exc)
        self._served += 1
        return out

    def _recv_reply(self, request_id: int, deadline: float) -> int:
        """Receive a reply header (and raise its error); returns its count."""
        self._check_deadline(deadline)
        try:
            if not _recv_exact(self.sock, memoryview(self._header)):
                self._closed_early(None)
        except (OSError, ConnectionError, AttributeError) as exc:
            if isinstance(exc, OSError):
                self._closed_early(exc)
            self._fail(exc)
        return self._reply_count(request_id, b"")

    def _reply_count(self, request_id: int, already: bytes) -> int:
        """Check the received reply header: the count of a good reply, else raise (``already``: body bytes
        received with the header, the start of an error message)."""
        magic, version, status, rid, count = HEADER.unpack(self._header)
        if magic != MAGIC:
            self.close()
            raise ProtocolError(f"read_ranges: {self.address} answered {bytes(magic)!r}, not a raw read channel "
                                f"reply")
        if version != VERSION:
            self.close()
            raise ProtocolError(f"read_ranges: {self.address} speaks raw read channel version {version}, this "
                                f"client version {VERSION} (upgrade the older side, or read over ZeroMQ with "
                                f"raw_reads=False)")
        if status == STATUS_BUSY:  # to a new connection (request 0) or to this read
            self._raise_status(status, count, already)
        if rid != request_id:
            self.close()
            raise ProtocolError(f"read_ranges: bad reply from {self.address} (request {rid} for {request_id})")
        if status != STATUS_OK:
            self._raise_status(status, count, already)
        return count

    def _raise_status(self, status: int, count: int, already: bytes) -> None:
        message = bytearray(already[:count])
        try:
            if len(message) < count and self.sock is not None:
                rest = bytearray(min(count, 1 << 16) - len(message))
                _recv_exact(self.sock, memoryview(rest))
                message += rest
        except (OSError, ConnectionError):
            pass
        text = f"{message.decode(errors='replace')} (from {self.address})"
        if status == STATUS_BUSY:
            refused = RawChannelRefused(text, busy=True)
            self.close(refused)  # reads sent after this one are read over ZeroMQ too
            raise refused
        # The server closes after most errors; start clean either way (reads sent after this one fail with it).
        self.close(SegmentUnavailable(f"read_ranges: {self.address}: the raw read connection was closed after an "
                                      f"error in an earlier read: {text}"))
        raise _STATUS_ERRORS.get(status, RemoteError)(text)

    def _check_deadline(self, deadline: float) -> None:
        if time.monotonic() > deadline:
            self.close()
            raise SegmentUnavailable(f"read_ranges: no reply from {self.address} within the timeout")

    @staticmethod
    def _late(deadline: float) -> int:
        """Receive flags: wait (up to the socket's timeout) before ``deadline``, only take what is there after."""
        return socket.MSG_DONTWAIT if time.monotonic() > deadline else 0

    def _fail(self, exc: BaseException, what: str | None = None) -> None:
        timeout = isinstance(exc, (BlockingIOError, TimeoutError, socket.timeout))
        failure = SegmentUnavailable(f"read_ranges: {self.address}: "
                                     f"{what or ('no reply within the timeout' if timeout else exc)}")
        self.close(failure)
        raise failure from exc

    def close(self, reason: Exception | None = None) -> None:
        """Close the connection; reads sent on it and not answered fail with ``reason`` when received."""
        if self._pending:
            why = reason or SegmentUnavailable(f"read_ranges: the raw read connection to {self.address} was closed")
            for request_id, pairs in self._pending.items():
                self._orphans[request_id] = (pairs, why)
            self._pending = {}
        self._close_socket()

    def _close_socket(self) -> None:
        sock, self.sock = self.sock, None
        self._served = 0
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


def raw_reads_default() -> bool:
    """Whether clients read over the raw channel by default (``ENGRAM_RAW_READS=0`` turns it off)."""
    return os.environ.get("ENGRAM_RAW_READS", "1").strip().lower() not in ("0", "false", "no", "off")
