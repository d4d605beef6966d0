"""The raw read channel's server: range reads over plain TCP sockets, for lookups at the speed of the network stack.

A ZeroMQ request passes through I/O threads on both ends; on loopback a bare pyzmq round trip costs ~100 us
where a blocking TCP socket answers in ~30 us. Lookups are small reads on the critical path of every model
step, so segments also serve ``read_ranges`` on a plain TCP port. Everything else (writes, pings, metadata)
stays on ZeroMQ, and a client reads over ZeroMQ wherever the raw channel is off, unreachable, full or busy.

The frame (version, ops, statuses, every field) is :mod:`.frame`'s; the bounds and deadlines are :mod:`.limits`'.
Busy means "read this over ZeroMQ", not "the segment is down": a segment whose channel is full answers a new
connection busy (request id 0) and closes it; a read whose ranges would take the segment past its bound on request
bytes in flight has its ranges read and dropped and is answered busy on a connection that stays open.

Serving. One event-loop thread (``selectors``: epoll on Linux) holds every connection that is idle or has a
message only partly received: a socket and a 56-byte header buffer each, no thread and no other buffer. It
receives headers; before authentication it accepts only a hello, and a read is answered with an authentication
error and closed with its ranges unread. A read header goes to one of at most ``SERVING_THREADS`` serving
threads, which receives the ranges (they come with the header) into a buffer of its own, checks them, gathers
(GIL-free) and sends the reply, serves the requests that came behind it, then waits on the same connection for
the next: ``LINGER_S`` watching it alone (so a client reading in a loop is served as by a thread of its own),
then up to ``STICKY_S`` more, giving the thread up at once when another request waits for one; a connection
that stays quiet goes back to the loop. Those later reads are answered by one kernel call each
(``kernels.serve_read``: the wait, the receive, the checks against the generation table, the gather and the
send, without the GIL and without Python in between, so a read at a model step's cadence wakes one thread and
runs no bytecode before its reply is out); whatever it does not answer itself (a request too large or too slow
for the thread's buffer, an error to explain, a reply sent in pieces, a check it cannot settle) takes the
Python path, as the first read does. Such a read is counted in the metrics as its reply goes out. Ranges that
come slowly go back to the loop too, which receives them into a buffer counted against ``BODY_BYTES_IN_FLIGHT``
(as are ranges beyond ``REQUEST_KEEP_BYTES``); past it a read is answered busy. A reply above
``STREAM_MIN_BYTES`` goes out in pieces of at most ``STREAM_PIECE_BYTES`` through two halves of the thread's
reply buffer (a helper gathers piece k + 1 while piece k is sent), and a range of a piece's size or more goes out
straight from the segment's memory; so a serving thread keeps at most ``STREAM_MIN_BYTES + REQUEST_KEEP_BYTES``
of buffers (and a reply header), and drops them after ``SERVING_IDLE_S`` without work.

Deadlines: a new connection must complete its first message (its hello, with ``--auth``) within
``HELLO_TIMEOUT_S``; any message must arrive whole within ``MESSAGE_TIMEOUT_S`` of its first byte (a drip
cannot outlive it); a connection idle for ``IDLE_TIMEOUT_S`` is closed (clients reconnect and ask again,
reads being idempotent); a reply must be taken within ``SEND_TIMEOUT_S`` plus its size at
``SEND_MIN_BYTES_PER_S``.

Caps (``engram_store._peers``): a peer (an address, and the user for a connection from this host) holds at most
``PENDING_PER_PEER`` connections that have not completed a message (past them its oldest such is closed) and half
the channel in all (past that its new one is answered busy). At
``MAX_CONNECTIONS`` (at most half of what the open-files limit leaves the process's connections, so the segment's
ZeroMQ sockets keep the other half) a new connection first displaces the oldest connection without a complete
message of the peer holding the most such, else it is answered busy. Refusals and deadlines are counted
(:meth:`RawReadServer.stats`, in the segment's ping as ``raw_stats``) and logged at WARNING at most once per peer and
reason every ``_peers.REFUSAL_LOG_INTERVAL_S``.

A bad request gets an error reply and the connection keeps serving; a message whose framing cannot be
trusted (wrong magic or version, an absurd count, a read before the token) gets the reply and then the
connection is closed.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import queue
import secrets
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import kernels as _kernels
from ..errors import InvalidArgument, SegmentUnavailable
from .._peers import LEDGER, Holders, PeerNames
from ..wire import REFUSALS
from ..kernels.raw_io import serve_params
from .frame import HEADER, MAGIC, OK_KIND, READ_KIND, STATUS_BUSY, TOKEN_BYTES, VERSION, timeval
from . import limits
from ._receive import Receiving
from ._serving import Serving
from ._state import GONE, LISTENER, READY, WAKE, Conn, open_files_cap

log = logging.getLogger(__name__)


def _listen(host: str, port: int, name: str) -> socket.socket:
    """The raw read channel's listening socket on ``host:port`` (0: any free port), non-blocking."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(1024)
        listener.setblocking(False)
    except OSError as exc:
        listener.close()
        raise SegmentUnavailable(f"{name}: cannot bind the raw read channel on {host}:{port}: {exc}") from exc
    return listener


