"""Bounds on what peers can hold of a ZeroMQ server socket: connections per peer and in all, handshakes that must
finish, silent peers dropped.

libzmq accepts every TCP connection its listener sees and keeps it until the peer closes it or the handshake
interval (30 s by default) runs out: a stranger who opened a thousand connections and said nothing held a thousand
descriptors, and at the open-files limit libzmq's listener spins on the connection it cannot accept (a core, until
the stranger leaves), while clients with the cluster's keys got no answer. What libzmq offers is set on every
server socket (:func:`bound_socket`):

* ``ZMQ_HANDSHAKE_IVL`` (:data:`HANDSHAKE_MS`): a connection that has not completed its handshake (with ``--auth``,
  CURVE and the authenticator's answer) within it is closed;
* ``ZMQ_HEARTBEAT_IVL`` / ``ZMQ_HEARTBEAT_TIMEOUT``: a ping every :data:`HEARTBEAT_IVL_MS`, and a connection that
  stays silent :data:`HEARTBEAT_TIMEOUT_MS` after one is closed (a peer that vanished, or one that spoke ZMTP and
  stopped); libzmq peers answer pings by themselves;
* ``ZMQ_MAXMSGSIZE`` and the high-water marks (set by ``RpcServer``).

What it does not offer, caps, :class:`ConnectionGuard` adds from the socket's monitor. Every accepted connection is
named by its peer (``_peers.PeerNames``: the address, and the user for a connection from this host) and kept in a
``Holders`` table; it is **unproven** during its first handshake interval (libzmq's events do not say which
connection a handshake completed, but one alive past the interval has completed it). A peer may hold
:data:`UNPROVEN_PER_PEER` unproven connections (past them its oldest goes) and :data:`CONNECTIONS_PER_PEER` in all
(past them its new one goes); when the process's connection budget (``_peers.LEDGER``: the open-files limit less a
reserve) is spent, the oldest unproven connection of the peer holding the most goes, else the new one. The guard
closes a connection with ``shutdown(2)`` on libzmq's descriptor, after checking that it still joins the same two
addresses, and libzmq closes it as a peer that went away. When libzmq cannot accept at all (out of descriptors),
each failure frees unproven connections, the busiest peer's first.

The monitor's events reach the guard through a bounded inproc pipe, and libzmq's I/O thread waits when it is full:
accepting never runs more than about a thousand connections ahead of the guard, so the guard's thread keeps reading
for as long as the monitor is on (:meth:`ConnectionGuard.close` takes the monitor off while it still reads).
With ``--auth``, handshakes that failed before the authenticator saw them are logged as refusals (the peer from the
guard's table); refusals and closes are logged at a bounded rate (``_peers.REFUSALS``).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import threading
import time
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from .._peers import LEDGER, REFUSALS, Holders, PeerNames

log = logging.getLogger(__name__)

#: A connection must complete its handshake within this (libzmq's default: 30 s).
HANDSHAKE_MS = 5_000
#: Servers ping every connection this often, and close one silent this long after a ping.
HEARTBEAT_IVL_MS = 15_000
HEARTBEAT_TIMEOUT_MS = 60_000
#: Connections one peer may hold that have not completed a handshake yet (they live HANDSHAKE_MS at most).
UNPROVEN_PER_PEER = 64
#: Connections one peer may hold in all (at most half the process's connection budget).
CONNECTIONS_PER_PEER = 4096
#: How often the guard's thread wakes with no event: to age connections past their handshake and to see a close.
WAKE_MS = 200
#: Unproven connections freed at most per failed accept (libzmq retries at once).
FREE_ON_FAILED_ACCEPT = 16
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def bound_socket(sock: zmq.Socket) -> None:
    """Set a server socket's handshake deadline and heartbeats (before it binds)."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


class _Entry:
    """One accepted connection: libzmq's descriptor, its peer, when the guard saw it."""

    __slots__ = ("fd", "peer", "name", "born", "closing")

    def __init__(self, fd: int, peer: str, name: str, born: float):
        self.fd = fd
        self.peer = peer  # HOST:PORT
        self.name = name  # the peer's name in Holders: HOST, or "HOST uid N"
        self.born = born
        self.closing = False


