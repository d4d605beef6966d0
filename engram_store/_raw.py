"""The raw read channel: range reads over plain TCP sockets, for lookups at the speed of the network stack.

A ZeroMQ request passes through I/O threads on both ends; on loopback a bare pyzmq round trip costs ~100 us
where a blocking TCP socket answers in ~30 us. Lookups are small reads on the critical path of every model
step, so segments also serve ``read_ranges`` on a plain TCP port, one thread per client connection (the
gather kernel releases the GIL, so connections are served in parallel). Everything else (writes, pings,
metadata) stays on ZeroMQ, and a client falls back to it wherever the raw channel is off or unreachable.

Wire format (little-endian). Every message starts with a 24-byte header ``<4sHHQQ``: magic ``b"ENGR"``,
version (1), op or status, request id, count; then the body:

* request ``op=1`` (read): ``count`` pairs of int64 (offset, length), the ranges of the segment to send back;
* request ``op=2`` (hello): ``count`` bytes of a one-time token (servers started with CURVE keys require it as
  a connection's first message);
* reply: ``status`` 0 and ``count`` bytes of the gathered ranges, back to back; or an error status and
  ``count`` bytes of a UTF-8 message naming what was wrong.

Authentication: when the segment runs with ``--auth``, a client first asks for a token on the segment's ZeroMQ
socket (``op: "channel_token"``, so only a client holding the cluster's CURVE keys gets one), then opens the
TCP connection with it. A token is good for one connection within ``TOKEN_TTL_S``. The channel authenticates
who may read but does not encrypt; clients that need encryption read over ZeroMQ (``raw_reads=False``).

A bad request gets an error reply and the connection keeps serving; a message whose framing cannot be
trusted (wrong magic or version, an absurd count) gets the reply and then the connection is closed.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from . import kernels as _kernels
from ._errors import AuthError, InvalidArgument, ProtocolError, RemoteError, SegmentUnavailable

log = logging.getLogger(__name__)

MAGIC = b"ENGR"
VERSION = 1
HEADER = struct.Struct("<4sHHQQ")
OP_READ = 1
OP_HELLO = 2
STATUS_OK = 0
#: Error statuses and the exception a client raises for each.
_STATUS_ERRORS = {1: InvalidArgument, 2: ProtocolError, 3: AuthError, 4: RemoteError}
_ERROR_STATUS = {InvalidArgument: 1, ProtocolError: 2, AuthError: 3}
#: How long a token handed out over ZeroMQ may wait for its connection.
TOKEN_TTL_S = 60.0
#: A connection that stops half-way through a message is dropped after this long.
PARTIAL_MESSAGE_TIMEOUT_S = 30.0
#: Connections served at once per segment; more are refused (the client reads over ZeroMQ instead).
MAX_CONNECTIONS = 256
#: A reply larger than this is gathered and sent in pieces of about STREAM_PIECE_BYTES, so the client receives
#: one piece while the next is gathered (the reply on the wire is the same).
STREAM_MIN_BYTES = 4 << 20
STREAM_PIECE_BYTES = 1 << 20


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


class RawReadServer:
    """Serves range reads of ``segment`` (a flat uint8 array) on a TCP port of ``host``; see the module docstring.

    ``max_ranges`` and ``max_bytes`` bound one request (as the ZeroMQ handler's limits do); ``require_token``
    makes a connection present a token from :meth:`issue_token` first.
    """

    def __init__(self, host: str, segment: np.ndarray, *, port: int = 0, max_ranges: int, max_bytes: int,
                 require_token: bool = False, name: str = "segment", metrics: Any = None):
        self.segment = _kernels.readonly(segment)
        self.metrics = metrics  # a RequestMetrics: raw reads count as op "read_ranges" with the ZeroMQ ones
        self.max_ranges = max_ranges
        self.max_bytes = max_bytes
        self.require_token = require_token
        self.name = name
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
            self._listener.listen(128)
        except OSError as exc:
            self._listener.close()
            raise SegmentUnavailable(f"{name}: cannot bind the raw read channel on {host}:{port}: {exc}") from exc
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._tokens: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closed = False
        self._pool: ThreadPoolExecutor | None = None  # gathers the pieces of streamed replies
        self._thread = threading.Thread(target=self._accept_loop, name=f"engram-raw-{name}", daemon=True)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "RawReadServer":
        self._thread.start()
        return self

    def issue_token(self) -> str:
        """A one-time token for one connection (hex), valid for TOKEN_TTL_S."""
        token = secrets.token_bytes(32)
        now = time.monotonic()
        with self._lock:
            self._tokens = {t: exp for t, exp in self._tokens.items() if exp > now}
            self._tokens[token] = now + TOKEN_TTL_S
        return token.hex()

    def _take_token(self, token: bytes) -> bool:
        with self._lock:
            expires = self._tokens.pop(token, None)
        return expires is not None and expires > time.monotonic()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                full = len(self._connections) >= MAX_CONNECTIONS
                if not full:
                    self._connections.add(conn)
            if full:
                log.warning("%s: refusing a raw read connection from %s: %d connections open", self.name, peer,
                            MAX_CONNECTIONS)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name=f"engram-raw-{self.name}-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A blocking socket with a kernel-side receive timeout: no poll() per receive, as Python's settimeout
        # would add. Between messages the timeout just repeats (an idle client keeps its connection); inside a
        # message it drops the connection.
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(PARTIAL_MESSAGE_TIMEOUT_S))
        reader = _Reader(conn)
        out_buf = np.empty(1 << 16, dtype=np.uint8)
        authenticated = not self.require_token
        try:
            while not self._closed:
                if not reader.wait_message():
                    return
                magic, version, op, request_id, count = HEADER.unpack(reader.take(HEADER.size))
                if magic != MAGIC or version != VERSION:
                    self._reply_error(conn, request_id, ProtocolError(
                        f"raw read channel: expected magic {MAGIC!r} version {VERSION}, got {bytes(magic)!r} "
                        f"version {version}"))
                    return
                if op == OP_HELLO:
                    if count > 1024:
                        self._reply_error(conn, request_id, ProtocolError(f"hello: token of {count} bytes"))
                        return
                    token = bytes(reader.take(count))
                    if self.require_token and not self._take_token(token):
                        self._reply_error(conn, request_id, AuthError(
                            "raw read channel: unknown or expired token (ask the segment for one with "
                            "channel_token)"))
                        return
                    authenticated = True
                    conn.sendall(HEADER.pack(MAGIC, VERSION, STATUS_OK, request_id, 0))
                    continue
                if op != OP_READ:
                    self._reply_error(conn, request_id, ProtocolError(f"raw read channel: unknown op {op}"))
                    return
                if count > self.max_ranges:
                    self._reply_error(conn, request_id, InvalidArgument(
                        f"read_ranges: at most {self.max_ranges} ranges per request, got {count}"))
                    return  # the body cannot be skipped cheaply: close
                body = reader.take(16 * count)
                if not authenticated:
                    self._reply_error(conn, request_id, AuthError(
                        "raw read channel: this segment requires a token first (it runs with --auth)"))
                    return
                out_buf = self._read(conn, request_id, np.frombuffer(body, dtype=np.int64).reshape(count, 2),
                                     out_buf)
        except (OSError, ConnectionError) as exc:
            log.debug("%s: raw read connection from %s ended: %s", self.name, peer, exc)
        except Exception:  # a bug: log it, drop this connection, keep serving the others
            log.exception("%s: raw read connection from %s failed", self.name, peer)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _read(self, conn: socket.socket, request_id: int, pairs: np.ndarray, out_buf: np.ndarray) -> np.ndarray:
        """Check and gather ``pairs``, send the reply; returns the (possibly grown) reusable output buffer.

        The request is counted in the metrics before its reply goes out (so a client that has the reply sees it
        counted)."""
        start = time.perf_counter()
        bad, total = _kernels.check_pairs(self.segment, pairs)
        if bad >= 0:
            self._reply_error(conn, request_id, InvalidArgument(
                f"read_ranges: range {bad} (offset {int(pairs[bad, 0])}, length {int(pairs[bad, 1])}) is outside "
                f"the segment of {self.segment.size} bytes"))
            return out_buf
        if total > self.max_bytes:
            self._reply_error(conn, request_id, InvalidArgument(
                f"read_ranges: {total} bytes requested, at most {self.max_bytes} per request"))
            return out_buf
        head = HEADER.pack(MAGIC, VERSION, STATUS_OK, request_id, total)
        if total > STREAM_MIN_BYTES:
            return self._stream(conn, head, pairs, total, start, out_buf)
        if out_buf.size < total:
            out_buf = np.empty(max(total, 2 * out_buf.size), dtype=np.uint8)
        _kernels.gather_pairs_unchecked(self.segment, pairs, out_buf[:total])
        if self.metrics is not None:
            self.metrics.record("read_ranges", time.perf_counter() - start, True)
        _sendmsg_all(conn, [head, out_buf[:total]])
        return out_buf

    def _stream(self, conn: socket.socket, head: bytes, pairs: np.ndarray, total: int, start: float,
                out_buf: np.ndarray) -> np.ndarray:
        """Send a large reply in pieces of about STREAM_PIECE_BYTES cut at range boundaries (a range larger than a
        piece is a piece of its own): a helper thread gathers piece k + 1 while this one sends piece k, and the
        client receives while the rest is gathered. The reply on the wire is the same as in one piece. The two
        piece buffers are halves of the connection's reusable ``out_buf`` (returned, grown if it was too small)."""
        R = pairs.shape[0]
        cuts = np.searchsorted(np.cumsum(pairs[:, 1]), np.arange(STREAM_PIECE_BYTES, total, STREAM_PIECE_BYTES),
                               "right")
        bounds = np.unique(np.concatenate(([0], cuts, [R]))).tolist()
        pieces = [(lo, hi, int(pairs[lo:hi, 1].sum())) for lo, hi in zip(bounds, bounds[1:])]
        largest = max(n for _, _, n in pieces)
        if out_buf.size < 2 * largest:
            out_buf = np.empty(2 * largest, dtype=np.uint8)
        buffers = (out_buf[:largest], out_buf[largest:2 * largest])
        pool = self._gather_pool()

        def gather(k: int) -> np.ndarray:
            lo, hi, n = pieces[k]
            out = buffers[k % 2][:n]
            _kernels.gather_pairs_unchecked(self.segment, pairs[lo:hi], out)
            return out

        pending = pool.submit(gather, 0)
        try:
            for k in range(len(pieces)):
                piece = pending.result()
                # The other buffer's piece (k - 1) is sent: gather k + 1 into it while this piece goes out.
                pending = pool.submit(gather, k + 1) if k + 1 < len(pieces) else None
                if k == 0:  # the header goes out with the first piece
                    if self.metrics is not None:
                        self.metrics.record("read_ranges", time.perf_counter() - start, True)
                    _sendmsg_all(conn, [head, piece])
                else:
                    conn.sendall(piece)
        finally:
            if pending is not None:  # a failed send: let the gather finish before its buffer is reused
                pending.result()
        return out_buf

    def _gather_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1),
                                                thread_name_prefix=f"engram-raw-{self.name}-gather")
            return self._pool

    def _reply_error(self, conn: socket.socket, request_id: int, exc: Exception) -> None:
        if self.metrics is not None:
            self.metrics.record("read_ranges", 0.0, False)
        message = str(exc).encode()[:4096]
        status = _ERROR_STATUS.get(type(exc), 4)
        try:
            conn.sendall(HEADER.pack(MAGIC, VERSION, status, request_id, len(message)) + message)
        except OSError:
            pass

    def close(self) -> None:
        """Stop accepting, close every connection; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns, self._connections = list(self._connections), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


def _timeval(seconds: float) -> bytes:
    """A ``struct timeval`` for SO_RCVTIMEO / SO_SNDTIMEO."""
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def _set_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel-side timeouts of ``seconds`` on each send and receive of a blocking ``sock``."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))


class _Reader:
    """Buffered receiving of whole messages: one ``recv`` usually brings a request's header and body at once."""

    def __init__(self, conn: socket.socket):
        self.conn = conn
        self.buf = bytearray(1 << 16)
        self.start = 0
        self.end = 0

    def wait_message(self) -> bool:
        """Block until a message starts (an idle connection may wait any time); False when the peer closed."""
        while self.start == self.end:
            self.start = self.end = 0
            try:
                n = self.conn.recv_into(self.buf)
            except (BlockingIOError, TimeoutError):
                continue  # the receive timeout between messages: keep waiting
            if n == 0:
                return False
            self.end = n
        return True

    def take(self, n: int) -> memoryview:
        """The next ``n`` bytes (valid until the next take); a peer that stops short raises."""
        if self.end - self.start < n:
            if len(self.buf) < n:
                grown = bytearray(max(n, 2 * len(self.buf)))
                grown[:self.end - self.start] = self.buf[self.start:self.end]
                self.buf, self.end, self.start = grown, self.end - self.start, 0
            elif len(self.buf) - self.start < n:
                self.buf[:self.end - self.start] = self.buf[self.start:self.end]
                self.end, self.start = self.end - self.start, 0
            view = memoryview(self.buf)
            while self.end - self.start < n:
                k = self.conn.recv_into(view[self.end:])
                if k == 0:
                    raise ConnectionError("peer closed the connection in the middle of a message")
                self.end += k
        out = memoryview(self.buf)[self.start:self.start + n]
        self.start += n
        return out


