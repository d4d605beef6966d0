"""Who holds a listening socket's connections, so that no one peer, and no flood, can hold them all.

Every server of the project (a ZeroMQ socket, the raw read channel, a metrics page) keeps its accepted connections
in a :class:`Holders` table by **peer**, with the same two caps: connections one peer holds in all, and connections
one peer holds that have not proven themselves yet (no handshake, no complete message): past the second, that
peer's oldest unproven connection is closed; past the first, its new one is. When the process's descriptors run
short (:data:`LEDGER`), the oldest unproven connection of the peer holding the most unproven ones goes first. So a
stranger who opens connections and sends nothing crowds out only itself.

A peer is an address and, for a connection from this host, the **user** whose socket it is: on a shared host every
local user connects from 127.0.0.1, and a cap per address alone would count one user's flood against another's
clients. The kernel tells the user of the other end of a local TCP connection through ``NETLINK_SOCK_DIAG`` (what
``ss -e`` shows), asked for that one socket by its four addresses (:class:`PeerNames`, about 20 us). Elsewhere, or
when the peer closed before it was asked, the address alone names it.

Refusals are logged at WARNING at most once per peer and reason every :data:`REFUSAL_LOG_INTERVAL_S`
(:data:`REFUSALS`), so a flood cannot flood the log.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
import threading
import time

log = logging.getLogger(__name__)

#: Refusals of the same peer host for the same reason are logged at most this often.
REFUSAL_LOG_INTERVAL_S = 10.0
_MAX_TRACKED_PEERS = 1024
#: The soft open-files limit servers raise themselves to (at most the hard limit): every connection holds one.
OPEN_FILES_TARGET = 1 << 16
#: Descriptors kept out of every connection budget: files, journals, pipes, libzmq's own (a quarter of the limit
#: where that is more): a process at its limit cannot open a file, and libzmq spins on a listener it cannot accept.
FD_RESERVE = 128


class RefusalLog:
    """Log refused connections at WARNING, at most once per (peer host, reason) per interval."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S):
        self.interval_s = interval_s
        self._seen: dict[tuple[str, str], list] = {}  # key -> [last logged, suppressed since]
        self._lock = threading.Lock()

    def refused(self, where: str, peer: str | None, reason: str) -> None:
        host = peer.rsplit(":", 1)[0] if peer else "?"
        now = time.monotonic()
        with self._lock:
            entry = self._seen.get((host, reason))
            if entry is not None and now - entry[0] < self.interval_s:
                entry[1] += 1
                return
            suppressed = entry[1] if entry is not None else 0
            if len(self._seen) >= _MAX_TRACKED_PEERS:
                self._seen.clear()
            self._seen[(host, reason)] = [now, 0]
        more = f" ({suppressed} more from {host} since the last message)" if suppressed else ""
        log.warning("%s: refused a connection from %s: %s%s", where, peer or "an unknown peer", reason, more)


REFUSALS = RefusalLog()


# ---- descriptors ------------------------------------------------------------------------------------------


def open_files_limit() -> tuple[int, int] | None:
    """The process's (soft, hard) open-files limit, or None where it cannot be read (no limit)."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    return soft, hard


def raise_open_files_limit(target: int = OPEN_FILES_TARGET) -> int | None:
    """Raise the soft open-files limit to ``target`` (at most the hard limit), as servers do at start: each
    connection holds a descriptor. Returns the soft limit now (None: unlimited or unknown)."""
    limits = open_files_limit()
    if limits is None:
        return None
    soft, hard = limits
    import resource
    want = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (OSError, ValueError) as exc:  # keep the limit there is; the budgets follow it
            log.debug("cannot raise the open-files limit to %d: %s", want, exc)
    return soft


class Ledger:
    """Connections every guarded listener of this process holds, against one budget: the open-files limit less
    its reserve (read when asked: a server may raise the limit after this module loads). A listener asks
    :meth:`full` before it keeps one more."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0

    @property
    def budget(self) -> int:
        limits = open_files_limit()
        return 1 << 30 if limits is None else max(16, limits[0] - max(FD_RESERVE, limits[0] // 4))

    def add(self, n: int = 1) -> None:
        """Count ``n`` more connections held (fewer where negative)."""
        with self._lock:
            self.held += n

    def full(self) -> bool:
        return self.held > self.budget


LEDGER = Ledger()


# ---- naming peers -----------------------------------------------------------------------------------------

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NO_COOKIE = 0xFFFFFFFF
_ALL_STATES = 0xFFFFFFFF
#: inet_diag_msg: family, state, timer, retrans (4 bytes), the socket's id (48), expires, rqueue, wqueue, then uid.
_UID_OFFSET = 16 + 4 + 48 + 12


class PeerNames:
    """Names the peer of accepted TCP sockets: ``"IP"``, or ``"IP uid N"`` for a peer on this host. One per
    thread (it keeps a netlink socket); ``close()`` when done."""

    def __init__(self) -> None:
        self._netlink: socket.socket | None = None
        self._seq = 0
        self._broken = not hasattr(socket, "AF_NETLINK")

    def name(self, sock: socket.socket) -> tuple[str, str] | None:
        """``(peer as HOST:PORT, peer name)`` of a connected socket, or None where it is closed already."""
        try:
            peer, local = sock.getpeername(), sock.getsockname()
        except OSError:
            return None
        host = peer[0]
        text = f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
        uid = self._uid(sock.family, peer, local) if _on_this_host(host, local[0]) else None
        return text, host if uid is None else f"{host} uid {uid}"

    def name_fd(self, fd: int) -> tuple[str, str] | None:
        """:meth:`name` of a descriptor another library owns (a duplicate is opened and closed)."""
        try:
            dup = os.dup(fd)
        except OSError:
            return None
        try:
            sock = socket.socket(fileno=dup)  # family and type are read from the descriptor
        except OSError:
            os.close(dup)
            return None
        with sock:  # closes the duplicate only
            return self.name(sock) if sock.type == socket.SOCK_STREAM else None

    def _uid(self, family: int, peer: tuple, local: tuple) -> int | None:
        """The user of the socket at the other end of ``local`` <- ``peer`` on this host (None: not found)."""
        if self._broken:
            return None
        try:
            if self._netlink is None:
                self._netlink = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
                self._netlink.settimeout(1.0)
            self._seq += 1
            request = _diag_request(family, peer, local, self._seq)
            self._netlink.send(request)
            reply = self._netlink.recv(1024)
        except (OSError, ValueError) as exc:  # no sock_diag here (a sandbox): peers are named by address
            log.debug("peer users cannot be told apart: %s", exc)
            self._broken = True
            return None
        if len(reply) < _UID_OFFSET + 4 or struct.unpack_from("=H", reply, 4)[0] != _SOCK_DIAG_BY_FAMILY:
            return None  # NLMSG_ERROR: no such socket (the peer closed, or it is not on this host)
        return struct.unpack_from("=I", reply, _UID_OFFSET)[0]

    def close(self) -> None:
        if self._netlink is not None:
            self._netlink.close()
            self._netlink = None


def _diag_request(family: int, peer: tuple, local: tuple, seq: int) -> bytes:
    """A sock_diag request for the one TCP socket bound to ``peer`` and connected to ``local``."""
    def address(host: str) -> bytes:
        raw = socket.inet_pton(family, host.split("%", 1)[0])
        return raw + bytes(16 - len(raw))

    sockid = (struct.pack("!HH", peer[1], local[1]) + address(peer[0]) + address(local[0])
              + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE))
    body = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, _ALL_STATES) + sockid
    return struct.pack("=IHHII", 16 + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, seq, 0) + body