class ConnectionGuard:
    """Caps on the connections of one ZeroMQ server socket, kept by a thread reading the socket's monitor (see the
    module docstring). ``handshake_reasons`` (with --auth) logs handshakes that failed before the authenticator."""

    EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED
              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)

    def __init__(self, sock: zmq.Socket, name: str, *, log_handshakes: bool = False):
        self.name = name
        self._log_handshakes = log_handshakes
        self._monitor = sock.get_monitor_socket(self.EVENTS)
        self._monitor.setsockopt(zmq.RCVTIMEO, WAKE_MS)
        self._holders = Holders(per_peer=max(UNPROVEN_PER_PEER, min(CONNECTIONS_PER_PEER, LEDGER.budget // 2)),
                                unproven_per_peer=UNPROVEN_PER_PEER)
        self._entries: dict[int, _Entry] = {}
        self._young: collections.deque[_Entry] = collections.deque()  # accept order, for aging
        self._closing = 0  # connections shut down whose disconnect has not come yet
        self._names = PeerNames()
        self._failed: str | None = None
        self._counts: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"engram-{name}-guard")
        self._handlers: dict[int, Callable[[int], None]] = {
            zmq.EVENT_ACCEPTED: self._accepted, zmq.EVENT_DISCONNECTED: self._disconnected,
            zmq.EVENT_ACCEPT_FAILED: self._accept_failed,
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: self._handshake_failed_protocol,
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: self._handshake_failed}

    def start(self) -> "ConnectionGuard":
        self._thread.start()
        return self

    def stats(self) -> dict[str, int]:
        """Connections held now and closes since the start (``closed_unproven``: a peer over its unproven cap,
        ``closed_over_peer_cap``, ``closed_for_budget``, ``accept_failed``); read from any thread."""
        return {"connections": len(self._entries), **self._counts}

    def close(self, sock: zmq.Socket) -> None:
        """Take the monitor off ``sock`` (whose other users have stopped) while the thread still reads it, then stop
        the thread. Safe to call twice."""
        if self._monitor is None:
            return
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._stop.set()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._monitor.close(0)
        self._monitor = None
        self._names.close()
        LEDGER.add(-len(self._entries))
        self._entries.clear()

    # ---- the thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        monitor, stop = self._monitor, self._stop
        next_age = time.monotonic()
        while not stop.is_set():
            try:
                event = recv_monitor_message(monitor)
            except zmq.Again:
                event = None
            except zmq.ZMQError:
                return  # the monitor was closed: the server is going away
            except (ValueError, IndexError) as exc:
                log.debug("%s: unreadable monitor event: %s", self.name, exc)
                continue
            try:
                if event is not None:
                    handler = self._handlers.get(event["event"])
                    if handler is not None:
                        handler(event["value"])
                now = time.monotonic()
                if now >= next_age:
                    next_age = now + WAKE_MS / 1000
                    self._age(now)
            except Exception:  # a bug: log it and keep reading, or libzmq's I/O thread would wait on the pipe
                log.exception("%s: guarding connections failed", self.name)

    def _accepted(self, fd: int) -> None:
        named = self._names.name_fd(fd)
        if named is None:
            return  # closed before it was seen: its disconnect follows, and finds nothing
        stale = self._entries.pop(fd, None)
        if stale is not None:  # a disconnect the guard did not see (cannot happen: the pipe never drops events)
            self._forget(stale)
        entry = _Entry(fd, named[0], named[1], time.monotonic())
        holders = self._holders
        self._entries[fd] = entry
        holders.add(entry, entry.name)
        self._young.append(entry)
        LEDGER.add(1)
        crowded = holders.crowding(entry.name)
        if crowded is not None:
            self._close(crowded, "closed_unproven", f"more than {holders.unproven_per_peer} connections of one peer "
                        f"without a handshake; closed the oldest")
        if holders.over_cap(entry.name):
            self._close(entry, "closed_over_peer_cap", f"{entry.name} holds {holders.per_peer} connections, as many "
                        "as one peer may; closed the new one")
        elif LEDGER.full():
            victim = holders.busiest_unproven() or entry
            self._close(victim, "closed_for_budget", f"the process holds {LEDGER.held} connections, its budget "
                        f"under the open-files limit; closed one without a handshake")

    def _disconnected(self, fd: int) -> None:
        entry = self._entries.pop(fd, None)
        failed, self._failed = self._failed, None
        if entry is None:
            # Accepted and closed before this thread named it (a refused handshake is quick, a loaded host slow):
            # the refusal is still logged, without the peer.
            if failed is not None:
                REFUSALS.refused(self.name, None, failed)
            return
        self._forget(entry)
        if failed is not None and not entry.closing:
            REFUSALS.refused(self.name, entry.peer, failed)

    def _forget(self, entry: _Entry) -> None:
        self._holders.remove(entry)
        self._closing -= entry.closing
        LEDGER.add(-1)

    def _accept_failed(self, err: int) -> None:
        self._counts["accept_failed"] += 1
        if err not in _OUT_OF_FILES:
            return
        while self._closing < FREE_ON_FAILED_ACCEPT:  # libzmq retries at once: free a few, and wait for them
            entry = self._holders.busiest_unproven()
            if entry is None:
                return
            self._close(entry, "closed_for_budget", f"cannot accept connections ({os.strerror(err)}); closed "
                        "connections without a handshake")

    def _handshake_failed(self, err: int) -> None:
        if self._log_handshakes:
            detail = os.strerror(err) if err else "connection closed"
            self._failed = (f"the handshake did not complete ({detail}): a client without this cluster's keys, or "
                            "not a ZeroMQ peer")

    def _handshake_failed_protocol(self, code: int) -> None:
        if self._log_handshakes:
            self._failed = _PROTOCOL_REASONS.get(code, f"handshake failed (ZMTP protocol error {code:#x})")

    def _age(self, now: float) -> None:
        """Connections past their handshake interval completed it (libzmq closes the others)."""
        young, horizon = self._young, now - HANDSHAKE_MS / 1000
        while young and young[0].born < horizon:
            self._holders.proven(young.popleft())

    def _close(self, entry: _Entry, count: str, reason: str) -> None:
        """Shut ``entry``'s connection down (libzmq then closes it), if its descriptor is still that connection."""
        if entry.closing:
            return
        entry.closing = True
        self._closing += 1
        self._holders.proven(entry)  # no longer a candidate: it is going
        self._counts[count] += 1
        REFUSALS.refused(self.name, entry.peer, reason)
        _shutdown(entry.fd, entry.peer)


def _shutdown(fd: int, peer: str) -> None:
    """``shutdown(2)`` the socket at ``fd`` if it is still connected to ``peer`` (libzmq owns the descriptor and may
    have closed it and reused its number since)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return
    with sock:
        try:
            host, port = sock.getpeername()[:2]
            if (f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}") == peer:
                sock.shutdown(socket.SHUT_RDWR)
        except (OSError, ValueError, TypeError):
            pass


_PROTOCOL_REASONS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        "the client offered no CURVE keys (is it configured with this cluster's auth_dir?)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        "CURVE handshake failed (the client uses another cluster's server key)",
}