def _sendmsg_all(conn: socket.socket, buffers: list) -> None:
    """sendmsg until every byte of ``buffers`` is sent (a large reply may take several calls)."""
    sent = conn.sendmsg(buffers)
    if sent == sum(memoryview(b).nbytes for b in buffers):
        return
    views = [memoryview(b).cast("B") for b in buffers]
    while True:
        while views and sent >= views[0].nbytes:  # drop what went out
            sent -= views[0].nbytes
            views.pop(0)
        if not views:
            return
        if sent:
            views[0] = views[0][sent:]
        sent = conn.sendmsg(views)


class RawChannel:
    """A client's TCP connection to one segment's raw read port; one thread uses it at a time.

    :meth:`send_read` and :meth:`recv_read` are split so a client can have requests out to several segments at
    once. Any failure closes the connection (a late reply can never be read as the answer to a later request)
    and raises :class:`SegmentUnavailable`; the next use connects again. Sends and receives block with a
    kernel-side timeout of ``timeout_s`` each (no poll per call) and the caller's deadline is checked between
    them, so no call waits much past it.
    """

    _ids = iter(range(1, 1 << 62))

    def __init__(self, address: str, host: str, port: int, token_source=None, timeout_s: float = 10.0):
        self.address = address  # the segment's ZeroMQ address: the name errors and failover use
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self._token_source = token_source
        self.sock: socket.socket | None = None
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
            try:
                sock = socket.create_connection((self.host, self.port),
                                                timeout=max(0.001, deadline - time.monotonic()))
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _set_timeouts(sock, self.timeout_s)
            except OSError as exc:
                raise SegmentUnavailable(f"read_ranges: cannot connect to the raw read channel of {self.address} "
                                         f"({self.host}:{self.port}): {exc}") from exc
            self.sock = sock
            if self._token_source is not None:
                try:
                    token = bytes.fromhex(self._token_source())
                    self._send(HEADER.pack(MAGIC, VERSION, OP_HELLO, 0, len(token)) + token)
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
            self.close()
            raise SegmentUnavailable(f"read_ranges: sending to {self.address} failed: {exc}") from exc

    def send_read(self, pairs: np.ndarray, deadline: float) -> int:
        """Send a read of ``pairs`` (int64 ``[R, 2]``, C-contiguous); returns its request id."""
        self._connect(deadline)
        request_id = next(self._ids)
        head = HEADER.pack(MAGIC, VERSION, OP_READ, request_id, pairs.shape[0])
        if pairs.nbytes <= 4096:
            self._send(head + pairs.tobytes())
        else:
            self._send([head, pairs])
        return request_id

    def recv_read(self, request_id: int, expected: int, deadline: float, out: np.ndarray | None = None) -> np.ndarray:
        """The reply to ``request_id``: ``expected`` bytes, received into ``out`` (a flat writable uint8 array of
        that size) or else into this channel's buffer (valid until its next read)."""
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
                raise ConnectionError("closed by the segment")
            if got < HEADER.size:
                _recv_exact(sock, header[got:])
                got = HEADER.size
        except (OSError, ConnectionError) as exc:
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
        return out

    def _recv_reply(self, request_id: int, deadline: float) -> int:
        """Receive a reply header (and raise its error); returns its count."""
        self._check_deadline(deadline)
        try:
            if not _recv_exact(self.sock, memoryview(self._header)):
                raise ConnectionError("closed by the segment")
        except (OSError, ConnectionError, AttributeError) as exc:
            self._fail(exc)
        return self._reply_count(request_id, b"")

    def _reply_count(self, request_id: int, already: bytes) -> int:
        """Check the received reply header: the count of a good reply, else raise (``already``: body bytes
        received with the header, the start of an error message)."""
        magic, version, status, rid, count = HEADER.unpack(self._header)
        if magic != MAGIC or version != VERSION or rid != request_id:
            self.close()
            raise ProtocolError(f"read_ranges: bad reply from {self.address} (magic {bytes(magic)!r}, version "
                                f"{version}, request {rid} for {request_id})")
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
        finally:
            self.close()  # the server closes after most errors; start clean either way
        raise _STATUS_ERRORS.get(status, RemoteError)(f"{message.decode(errors='replace')} (from {self.address})")

    def _check_deadline(self, deadline: float) -> None:
        if time.monotonic() > deadline:
            self.close()
            raise SegmentUnavailable(f"read_ranges: no reply from {self.address} within the timeout")

    @staticmethod
    def _late(deadline: float) -> int:
        """Receive flags: wait (up to the socket's timeout) before ``deadline``, only take what is there after."""
        return socket.MSG_DONTWAIT if time.monotonic() > deadline else 0

    def _fail(self, exc: BaseException) -> None:
        self.close()
        timeout = isinstance(exc, (BlockingIOError, TimeoutError, socket.timeout))
        what = "no reply within the timeout" if timeout else str(exc)
        raise SegmentUnavailable(f"read_ranges: {self.address}: {what}") from exc

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


def raw_reads_default() -> bool:
    """Whether clients read over the raw channel by default (``ENGRAM_RAW_READS=0`` turns it off)."""
    return os.environ.get("ENGRAM_RAW_READS", "1").strip().lower() not in ("0", "false", "no", "off")
