"""The raw read channel's framing, shared by the segments that serve it and the clients that read from it.

Every message starts with a 24-byte header ``<4sHHQQ``: magic ``b"ENGR"``, version, op or status, request id,
count; see :mod:`engram_store.raw.frame` for the protocol and its bounds.
"""

from __future__ import annotations

import socket
import struct
import time

from .._errors import AuthError, InvalidArgument, ProtocolError, RemoteError, StalePlacement

MAGIC = b"ENGR"
#: 3: reads may lead with checks of the objects they expect (pairs with negative offsets; see
#: ``engram_store.kernels.check_generations``) and a refusal is StalePlacement (status 6).
VERSION = 3
HEADER = struct.Struct("<4sHHQQ")
OP_READ = 1
OP_HELLO = 2
STATUS_OK = 0
STATUS_BUSY = 5
#: A token's bytes: a hello is one fixed message of HELLO_BYTES.
TOKEN_BYTES = 32
HELLO_BYTES = HEADER.size + TOKEN_BYTES
#: Error statuses and the exception a client raises for each.
STATUS_ERRORS = {1: InvalidArgument, 2: ProtocolError, 3: AuthError, 4: RemoteError, 6: StalePlacement}
ERROR_STATUS = {InvalidArgument: 1, ProtocolError: 2, AuthError: 3, StalePlacement: 6}


def kind(code: int) -> int:
    """A header's first word (magic, version, then ``code``: an op or a status) as the native kernels compare it
    (``engram_store.kernels.read_direct`` and ``serve_read``: a little-endian int64)."""
    return int.from_bytes(HEADER.pack(MAGIC, VERSION, code, 0, 0)[:8], "little", signed=True)


READ_KIND = kind(OP_READ)
OK_KIND = kind(STATUS_OK)


class PeerClosed(ConnectionError):
    """The peer closed the connection before a whole message (or part of one) came: ``got`` of its ``wanted``
    bytes had. A receive is whole or it raises: nothing that reads a message ever takes part of one as all."""

    def __init__(self, got: int, wanted: int):
        super().__init__(f"peer closed the connection after {got} of {wanted} bytes")
        self.got = got
        self.wanted = wanted


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``, or raise: PeerClosed if the peer closes first (``got == 0``: before the first
    byte), OSError (a timeout too) as the socket raises it."""
    got = 0
    n = view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerClosed(got, n)
        got += k


def request_id_of(head: bytes) -> int:
    """The request id of a packed header."""
    return HEADER.unpack(head)[3]


def error_reply(request_id: int, exc: Exception) -> bytes:
    message = str(exc).encode()[:4096]
    return HEADER.pack(MAGIC, VERSION, ERROR_STATUS.get(type(exc), 4), request_id, len(message)) + message


def sendmsg_all(conn: socket.socket, buffers: list, timeout_s: float | None = None,
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


def timeval(seconds: float) -> bytes:
    """A ``struct timeval`` for SO_RCVTIMEO / SO_SNDTIMEO."""
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def set_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel-side timeouts of ``seconds`` on each send and receive of a blocking ``sock``."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(seconds))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(seconds))
