"""The raw read channel's frame: the one description of what goes over its TCP connections, and the helpers both
ends share. Version 3 (``VERSION``), every word little-endian.

Every message, request or reply, is a 24-byte header (``HEADER``, ``<4sHHQQ``) and a body:

==========  =====  =====  =====================================================================================
field       bytes  type   meaning
==========  =====  =====  =====================================================================================
magic       0-3    4s     ``MAGIC``, ``b"ENGR"``
version     4-5    u16    ``VERSION``
code        6-7    u16    a request's op (``OP_READ``, ``OP_HELLO``) or a reply's status (``STATUS_*``)
request id  8-15   u64    chosen by the client; its reply carries it back (0 in a busy answer to a new connection)
count       16-23  u64    a read: its pairs; a hello: its token's bytes; a reply: its body's bytes
==========  =====  =====  =====================================================================================

The kernels (:mod:`engram_store.kernels.raw_io`) read a header as three little-endian int64 words
(``raw_io.HEADER_LAYOUT``: the kind, the request id, the count). The kind is magic, version and code in one word
(:func:`kind`; ``READ_KIND`` and ``OK_KIND`` are the ones they compare); its low 48 bits (magic and version) tell a
reply of another status from a reply of another protocol.

Requests (``OP_*``):

* ``OP_READ`` (1), a read: ``count`` pairs of int64 ``(offset, length)`` (``PAIR_BYTES`` each). A read may lead
  with checks of the objects it expects: pairs whose first word is negative, two per object,
  ``(-base - 1, generation)`` and ``(-size - 1, generation)`` (``kernels.check_pairs_for``); the segment answers
  only while each named object is still the put's that the client saw (else ``STATUS_STALE``). The ranges follow:
  the segment sends them back to back, in their order.
* ``OP_HELLO`` (2), a hello: ``count`` = ``TOKEN_BYTES`` (32) and a one-time token, ``HELLO_BYTES`` (56) in all.
  A segment started with CURVE keys (``--auth``) requires it as a connection's first message, so what a stranger
  can make it read is one fixed 56-byte message; its reply is ``STATUS_OK`` with an empty body.

Replies come in the order of the requests (a client may send several before it receives). Each has a status:

======  ===================  ==================  ==================================================================
status  name                 a client raises     when
======  ===================  ==================  ==================================================================
0       ``STATUS_OK``        (none)              the body is the ranges gathered back to back (a hello's: empty)
1       ``STATUS_INVALID``   InvalidArgument     a range outside the segment, too many bytes (the connection keeps
                                                 serving), or too many ranges in one read (it closes)
2       ``STATUS_PROTOCOL``  ProtocolError       another magic or version, an unknown op, a hello whose count is not
                                                 ``TOKEN_BYTES``: the connection closes after the reply
3       ``STATUS_AUTH``      AuthError           a read before the token, an unknown or expired token: it closes
4       ``STATUS_REMOTE``    RemoteError         anything else that went wrong on the segment
5       ``STATUS_BUSY``      (reads over ZeroMQ) not "the segment is down": a full channel answers a new connection
                                                 busy (request id 0) and closes it; a read whose ranges would take
                                                 the segment past its bytes in flight is answered busy on a
                                                 connection that stays open
6       ``STATUS_STALE``     StalePlacement      a check named an object that another put has written over since
======  ===================  ==================  ==================================================================

An error reply's body is ``count`` bytes (at most ``MESSAGE_BYTES``) of a UTF-8 message naming what was wrong and
the endpoint (``STATUS_ERRORS``: the exception for each status; ``ERROR_STATUS``: the status for each exception).
A reply that goes out in pieces (a large one) and whose objects change meanwhile is cut: the segment closes the
connection inside it, and the client reads the same ranges over ZeroMQ, whose reply is checked whole.

Versions: 1 took tokens of any length up to 1 KiB and had no busy status; 2 fixed the token at 32 bytes and added
busy (5); 3 lets a read lead with checks and adds stale (6). A header of another version is answered with a
protocol error naming both versions, and the connection is closed; segments say their version in their ping
(``raw_version``), and a client of another version reads over ZeroMQ.

Authentication: with ``--auth``, a client first asks for a token on the segment's ZeroMQ socket, main or reader
(``op: "channel_token"``, so only a client holding the cluster's CURVE keys gets one), then opens the TCP connection
with it. A token is good for one connection within ``limits.TOKEN_TTL_S``. The channel authenticates who may read
but does not encrypt; clients that need encryption read over ZeroMQ (``raw_reads=False``).

What bounds a connection (first messages, whole messages, idle connections, sends, bytes in flight, connections per
peer) is :mod:`.limits`; how a segment serves the channel is :mod:`._server`.
"""

from __future__ import annotations

import socket
import struct
import time

from ..errors import AuthError, InvalidArgument, ProtocolError, RemoteError, StalePlacement
from ..kernels import raw_io

MAGIC = b"ENGR"
VERSION = 3
HEADER = struct.Struct("<4sHHQQ")
#: A read's pair: int64 (offset, length), or a check (-base - 1 or -size - 1, generation); the kernels' words.
PAIR_BYTES = raw_io.PAIR_BYTES
OP_READ = 1
OP_HELLO = 2
STATUS_OK = 0
STATUS_INVALID = 1
STATUS_PROTOCOL = 2
STATUS_AUTH = 3
STATUS_REMOTE = 4
STATUS_BUSY = 5
STATUS_STALE = 6
#: A token's bytes: a hello is one fixed message of HELLO_BYTES.
TOKEN_BYTES = 32
HELLO_BYTES = HEADER.size + TOKEN_BYTES
#: The most bytes of an error reply's message.
MESSAGE_BYTES = 4096
#: Error statuses and the exception a client raises for each.
STATUS_ERRORS = {STATUS_INVALID: InvalidArgument, STATUS_PROTOCOL: ProtocolError, STATUS_AUTH: AuthError,
                 STATUS_REMOTE: RemoteError, STATUS_STALE: StalePlacement}
ERROR_STATUS = {InvalidArgument: STATUS_INVALID, ProtocolError: STATUS_PROTOCOL, AuthError: STATUS_AUTH,
                StalePlacement: STATUS_STALE}

# The kernels read the header as raw_io.HEADER_LAYOUT's words: the same bytes.
if HEADER.size != raw_io.HEADER_BYTES:
    raise ImportError(f"the raw frame's header ({HEADER.size} bytes) disagrees with the kernels' "
                      f"({raw_io.HEADER_BYTES})")


def kind(code: int) -> int:
    """A header's first word (magic, version, then ``code``: an op or a status) as the kernels compare it
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
    message = str(exc).encode()[:MESSAGE_BYTES]
    return HEADER.pack(MAGIC, VERSION, ERROR_STATUS.get(type(exc), STATUS_REMOTE), request_id, len(message)) + message


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