class RawReadServer(Receiving, Serving):
    """Serves range reads of ``segment`` (a flat uint8 array) on a TCP port of ``host``; see the module docstring.

    ``max_ranges`` and ``max_bytes`` bound one request (as the ZeroMQ handler's limits do); ``require_token``
    makes a connection present a token from :meth:`issue_token` first; ``max_connections`` defaults to
    limits.MAX_CONNECTIONS. The deadlines and bounds are the module's constants as they are when the server is built.
    """

    def __init__(self, host: str, segment: np.ndarray, *, port: int = 0, max_ranges: int, max_bytes: int,
                 require_token: bool = False, name: str = "segment", metrics: Any = None,
                 max_connections: int | None = None, generations: Any = None):
        if max_connections is not None and (isinstance(max_connections, bool) or not isinstance(max_connections, int)
                                            or max_connections < 1):
            raise InvalidArgument(f"max_connections: expected an integer >= 1, got {max_connections!r}")
        self.segment = _kernels.readonly(segment)
        #: Which put wrote which range (a segment's Generations): reads that name objects are checked against it.
        self.generations = generations
        self.metrics = metrics  # a RequestMetrics: raw reads count as op "read_ranges" with the ZeroMQ ones
        self.max_ranges = max_ranges
        self.max_bytes = max_bytes
        self.require_token = require_token
        self.name = name
        self.max_connections = open_files_cap(limits.MAX_CONNECTIONS if max_connections is None else max_connections)
        self.per_peer = max(limits.PENDING_PER_PEER, self.max_connections // 2)
        self.hello_timeout_s = limits.HELLO_TIMEOUT_S
        self.message_timeout_s = limits.MESSAGE_TIMEOUT_S
        self.idle_timeout_s = limits.IDLE_TIMEOUT_S
        self.send_timeout_s = limits.SEND_TIMEOUT_S
        self.serving_threads = limits.SERVING_THREADS
        self.body_budget = limits.BODY_BYTES_IN_FLIGHT
        self._sweep_s = min(limits.SWEEP_S, self.hello_timeout_s / 4, self.message_timeout_s / 4, self.idle_timeout_s / 4)
        # What the serving kernel answers by itself (see _serving): reads within these bounds.
        self._kernel_params = serve_params(READ_KIND, OK_KIND, max_ranges, max_bytes, limits.STREAM_MIN_BYTES,
                                           limits.STREAM_PIECE_BYTES, self.send_timeout_s,
                                           limits.SEND_MIN_BYTES_PER_S)
        self._listener = _listen(host, port, name)
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._where = f"{name} raw read channel {self.address}"
        self._tokens: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._open_wakeups()
        self._accept_paused_until = 0.0
        # Held by the loop thread only: every open connection, and the same by peer, with those that have no complete
        # message yet (unproven) oldest first.
        self._conns: set[Conn] = set()
        self._holders = Holders(per_peer=self.per_peer, unproven_per_peer=min(self.per_peer, limits.PENDING_PER_PEER))
        self._names = PeerNames()
        # Shared under _lock: connections a serving thread holds, the hand-backs, the threads and the budget.
        self._busy: set[Conn] = set()
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

    def _open_wakeups(self) -> None:
        """The loop's selector over the listener and its wake-up socket, and the pipe of lingering threads."""
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # A byte here asks one lingering serving thread to give up its connection: a request waits for a thread.
        self._need_r, self._need_w = os.pipe()
        os.set_blocking(self._need_r, False)
        os.set_blocking(self._need_w, False)
        self._sel.register(self._listener, selectors.EVENT_READ, LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, WAKE)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "RawReadServer":
        self._thread.start()
        return self

    def issue_token(self) -> str:
        """A one-time token for one connection (hex), valid for limits.TOKEN_TTL_S."""
        token = secrets.token_bytes(TOKEN_BYTES)
        now = time.monotonic()
        with self._lock:
            self._tokens = {t: exp for t, exp in self._tokens.items() if exp > now}
            while len(self._tokens) >= limits.MAX_TOKENS:  # the oldest unused token goes first
                del self._tokens[next(iter(self._tokens))]
            self._tokens[token] = now + limits.TOKEN_TTL_S
        return token.hex()

    def _take_token(self, token: bytes) -> bool:
        with self._lock:
            expires = self._tokens.pop(token, None)
        return expires is not None and expires > time.monotonic()

    def stats(self) -> dict[str, int]:
        """Connections, threads and bytes in flight now, and counts of refusals and deadlines since the start:
        ``refused_full`` (answered busy: the channel was full), ``displaced`` (closed to make room before a
        first message), ``busy`` (reads answered busy: too many request bytes in flight), ``refused_auth``
        (a read before the token, or a bad token), ``refused_peer`` (answered busy: the peer held its share),
        ``displaced_peer`` (a peer's oldest connection without a message, closed past its share), ``timeout_hello``, ``timeout_message``, ``timeout_idle``,
        ``timeout_send``, ``accept_errors``."""
        with self._lock:
            counts = dict(self._counts)
            out = {"connections": len(self._conns), "pending": sum(c.pending for c in list(self._conns)),
                   "serving": len(self._busy),
                   "serving_threads": self._threads, "body_bytes_in_flight": self._in_flight,
                   "max_connections": self.max_connections}
        for name in ("refused_full", "displaced", "refused_peer", "displaced_peer", "busy", "refused_auth",
                     "timeout_hello", "timeout_message",
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
                        if data is LISTENER:
                            self._accept()
                        elif data is WAKE:
                            self._take_back()
                        elif data.in_loop:
                            self._on_readable(data)
                    except Exception:  # a bug: log it, drop that connection, keep serving the others
                        log.exception("%s: serving a connection failed", self._where)
                        if isinstance(data, Conn):
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
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        """Keep a new connection within the caps (its peer's share, the channel's size), or answer it busy."""
        named = self._names.name(sock)
        if named is None:  # gone already
            sock.close()
            return
        peer, who = named
        holders = self._holders
        if holders.held_by(who) >= self.per_peer:
            self._count("refused_peer")
            self._busy_reply(sock, peer, f"{who} holds {self.per_peer} connections, as many as one peer may")
            return
        if len(self._conns) >= self.max_connections and not self._displace_pending():
            self._count("refused_full")
            self._busy_reply(sock, peer, f"the channel is full ({self.max_connections} connections)")
            return
        try:
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Kernel-side timeouts for the serving threads' blocking calls (the loop never blocks: it
            # passes MSG_DONTWAIT): a lingering receive waits limits.LINGER_S, a send that moves nothing fails.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(limits.LINGER_S))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(self.send_timeout_s))
        except OSError:
            sock.close()
            return
        c = Conn(sock, peer, time.monotonic(), authenticated=not self.require_token)
        self._conns.add(c)
        holders.add(c, who)
        LEDGER.add(1)
        self._sel.register(sock, selectors.EVENT_READ, c)
        self._displace_pending(who, "displaced_peer")  # past its share, the peer's oldest without a message goes

    def _busy_reply(self, sock: socket.socket, peer: str, why: str) -> None:
        """Answer a connection the channel does not keep busy, and close it: its client reads over ZeroMQ."""
        REFUSALS.refused(self._where, peer, f"{why}; answered busy, the client reads over ZeroMQ")
        message = f"raw read channel {self.address}: busy ({why}); read over ZeroMQ".encode()
        try:
            sock.send(HEADER.pack(MAGIC, VERSION, STATUS_BUSY, 0, len(message)) + message, socket.MSG_DONTWAIT)
        except OSError:
            pass
        sock.close()

    def _displace_pending(self, who: str | None = None, count: str = "displaced") -> bool:
        """Close the oldest connection that has not completed a message (a stranger holding a slot) of the peer
        holding the most such, or with ``who`` of that peer once it holds more than its share of them; False if
        none was closed."""
        holders = self._holders
        while True:
            c = holders.busiest_unproven() if who is None else holders.crowding(who)
            if c is None:
                return False
            holders.proven(c)  # settled either way: closed below, or no longer waiting for its first message
            if c.pending and c.in_loop:
                self._count(count)
                REFUSALS.refused(self._where, c.peer, "closed a connection that had not completed a message, "
                                                      "to make room for a new one")
                self._forget(c)
                return True

    def _on_readable(self, c: Conn) -> None:
        result = self._advance(c, socket.MSG_DONTWAIT, loop=True)
        if not c.pending:
            self._holders.proven(c)
        if result == GONE:
            self._forget(c)
        elif result == READY:  # a whole read, or its header with the ranges still to come
            self._sel.unregister(c.sock)
            c.in_loop = False
            self._dispatch(c)

    def _sweep(self, now: float) -> None:
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, LISTENER)
        for c in list(self._conns):
            if not c.in_loop:
                continue  # a serving thread's: bounded by limits.LINGER_S and the send deadline
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
            elif not c.pending and not c.msg_start and now - c.last_active > self.idle_timeout_s:
                self._count("timeout_idle")
                log.debug("%s: closing a connection from %s idle for %g s", self._where, c.peer,
                          self.idle_timeout_s)
            else:
                continue
            self._forget(c)

    def _forget(self, c: Conn) -> None:
        """Close a connection the loop holds."""
        c.in_loop = False  # an event for it later in the same batch is ignored
        self._release_slot(c)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        self._drop(c)

    def _release_slot(self, c: Conn) -> None:
        """``c`` no longer counts against the channel, its peer or the process."""
        if c in self._conns:
            self._conns.discard(c)
            self._holders.remove(c)
            LEDGER.add(-1)

    def _drop(self, c: Conn) -> None:
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
                self._release_slot(c)
                continue
            if not c.pending:
                self._holders.proven(c)
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
        self._names.close()

    # ---- receiving a message (the loop: MSG_DONTWAIT; a serving thread: MSG_WAITALL, limits.LINGER_S at most) ----

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