def _on_this_host(peer: str, local: str) -> bool:
    if peer == local:
        return True
    try:
        return ipaddress.ip_address(peer.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


# ---- connections by peer ------------------------------------------------------------------------------------


class _Peer:
    __slots__ = ("count", "unproven")

    def __init__(self) -> None:
        self.count = 0
        self.unproven: dict = {}  # connection -> None, oldest first


class Holders:
    """One listener's connections by peer (a connection is any hashable object): how many each peer holds, and which
    have not proven themselves yet, oldest first. Used by one thread (the listener's).

    ``per_peer``: connections one peer may hold; ``unproven_per_peer``: of those, not yet proven.
    """

    def __init__(self, per_peer: int, unproven_per_peer: int):
        if not 1 <= unproven_per_peer <= per_peer:
            raise ValueError(f"unproven_per_peer: expected 1 <= it <= per_peer ({per_peer}), got {unproven_per_peer}")
        self.per_peer = per_peer
        self.unproven_per_peer = unproven_per_peer
        self.count = 0
        self._peers: dict[str, _Peer] = {}
        self._of: dict = {}  # connection -> its peer's name

    def add(self, conn, peer: str) -> None:
        """A new connection of ``peer``, unproven."""
        entry = self._peers.get(peer)
        if entry is None:
            entry = self._peers[peer] = _Peer()
        entry.count += 1
        entry.unproven[conn] = None
        self._of[conn] = peer
        self.count += 1

    def peer(self, conn) -> str | None:
        return self._of.get(conn)

    def held_by(self, peer: str) -> int:
        entry = self._peers.get(peer)
        return 0 if entry is None else entry.count

    def over_cap(self, peer: str) -> bool:
        """Whether ``peer`` holds more connections than it may."""
        return self.held_by(peer) > self.per_peer

    def crowding(self, peer: str):
        """The oldest unproven connection of ``peer`` when it holds more unproven ones than it may, else None."""
        entry = self._peers.get(peer)
        if entry is None or len(entry.unproven) <= self.unproven_per_peer:
            return None
        return next(iter(entry.unproven))

    def oldest_unproven(self, peer: str):
        """The oldest unproven connection of ``peer`` (None: none)."""
        entry = self._peers.get(peer)
        return next(iter(entry.unproven)) if entry is not None and entry.unproven else None

    def proven(self, conn) -> None:
        """``conn`` has proven itself (a handshake, a whole message): no longer first to go."""
        peer = self._of.get(conn)
        if peer is not None:
            self._peers[peer].unproven.pop(conn, None)

    def is_unproven(self, conn) -> bool:
        peer = self._of.get(conn)
        return peer is not None and conn in self._peers[peer].unproven

    def unproven(self):
        """Every unproven connection, peer by peer (oldest first within a peer)."""
        for entry in list(self._peers.values()):
            yield from list(entry.unproven)

    def busiest_unproven(self):
        """The oldest unproven connection of the peer holding the most unproven ones (None: none)."""
        best = max(self._peers.values(), key=lambda e: len(e.unproven), default=None)
        return next(iter(best.unproven)) if best is not None and best.unproven else None

    def remove(self, conn) -> None:
        peer = self._of.pop(conn, None)
        if peer is None:
            return
        entry = self._peers[peer]
        entry.count -= 1
        entry.unproven.pop(conn, None)
        self.count -= 1
        if not entry.count:
            del self._peers[peer]
