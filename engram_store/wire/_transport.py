"""ZeroMQ transport: a ROUTER server loop and DEALER client connections with timeouts.

The transport knows messages, not operations: servers register one handler per ``op`` and clients send
``(op, fields, frames)``. A DEALER socket is used by one thread only; :class:`ConnectionPool` keeps one per
(thread, endpoint). A request that times out discards its socket, so a late reply can never be mistaken
for the answer to a later request.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import signal
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import zmq

from ._auth import AuthKeys, ensure_authenticator
from ._guard import ConnectionGuard, bound_socket
from ._sockets import _context, failed, new_socket
from .._errors import EngramError, InvalidArgument, ProtocolError, Unavailable, describe, error_from_reply
from .._metrics import RequestMetrics
from ._protocol import PROTOCOL_VERSION, Request, decode, encode, error_reply, pack_header, unpack_header

log = logging.getLogger(__name__)

Handler = Callable[[Request], "tuple[dict | None, Sequence[Any]] | dict | None"]

DEFAULT_TIMEOUT_MS = 10_000
#: Messages beyond this many bytes are dropped by ZeroMQ before they reach a handler.
DEFAULT_MAX_MESSAGE_BYTES = 512 << 20
#: Bound on queued messages per peer, so a flood cannot grow a server's memory without limit.
DEFAULT_HWM = 1000
#: Reply frames at least this long are sent zero-copy; shorter ones are copied into the message. A zero-copy
#: frame is released by pyzmq's garbage-collector thread (a wake-up and a GIL hand-off per reply), which
#: costs more than copying a few hundred KiB: 1-2 client processes read 128 KiB replies 5-12% faster with
#: them copied (64 KiB threshold against 1 MiB, bench harness on a 2-core VM).
ZERO_COPY_MIN_BYTES = 256 << 10
_MORE = zmq.SNDMORE | zmq.NOBLOCK
#: Requests whose frames total at least this many bytes are sent without a copy.
ZERO_COPY_SEND_BYTES = 64 << 10


class RpcServer:
    """A ROUTER socket bound to ``host:port`` that dispatches requests to handlers by ``op``.

    Handlers return a reply-fields dict, or ``(fields, frames)``; an exception becomes an error reply and
    the loop keeps serving. ``tick`` (if given) runs every ``tick_ms`` from the serving thread.

    The loop blocks in ``recv`` with a receive timeout of ``tick_ms``, so an idle server wakes only to tick
    and to notice :meth:`stop`; a busy one goes from message to message without polling. Reply frames
    shorter than :data:`ZERO_COPY_MIN_BYTES` are copied into the message (cheaper than handing ZeroMQ a
    buffer to pin and release), longer ones are sent zero-copy.

    ``io_affinity`` (a bit mask, bit i = I/O thread i; 0 = any) pins the socket's connections to ZeroMQ I/O
    threads, so one busy socket does not delay another's messages (see :func:`io_threads`).

    With ``auth`` (keys loaded with ``load_keys(dir, server=True)``) the socket is a CURVE server that admits
    only the clients authorised in that key directory (see :mod:`engram_store.wire._auth`); refused connections
    are logged at WARNING. Every server bounds what its peers hold (:mod:`engram_store.wire._guard`): handshake
    deadlines and heartbeats, and caps on connections per peer and in all, kept by a small thread that reads the
    socket's monitor events.
    """

    def __init__(
        self,
        host: str,
        port: int,
        name: str,
        handlers: dict[str, Handler],
        *,
        tick: Callable[[], None] | None = None,
        tick_ms: int = 100,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        auth: AuthKeys | None = None,
        metrics_prefix: str = "engram",
        io_affinity: int = 0,
    ):
        if tick_ms <= 0:
            raise InvalidArgument(f"tick_ms: expected > 0, got {tick_ms}")
        self.name = name
        self.handlers = handlers
        self.metrics = RequestMetrics(metrics_prefix)
        self._tick = tick
        self._tick_ms = tick_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        context = _context()
        self.socket = new_socket(zmq.ROUTER, f"serving {name}")
        self.socket.setsockopt(zmq.LINGER, 0)
        if io_affinity:
            self.socket.setsockopt(zmq.AFFINITY, io_affinity)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.socket.setsockopt(zmq.RCVHWM, DEFAULT_HWM)
        self.socket.setsockopt(zmq.SNDHWM, DEFAULT_HWM)
        self.socket.setsockopt(zmq.RCVTIMEO, tick_ms)
        self.socket.copy_threshold = ZERO_COPY_MIN_BYTES
        bound_socket(self.socket)
        if auth is not None:
            self._serve_curve(context, auth)
        try:  # before the bind: the guard sees every connection
            self._guard = ConnectionGuard(self.socket, name, log_handshakes=auth is not None)
        except BaseException:
            self.socket.close(0)
            raise
        bind_host = f"[{host}]" if ":" in host else host
        try:
            if port == 0:
                self.port = self.socket.bind_to_random_port(f"tcp://{bind_host}")
            else:
                self.socket.bind(f"tcp://{bind_host}:{port}")
                self.port = port
        except zmq.ZMQError as exc:
            self._guard.close(self.socket)
            self.socket.close(0)
            raise Unavailable(f"{name}: cannot bind tcp://{bind_host}:{port}: {exc}") from exc
        self.host = host
        self._guard.start()  # the serving loop blocks in recv: connections are watched by a thread of their own

    def _serve_curve(self, context: zmq.Context, auth: AuthKeys) -> None:
        """Make the socket a CURVE server behind the authenticator."""
        try:
            # The authenticator must run before the socket accepts anyone: without a ZAP handler,
            # libzmq would admit every client that knows the server's public key.
            self.socket.zap_domain = ensure_authenticator(context, auth).encode()
            self.socket.curve_server = True
            self.socket.curve_secretkey = auth.server_secret
        except BaseException:
            self.socket.close(0)
            raise

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` is called (from any thread) or the process is interrupted."""
        recv = self.socket.recv_multipart
        handle = self._handle
        stop = self._stop
        tick = self._tick
        tick_s = self._tick_ms / 1000.0
        next_tick = time.monotonic() + tick_s if tick is not None else float("inf")
        while not stop.is_set():
            try:
                msg = recv(copy=False)
            except zmq.Again:  # idle for tick_ms: only the tick and the stop check to do
                msg = None
            except zmq.ZMQError as exc:
                if self._closed or exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("%s: receive failed: %s", self.name, exc)
                continue
            if msg is not None:
                handle(msg)
            if tick is not None:
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + tick_s
                    try:
                        tick()
                    except Exception:  # a tick failure must not stop the server
                        log.exception("%s: periodic task failed", self.name)

    def connection_stats(self) -> dict[str, int]:
        """The socket's connections now and the guard's closes since the start (``ConnectionGuard.stats``)."""
        return self._guard.stats()

    def _handle(self, msg: list) -> None:
        if len(msg) < 2:
            return  # not even an identity and a header: nothing to answer to
        start = time.perf_counter()
        request_id: object = -1
        op = "malformed"
        ok = False
        frames: Sequence[Any] = ()
        try:
            header = unpack_header(msg[1].buffer)
            request_id = header.get("id")
            name = header.get("op")
            if type(request_id) is not int:
                raise ProtocolError(f"field 'id': expected an integer request id, got {describe(request_id)}")
            if type(name) is not str:
                raise ProtocolError(f"field 'op': expected a string, got {describe(name)}")
            handler = self.handlers.get(name)
            if handler is None:
                op = "unknown"
                raise ProtocolError(f"unknown op {name!r}; this server answers {sorted(self.handlers)}")
            op = name
            result = handler(Request.checked(header, msg[2:], request_id, name))
            if type(result) is tuple:
                fields, frames = result
            else:
                fields = result
            reply = {"v": PROTOCOL_VERSION, "id": request_id, "ok": True}
            if fields:
                reply.update(fields)
            head = pack_header(reply)
            ok = True
        except Exception as exc:  # an error reply; a bug in a handler is also logged; the loop keeps serving
            if not isinstance(exc, EngramError):
                log.exception("%s: handler failed", self.name)
            head = pack_header({"v": PROTOCOL_VERSION, **error_reply(request_id, exc)})
            frames = ()
        self.metrics.record(op, time.perf_counter() - start, ok)
        # A ROUTER never blocks on send (a message to a gone or flooded peer is dropped), so NOBLOCK only
        # guards against surprises; copy=False lets copy_threshold pick copy or zero-copy per frame.
        sock = self.socket
        try:
            sock.send(msg[0], _MORE, copy=False)
            if not frames:
                sock.send(head, zmq.NOBLOCK, copy=False)
                return
            sock.send(head, _MORE, copy=False)
            last = len(frames) - 1
            for i, frame in enumerate(frames):
                sock.send(frame, _MORE if i < last else zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            log.warning("%s: could not send a reply: %s", self.name, exc)

    def start(self) -> "RpcServer":
        """Serve from a daemon thread; returns self."""
        self._thread = threading.Thread(target=self.serve_forever, name=f"engram-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Stop serving and release the socket; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._guard.close(self.socket)
        self.socket.close(0)


class Connection:
    """A DEALER socket to one server, used by one thread at a time.

    ZeroMQ sockets must not be closed by one thread while another waits on them (libzmq aborts the process): a
    connection another thread may be using is :meth:`abandon`-ed instead, and its own thread closes the socket at
    its next use (or the socket is closed when the connection is collected).
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

    ``close()`` closes the connections of the calling thread and of threads that have exited; those of other live
    threads (a background placement check waiting on a stopped master, a prefetch) are abandoned, so their own
    thread closes them when its call returns (see :class:`Connection`).

    ``curve`` (``(server public, client public, client secret)``, see ``AuthKeys.client_curve``) makes every
    connection a CURVE client; one key directory serves a whole cluster, so all servers share the server key.
    """

    def __init__(self, curve: tuple[bytes, bytes, bytes] | None = None):
        self._local = threading.local()
        self._all: list[tuple[int, Connection]] = []  # (owning thread's ident, connection)
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
                self._all.append((threading.get_ident(), conn))
        return conn

    def close(self) -> None:
        self._closed = True
        with self._lock:
            conns, self._all = self._all, []
        me = threading.get_ident()
        alive = {thread.ident for thread in threading.enumerate()}
        for owner, conn in conns:
            if owner == me or owner not in alive:
                conn.close()
            else:
                conn.abandon()


class Stopped(SystemExit):
    """SIGTERM or SIGINT arrived while a server was starting: it stops there, cleaning up what it had set up."""


@contextlib.contextmanager
def stop_on_signal_while_starting() -> Iterator[None]:
    """Make SIGTERM and SIGINT end a server's start (registering, replaying a journal) cleanly: they raise
    :class:`Stopped` (exit status 0) in the starting code, whose cleanup runs, instead of killing the process
    with its shared memory and files left behind. :func:`serve_until_signalled` takes the signals over after."""
    def stop(signum: int, frame: Any) -> None:
        raise Stopped(0)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except BaseException:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        raise


def serve_until_signalled(server: Any) -> int:
    """Serve from this thread until SIGTERM or SIGINT, then close ``server``; the exit code of a CLI.

    ``server`` is a master or segment server (``serve_forever``, ``stop``, ``close``); the signal only asks the
    serving loop to stop, so the close (unregistering, removing shared memory) runs in the normal flow.
    """
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0
