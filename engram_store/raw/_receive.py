"""How the raw channel's event loop receives a message: a header, a hello's token, a read's ranges, a body it drops;
each bounded by a deadline and, for ranges the loop holds, by the bytes in flight (see :mod:`._server`)."""

from __future__ import annotations

import logging
import socket
import time

import numpy as np

from ..errors import AuthError, InvalidArgument, ProtocolError
from ..wire import REFUSALS
from .frame import (
    HEADER,
    HELLO_BYTES,
    MAGIC,
    OP_HELLO,
    OP_READ,
    PAIR_BYTES,
    STATUS_BUSY,
    STATUS_OK,
    TOKEN_BYTES,
    VERSION,
    error_reply,
)
from ._state import BODY, DROP, GONE, HEAD, NO_PAIRS, READY, TOKEN, WAIT, Conn, request_buffer

log = logging.getLogger("engram_store.raw._server")


class Receiving:
    """The receiving side of a :class:`~._server.RawReadServer` (a mixin: the server holds the state)."""

    def _advance(self, c: Conn, flags: int, data: memoryview | None = None, into: np.ndarray | None = None,
                 loop: bool = False) -> int:
        """Receive what ``c``'s current message still needs: READY when a read request is complete (or, for the
        ``loop``, its header: a serving thread receives the ranges), WAIT when more bytes must come first, GONE
        when the connection must close (any error reply has been sent).

        ``data``: bytes a serving thread already received on ``c``, taken before the socket's (``c.fed`` says how
        many were taken: a request may be followed by the next). ``into``: a serving thread's request buffer, for
        ranges that fit (not counted in flight; moved out if ``c`` goes back to the loop half-way)."""
        sock = c.sock
        pos = c.fed = 0
        while True:
            state = c.state
            if state == BODY and c.body is None:
                if loop and not c.slow:
                    return READY  # the header: a serving thread receives the ranges (they come with it)
                state = self._claim_body(c, into)
            view = self._part(c)
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
                    return GONE
                if n == 0:
                    return GONE
            if not c.msg_start:
                c.msg_start = time.monotonic()
            if state == DROP:
                c.left -= n
                done = c.left == 0
            else:
                c.got += n
                done = n == want
            if not done:
                if n < want and not fed:
                    return self._wait(c)  # nothing more has arrived (or a serving thread's wait ran out)
                continue  # the rest from the socket
            if state == HEAD:
                result = self._on_header(c)
                if result is not None:
                    return result
            elif state == TOKEN:
                if not self._on_token(c):
                    return GONE
            elif state == BODY:
                c.pending = False
                return READY
            elif not self._answer_busy(c):
                return GONE

    def _claim_body(self, c: Conn, into: np.ndarray | None) -> int:
        """A buffer for ``c``'s ranges: in ``into`` where they fit, else one of their own within the bound on bytes in
        flight; without room the ranges are received and dropped (DROP, answered busy). Returns the new state."""
        nbytes = PAIR_BYTES * c.count
        if into is not None and nbytes <= into.size - HEADER.size:
            c.body, c.borrowed = into[HEADER.size:HEADER.size + nbytes], True
        elif self._reserve(nbytes):
            c.body, c.reserved = request_buffer(nbytes), nbytes
        else:
            c.state, c.left = DROP, nbytes - c.got
        return c.state

    def _part(self, c: Conn) -> memoryview:
        """Where the rest of ``c``'s current part goes: the header, the token, the ranges, or bytes to drop."""
        if c.state == HEAD:
            return memoryview(c.head)[c.got:HEADER.size]
        if c.state == TOKEN:
            return memoryview(c.head)[HEADER.size + c.got:HELLO_BYTES]
        if c.state == BODY:
            return memoryview(c.body)[c.got:]
        return memoryview(self._drop_buf)[:min(c.left, len(self._drop_buf))]

    def _answer_busy(self, c: Conn) -> bool:
        """The ranges of a read refused for lack of room are dropped: answer busy and keep serving (False: the
        connection must close)."""
        self._count("busy")
        REFUSALS.refused(self._where, c.peer, "requests in flight exceed the bound on their bytes; "
                                              "answered busy, the client reads over ZeroMQ")
        message = (f"raw read channel {self.address}: busy (more than {self.body_budget} bytes of "
                   "requests in flight); read over ZeroMQ").encode()
        if not self._send_small(c, HEADER.pack(MAGIC, VERSION, STATUS_BUSY, c.request_id, len(message)) + message):
            return False
        c.pending = False  # a whole request came (the hello's deadline is for connections that send none)
        c.next_message()
        c.last_active = time.monotonic()
        return True

    def _wait(self, c: Conn) -> int:
        """WAIT: a read's ranges that are only partly in go on in the loop, in a buffer of their own."""
        if c.state == BODY:
            c.slow = True
            if c.borrowed:
                c.borrowed = False
                partial, c.body = c.body, None
                nbytes = PAIR_BYTES * c.count
                if c.got and self._reserve(nbytes):
                    c.body, c.reserved = request_buffer(nbytes), nbytes
                    c.body[:c.got] = partial[:c.got]
                elif c.got:
                    c.state, c.left = DROP, nbytes - c.got
        return WAIT

    def _on_header(self, c: Conn) -> int | None:
        """Act on a complete header: None to go on receiving (a token, the ranges or bytes to drop), READY for
        a read without ranges, GONE after an error reply that closes the connection."""
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
            c.state, c.got = TOKEN, 0
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
        c.state, c.got, c.body = BODY, 0, None
        if count == 0:
            c.body = NO_PAIRS
            c.pending = False
            return READY
        return None

    def _on_token(self, c: Conn) -> bool:
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

    def _refuse(self, c: Conn, exc: Exception) -> int:
        """Answer ``exc`` on a connection whose framing can no longer be trusted; it closes."""
        self._send_small(c, error_reply(c.request_id, exc))
        if self.metrics is not None:
            self.metrics.record("read_ranges", 0.0, False)
        return GONE

    @staticmethod
    def _send_small(c: Conn, data: bytes) -> bool:
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

    def _release(self, c: Conn) -> None:
        c.body = None
        c.borrowed = False
        if c.reserved:
            with self._lock:
                self._in_flight -= c.reserved
            c.reserved = 0

    # ---- serving threads ------------------------------------------------------------------------
