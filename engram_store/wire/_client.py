"""ZeroMQ client connections with timeouts: the DEALER side of ``_transport``'s servers.

A DEALER socket is used by one thread only; :class:`ConnectionPool` keeps one per (thread, endpoint). A request
that times out discards its socket, so a late reply can never be mistaken for the answer to a later request.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from typing import Any, Iterable, Sequence

import zmq

from ..errors import EngramError, ProtocolError, Unavailable, error_from_reply
from ._protocol import PROTOCOL_VERSION, decode, encode, pack_header
from ._sockets import failed, new_socket
from ._transport import DEFAULT_HWM, DEFAULT_TIMEOUT_MS


class Connection:
    """A DEALER socket to one server, used by one thread at a time.

    ZeroMQ sockets must not be closed by one thread while another waits on them (libzmq aborts the process): a
    connection another thread may be using is :meth:`abandon`-ed instead, and its own thread closes the socket at
    its next use (or the socket is closed when the connection is collected).

    A send or receive that stops part-way (a signal's exception, such as KeyboardInterrupt, between two frames of a
    message) drops the socket: the frames sent would otherwise begin the next request's message (the server would
    read that request's header as this one's data), and the frames left would be read as the next reply.
    """

    _ids = itertools.count(1)

    def __init__(
        self,
        address: str,
        *,
        unavailable: type[Unavailable] = Unavailable,
        curve: tuple[bytes, bytes, bytes] | None = None,
    ):
        self.address = address
        self.unavailable = unavailable
        self._curve = curve
        self.socket: zmq.Socket | None = None
        self._abandoned = False

    def _open(self) -> zmq.Socket:
        if self._abandoned:
            self.reset()
            raise self.unavailable(f"the client is closed; cannot reach {self.address}")
        if self.socket is None:
            try:
                sock = new_socket(zmq.DEALER, f"connecting to {self.address}")
            except zmq.ZMQError as exc:
                raise self.unavailable(f"cannot open a connection to {self.address}: {exc}") from exc
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, DEFAULT_HWM)
            sock.setsockopt(zmq.SNDHWM, DEFAULT_HWM)
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            if self._curve is not None:
                server_public, public, secret = self._curve
                sock.curve_serverkey = server_public
                sock.curve_publickey = public
                sock.curve_secretkey = secret
            host, _, port = self.address.rpartition(":")
            sock.connect(f"tcp://{host}:{port}")
            self.socket = sock
        return self.socket

    def reset(self) -> None:
        """Drop the socket (after a timeout), so that a late reply is never read as a new one."""
        if self.socket is not None:
            self.socket.close(0)
            self.socket = None

    def send(self, op: str, fields: dict | None = None, frames: Iterable[Any] = ()) -> int:
        request_id = next(self._ids)
        self._send(op, encode({"id": request_id, "op": op, **(fields or {})}, frames), copy=False)
        return request_id

    def send_frames(self, op: str, frames: Sequence[Any], copy: bool = True) -> int:
        """Send a request with no header fields but ``op``: the hot path of reads (a header packed directly;
        ``copy=True`` for small frames, which pyzmq copies faster than it tracks them for zero-copy)."""
        request_id = next(self._ids)
        self._send(op, (pack_header({"v": PROTOCOL_VERSION, "id": request_id, "op": op}), *frames), copy)
        return request_id

    def _send(self, op: str, msg: Sequence[Any], copy: bool) -> None:
        try:
            (self.socket or self._open()).send_multipart(msg, copy=copy, flags=zmq.NOBLOCK)
        except zmq.Again as exc:
            self.reset()
            raise self.unavailable(f"{op}: {self.address} is not accepting requests (queue full)") from exc
        except zmq.ZMQError as exc:
            self.reset()
            raise failed(self.address, self.unavailable, f"{op}: cannot send to {self.address}: {exc}", exc) from exc
        except BaseException:
            self.reset()  # interrupted between frames: the message must not be finished by the next one
            raise

    def recv(self, request_id: int, deadline: float, op: str = "request", copy: bool = False) -> tuple[dict, list]:
        """Wait for the reply to ``request_id`` until ``deadline`` (time.monotonic); raise on error replies.

        Blocks in the receive itself (a receive timeout, no poll per call); ``copy=True`` receives bytes
        (cheaper for small replies), else zero-copy frames.
        """
        sock = self._open()
        while True:
            # Past the deadline a reply that is already queued is still taken (0: do not wait): several
            # requests are received one after the other, and one server's timeout must not fail the rest.
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            sock.setsockopt(zmq.RCVTIMEO, remaining_ms)
            try:
                msg = sock.recv_multipart(copy=copy)
            except zmq.Again:
                self.reset()
                raise failed(self.address, self.unavailable, f"{op}: no reply from {self.address} within the timeout") \
                    from None
            except zmq.ZMQError as exc:
                self.reset()
                raise failed(self.address, self.unavailable, f"{op}: receiving from {self.address} failed: {exc}",
                             exc) from exc
            except BaseException:
                self.reset()  # interrupted between frames: what is left of the message is no reply to read
                raise
            header, frames = self.parse(msg, op)
            if header.get("id") != request_id:
                continue  # a stale reply to an abandoned request
            return header, frames

    def parse(self, msg: list, op: str) -> tuple[dict, list]:
        try:
            header, frames = decode(msg)
        except ProtocolError as exc:
            self.reset()
            raise ProtocolError(f"{op}: bad reply from {self.address}: {exc}") from exc
        if header.get("ok") is not True:
            raise error_from_reply(header.get("code"), header.get("message"), self.address)
        return header, frames

    def call(
        self, op: str, fields: dict | None = None, frames: Iterable[Any] = (), timeout_ms: int = DEFAULT_TIMEOUT_MS
    ) -> tuple[dict, list]:
        deadline = time.monotonic() + timeout_ms / 1000.0
        request_id = self.send(op, fields, frames)
        return self.recv(request_id, deadline, op)

    def close(self) -> None:
        """Close the socket; the connection is not used again."""
        self._abandoned = True
        self.reset()

    def abandon(self) -> None:
        """Close from another thread: the owner closes the socket at its next use, never mid-call."""
        self._abandoned = True

    def __del__(self) -> None:
        socket, self.socket = getattr(self, "socket", None), None
        if socket is not None and not socket.closed:
            socket.close(0)


def wait_all(pending: Sequence[tuple[Connection, int]], deadline: float, op: str) -> list:
    """Wait for the reply to each (connection, request id) pair, polling all sockets at once.

    Several requests may be outstanding on one connection. Returns a list aligned with ``pending``
    holding ``(header, frames)`` or the exception for that request (error reply or timeout); it never
    raises for a single request's failure.
    """
    results: list = [None] * len(pending)
    waiting: dict[Any, dict[int, int]] = {}  # socket -> {request id: index in pending}
    conns: dict[Any, Connection] = {}
    for i, (conn, request_id) in enumerate(pending):
        if conn.socket is None:
            results[i] = conn.unavailable(f"{op}: connection to {conn.address} was reset")
            continue
        waiting.setdefault(conn.socket, {})[request_id] = i
        conns[conn.socket] = conn
    poller = zmq.Poller()
    for sock in waiting:
        poller.register(sock, zmq.POLLIN)
    while waiting:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        events = dict(poller.poll(remaining_ms)) if remaining_ms > 0 else {}
        if not events:
            for sock, ids in waiting.items():
                conn = conns[sock]
                conn.reset()
                for i in ids.values():
                    results[i] = conn.unavailable(f"{op}: no reply from {conn.address} within the timeout")
            break
        for sock in events:
            conn = conns[sock]
            ids = waiting[sock]
            while ids:
                try:
                    msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                except BaseException:
                    conn.reset()  # interrupted between frames (see Connection)
                    raise
                try:
                    header, frames = conn.parse(msg, op)
                    reply: Any = (header, frames)
                    request_id = header.get("id")
                except EngramError as exc:
                    reply = exc
                    request_id = _reply_id(msg)
                i = ids.pop(request_id, None)
                if i is not None:
                    results[i] = reply
                if conn.socket is None:  # parse() reset it after a malformed reply
                    for j in ids.values():
                        results[j] = reply if isinstance(reply, BaseException) else ProtocolError(op)
                    ids.clear()
            if not ids:
                poller.unregister(sock)
                del waiting[sock]
    return results


def _reply_id(msg: list) -> int | None:
    try:
        header, _ = decode(msg)
    except ProtocolError:
        return None
    return header.get("id")


class ConnectionPool:
    """One :class:`Connection` per (thread, server address); closes them all at once.

    A thread's connections live in its own thread-local storage and nowhere else (the pool knows them weakly): a
    thread that ends takes them with it, and each closes its socket as it is collected, so short-lived threads
    that each made a call do not leave a socket apiece behind. ``close()`` closes the connections of the calling
    thread and of threads that have exited; those of other live threads (a background placement check waiting on
    a stopped master, a prefetch) are abandoned, so their own thread closes them when its call returns (see
    :class:`Connection`).

    ``curve`` (``(server public, client public, client secret)``, see ``AuthKeys.client_curve``) makes every
    connection a CURVE client; one key directory serves a whole cluster, so all servers share the server key.
    """

    def __init__(self, curve: tuple[bytes, bytes, bytes] | None = None):
        self._local = threading.local()
        self._all: weakref.WeakKeyDictionary[Connection, int] = weakref.WeakKeyDictionary()  # -> its thread's ident
        self._lock = threading.Lock()
        self._curve = curve
        self._closed = False

    def get(self, address: str, unavailable: type[Unavailable]) -> Connection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(address)
        if conn is None:
            if self._closed:
                raise unavailable(f"the client is closed; cannot reach {address}")
            conn = conns[address] = Connection(address, unavailable=unavailable, curve=self._curve)
            with self._lock:
                self._all[conn] = threading.get_ident()
        return conn

    def close(self) -> None:
        self._closed = True
        with self._lock:
            conns, self._all = list(self._all.items()), weakref.WeakKeyDictionary()
        me = threading.get_ident()
        alive = {thread.ident for thread in threading.enumerate()}
        for conn, owner in conns:
            if owner == me or owner not in alive:
                conn.close()
            else:
                conn.abandon()
