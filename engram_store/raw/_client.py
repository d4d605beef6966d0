"""A client's raw read channel to one segment: a TCP connection on which it sends reads and receives replies.

See :mod:`engram_store.raw.frame` for the protocol. Any failure closes the connection (a late reply is
never read as the answer to a later request); a connection the segment closed while idle is reopened and the
reads sent on it are sent again (reads are idempotent); a busy answer or a refused connection raises
:class:`RawChannelRefused`, and the caller reads over ZeroMQ instead.

A reply is whole or it raises: a connection that ends inside a reply (a segment ends a streamed reply whose objects
changed while it went out, or it stopped) raises :class:`RawChannelRefused` with ``cut`` set, and the caller reads
the same ranges over ZeroMQ, whose reply is checked whole (rows, or StalePlacement). A caller interrupted between
a read's send and its receive (a signal's exception) leaves that read pending: the next receive on the connection
finds it ahead of its own and sends its read again on a new connection, so no reply is read as another's.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import numpy as np

from ..errors import NO_FILES, EngramError, ProtocolError, RemoteError, SegmentUnavailable, too_many_open_files
from ..kernels.raw_io import (BAD_ID, INTERRUPTED, NO_ROOM, OK, RAW_IO, TIMEOUT, client_buffer, direct_request_bytes,
                               read_direct_unchecked, set_client_timeout)
from .frame import (
    HEADER,
    MAGIC,
    OK_KIND,
    READ_KIND,
    OP_HELLO,
    OP_READ,
    STATUS_BUSY,
    STATUS_ERRORS,
    STATUS_OK,
    TOKEN_BYTES,
    VERSION,
    PeerClosed,
    recv_exact,
    sendmsg_all,
    set_timeouts,
)

log = logging.getLogger(__name__)

#: read_direct's request buffer: this much at first (a lookup of a few hundred rows), grown up to
#: DIRECT_REQUEST_KEEP_BYTES (65536 rows); a larger request is sent from pairs of its own (send_read).
DIRECT_REQUEST_BYTES = 16 << 10
DIRECT_REQUEST_KEEP_BYTES = 1 << 20


class RawChannelRefused(SegmentUnavailable):
    """The raw read channel did not take a read, though the segment may be well: it answered busy (``busy``), or
    a new connection was refused or closed before any answer. The client reads over ZeroMQ instead (``pairs``:
    that read's ranges); a segment that does not answer a ZeroMQ ping either is unavailable. ``first``: False for
    a read sent ahead on a connection that a refusal of an earlier read closed. ``cut``: the connection ended inside
    the reply (its rows are not all there)."""

    def __init__(self, message: str, busy: bool = False, first: bool = True, cut: bool = False):
        super().__init__(message)
        self.busy = busy
        self.first = first
        self.cut = cut
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
        self._fd = -1  # the connection's descriptor, for read_direct
        # read_direct's buffer (its words, then the request it builds); None where the kernel path does not run.
        self._direct = client_buffer(DIRECT_REQUEST_BYTES, READ_KIND, OK_KIND, timeout_s) if RAW_IO else None

    def set_timeout(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` per send or receive from now on, on the open connection too."""
        self.timeout_s = timeout_s
        if self._direct is not None:
            set_client_timeout(self._direct, timeout_s)
        sock = self.sock
        if sock is not None:
            try:
                set_timeouts(sock, timeout_s)
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
                set_timeouts(sock, self.timeout_s)
            except ConnectionRefusedError as exc:
                raise RawChannelRefused(f"read_ranges: the raw read channel of {self.address} ({self.host}:"
                                        f"{self.port}) refused the connection") from exc
            except OSError as exc:
                if exc.errno in NO_FILES:
                    raise too_many_open_files(f"connecting to the raw read channel of {self.address}") from exc
                raise SegmentUnavailable(f"read_ranges: cannot connect to the raw read channel of {self.address} "
                                         f"({self.host}:{self.port}): {exc}") from exc
            self.sock = sock
            self._fd = sock.fileno()
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
                sendmsg_all(self.sock, data)
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

    def read_direct(self, plan: np.ndarray, ids: np.ndarray, row_bytes: int, out: np.ndarray) -> bool:
        """A lookup's read in one kernel call (``kernels.read_direct``: the request built from ``ids`` under
        ``plan``, sent, and the reply received into ``out``, without the GIL): True when ``out`` holds the rows.

        False, with nothing pending, when this connection cannot take it now (not connected, reads in flight, not
        Linux), when an id is outside the plan's limits (nothing was sent; the caller's id check names it), or the
        read did not end in rows (the segment closed the connection, answered busy or with an
        error, or sent something unexpected): the connection is closed then, and the caller reads again through
        :meth:`send_read`, which reconnects, and reads the answer properly. No reply within the timeout raises
        :class:`SegmentUnavailable`, as :meth:`recv_read` does."""
        if self.sock is None or self._pending or self._orphans or self._direct is None:
            return False
        status = INTERRUPTED  # until the kernel says otherwise (a signal's exception may come at any bytecode)
        try:
            status = read_direct_unchecked(self._fd, ids, plan, row_bytes, next(self._ids), self._direct, out)
            if status == NO_ROOM:  # a request larger than any before: a larger buffer, up to the kept size
                if direct_request_bytes(ids, plan) > DIRECT_REQUEST_KEEP_BYTES or out.size < ids.shape[0] \
                        * plan[0] * row_bytes:
                    return False  # sent from pairs of its own (send_read)
                self._direct = client_buffer(DIRECT_REQUEST_KEEP_BYTES, READ_KIND, OK_KIND, self.timeout_s)
                status = INTERRUPTED
                status = read_direct_unchecked(self._fd, ids, plan, row_bytes, next(self._ids), self._direct, out)
        finally:
            if status not in (OK, NO_ROOM, BAD_ID):
                self._close_socket()  # what is left on it must never be read as the answer to a later read
        if status == OK:
            self._served += 1
            return True
        if status == TIMEOUT:
            raise SegmentUnavailable(f"read_ranges: {self.address}: no reply within the timeout")
        return False  # (INTERRUPTED: the signal's handler has run; the read goes again the general way)

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
        except BaseException as exc:
            self._orphans.pop(request_id, None)
            if not isinstance(exc, EngramError):
                self.close()  # interrupted part-way (a signal's exception): part of a request may be on the wire
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
                if next(iter(self._pending)) != request_id:
                    self._drop_abandoned(request_id, deadline)
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
        except BaseException as exc:
            if not isinstance(exc, EngramError):
                self.close()  # interrupted inside a reply: the rest of it must never be read as another's
            self._orphans.pop(request_id, None)
            raise
        del self._pending[request_id]
        return data

    def _drop_abandoned(self, request_id: int, deadline: float) -> None:
        """Reads sent before ``request_id`` are still pending: their callers left between send and receive (a
        signal's exception; callers receive in the order they sent). Their replies come first on this connection,
        so it is closed, they are forgotten, and ``request_id`` and the reads after it go again on a new one."""
        reads = list(self._pending)
        self._pending = {rid: self._pending[rid] for rid in reads[reads.index(request_id):]}
        self._close_socket()
        self._send_again(deadline)
        self._raise_orphan(request_id)

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
                recv_exact(sock, header[got:])
                got = HEADER.size
        except OSError as exc:
            self._closed_early(exc)
            self._fail(exc)
        count = self._reply_count(request_id, bytes(out[:max(0, got - HEADER.size)]))
        if count != expected:
            self.close()
            raise ProtocolError(f"read_ranges: {self.address} sent {count} bytes, expected {expected}")
        have = got - HEADER.size
        if have < expected:
            try:
                recv_exact(sock, memoryview(out)[have:])
            except (PeerClosed, ConnectionResetError) as exc:
                self._cut(have + getattr(exc, "got", 0), expected, exc)
            except OSError as exc:
                self._fail(exc)
        self._served += 1
        return out

    def _cut(self, got: int, expected: int, exc: BaseException) -> None:
        """The connection ended inside a reply, after ``got`` of its ``expected`` bytes: the segment ends a streamed
        reply whose objects changed while it went out (or it stopped). Raise RawChannelRefused (``cut``): the caller
        reads the ranges again over ZeroMQ, whose reply is checked whole (or it asks the segment whether it is
        there), never taking the rows received."""
        cut = RawChannelRefused(f"read_ranges: {self.address} ended its reply after {got} of {expected} bytes",
                                cut=True)
        self.close(cut)
        raise cut from exc

    def _recv_reply(self, request_id: int, deadline: float) -> int:
        """Receive a reply header (and raise its error); returns its count."""
        self._check_deadline(deadline)
        try:
            recv_exact(self.sock, memoryview(self._header))
        except PeerClosed as exc:
            if not exc.got:
                self._closed_early(None)
            self._fail(exc)
        except (OSError, AttributeError) as exc:
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
                recv_exact(self.sock, memoryview(rest))
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
        raise STATUS_ERRORS.get(status, RemoteError)(text)

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
        self._fd = -1
        self._served = 0
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def __del__(self) -> None:
        self._close_socket()  # the thread that used it ended (see RawRoutes): its socket goes with it


def raw_reads_default() -> bool:
    """Whether clients read over the raw channel by default (``ENGRAM_RAW_READS=0`` turns it off)."""
    return os.environ.get("ENGRAM_RAW_READS", "1").strip().lower() not in ("0", "false", "no", "off")
