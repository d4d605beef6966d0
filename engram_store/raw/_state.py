"""A raw-channel connection's state and a serving thread's buffers: what the event loop and the serving
threads hand each other."""

from __future__ import annotations

import mmap
import socket

import numpy as np

from .._peers import LEDGER
from ..kernels.raw_io import SERVER_STATE_WORDS
from .frame import HEADER, HELLO_BYTES, PAIR_BYTES
from . import limits

# Receiving states of a connection, and what advancing it can end in.
HEAD, TOKEN, BODY, DROP = range(4)
READY, WAIT, GONE = range(3)
LISTENER, WAKE = object(), object()
NO_PAIRS = np.zeros(0, dtype=np.uint8)


def request_buffer(n: int) -> np.ndarray:
    """A writable uint8 buffer of ``n`` bytes; a large one is a mapping of its own, unmapped when dropped."""
    if n < limits.MMAP_MIN_BYTES:
        return np.empty(n, dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)


def open_files_cap(requested: int) -> int:
    """``requested`` connections, or fewer: at most half of what the open-files limit leaves the process's connections
    (``_peers.LEDGER``), so the segment's ZeroMQ sockets keep the other half."""
    return min(requested, max(16, LEDGER.budget // 2))


class Buffers:
    """A serving thread's buffers, grown on demand and dropped when it is idle: the reply (a header and at most
    limits.STREAM_MIN_BYTES: a reply is gathered behind its header and sent in one piece) and the requests received
    from the connection it serves (a header and at most limits.REQUEST_KEEP_BYTES of ranges; ``request[start:end]``
    holds bytes received and not used yet: the start of the next request, or whole requests a client sent ahead).
    ``state``: the serving kernel's words (``kernels.serve_read``), kept."""

    __slots__ = ("reply", "request", "start", "end", "state")

    def __init__(self) -> None:
        self.reply: np.ndarray | None = None
        self.request: np.ndarray | None = None
        self.start = self.end = 0
        self.state = np.zeros(SERVER_STATE_WORDS, dtype=np.int64)

    def reply_room(self, nbytes: int) -> np.ndarray:
        """The reply buffer, with room for a header and ``nbytes`` behind it (grown to at most a header and
        limits.STREAM_MIN_BYTES, and at least 64 KiB)."""
        buf = self.reply
        if buf is None or buf.size < HEADER.size + nbytes:
            old = 0 if buf is None else buf.size - HEADER.size
            buf = self.reply = np.empty(HEADER.size + min(limits.STREAM_MIN_BYTES, max(nbytes, 1 << 16, 2 * old)),
                                        dtype=np.uint8)
        return buf

    def drop(self) -> None:
        self.reply = self.request = None
        self.start = self.end = 0

    def room(self, nbytes: int) -> np.ndarray | None:
        """The request buffer, with room for ``request[start:start + nbytes]`` and ``start`` 8-byte aligned (the
        bytes not used yet kept), or None past a header and limits.REQUEST_KEEP_BYTES."""
        if nbytes > HEADER.size + limits.REQUEST_KEEP_BYTES:
            return None
        buf = self.request
        if buf is None or buf.size < nbytes:
            size = HEADER.size + min(limits.REQUEST_KEEP_BYTES,
                                     max(nbytes - HEADER.size, PAIR_BYTES * limits.SMALL_RANGES,
                                         0 if buf is None else 2 * (buf.size - HEADER.size)))
            grown = np.empty(size, dtype=np.uint8)
            if self.end > self.start:
                grown[:self.end - self.start] = buf[self.start:self.end]
            buf, self.request, self.end, self.start = grown, grown, self.end - self.start, 0
        elif self.start + nbytes > buf.size or self.start % 8:
            buf[:self.end - self.start] = buf[self.start:self.end].copy()
            self.end, self.start = self.end - self.start, 0
        return buf


class Conn:
    """One connection's state: a few fields and a hello-sized buffer (the loop may hold thousands)."""

    __slots__ = ("sock", "peer", "head", "got", "state", "body", "reserved", "borrowed", "slow", "left",
                 "request_id", "count", "accepted", "msg_start", "last_active", "authenticated", "pending",
                 "in_loop", "fed")

    def __init__(self, sock: socket.socket, peer: str, now: float, authenticated: bool):
        self.sock = sock
        self.peer = peer
        self.head = bytearray(HELLO_BYTES)  # a header, or a hello's header and token
        self.got = 0  # bytes of the current part received
        self.state = HEAD
        self.body: np.ndarray | None = None  # the ranges of a read being received (None: no buffer yet)
        self.reserved = 0  # bytes of BODY_BYTES_IN_FLIGHT held for ``body``
        self.borrowed = False  # ``body`` is a serving thread's buffer
        self.slow = False  # the ranges did not come with the header: the loop receives them
        self.left = 0  # bytes still to drop (DROP)
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
        return self.state == BODY and self.body is not None and self.got == PAIR_BYTES * self.count

    def next_message(self) -> None:
        self.state = HEAD
        self.got = 0
        self.msg_start = 0.0
        self.slow = False
