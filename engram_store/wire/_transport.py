"""ZeroMQ transport: a ROUTER server loop that dispatches requests to handlers (the clients' side is ``_client``).

The transport knows messages, not operations: servers register one handler per ``op`` and clients send
``(op, fields, frames)``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import zmq

from ._auth import AuthKeys, ensure_authenticator
from ._guard import ConnectionGuard, bound_socket
from ._sockets import _context, new_socket
from ..errors import EngramError, InvalidArgument, ProtocolError, Unavailable, describe
from ..metrics import RequestMetrics
from ._protocol import PROTOCOL_VERSION, Request, error_reply, pack_header, unpack_header

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
