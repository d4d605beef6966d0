"""A segment hands its memory to processes on its host: descriptors over a Unix socket (see
``engram_store.wire.handover`` for the protocol and what each side checks).

One thread accepts connections on ``<base>/engram-<uid>/engram-<pid>-<token>.sock`` (the path the segment registers
as its ``shm_path``) and answers each request in turn: a peer that is neither this user nor root gets a refusal and
nothing else; ``read`` gets the memory read-only and the generation table; ``write`` gets the memory read-write, only
from a segment that takes direct writes (not a durable one). A peer that connects and sends nothing is dropped after
:data:`PEER_TIMEOUT_S`; only this user and root can reach the socket at all (its directory is theirs alone).
"""
from __future__ import annotations

import logging
import os
import select
import socket
import threading
import uuid

from ..errors import EngramError, StoreError
from .._shared_dirs import UserDir, shared_base
from ..wire import handover

log = logging.getLogger(__name__)

#: How long one peer may take to send its request.
PEER_TIMEOUT_S = 1.0
#: The longest path a Unix socket can be bound to (sun_path, with its terminating NUL).
MAX_SOCKET_PATH = 107


class MemoryHandover:
    """Serves one segment's memory descriptors (see the module docstring); :meth:`close` stops and removes the
    socket. ``memory_fd`` is read-write; ``table_fd`` (or -1) is the generation table's."""

    def __init__(self, segment_id: str, size: int, memory_fd: int, table_fd: int, writable: bool):
        self.segment_id = segment_id
        self.size = size
        self._rw = memory_fd if writable else -1
        self._fds: list[int] = []
        self._dir = UserDir(shared_base(), f"segment {segment_id}", "set ENGRAM_SHM_DIR to another directory")
        self.path = self._dir.join(handover.socket_name(os.getpid(), uuid.uuid4().hex[:16]))
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            if len(self.path.encode()) > MAX_SOCKET_PATH:
                raise StoreError(f"segment {segment_id}: the hand-over socket's path {self.path} is longer than a "
                                 f"Unix socket's {MAX_SOCKET_PATH} bytes; set ENGRAM_SHM_DIR to a shorter directory")
            self._sock.bind(self.path)
            self._sock.listen(16)
            self._read = [_read_only(memory_fd)] + ([_read_only(table_fd)] if table_fd >= 0 else [])
            self._fds = list(self._read)
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"engram-handover-{segment_id[:8]}")
        self._thread.start()

    def _serve(self) -> None:
        while True:
            ready, _, _ = select.select([self._sock, self._wake_r], [], [])
            if self._wake_r in ready:
                return
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                log.debug("segment %s: hand-over accept failed: %s", self.segment_id, exc)
                continue
            with conn:
                try:
                    self._answer(conn)
                except (OSError, EngramError) as exc:
                    log.debug("segment %s: hand-over to a peer failed: %s", self.segment_id, exc)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(PEER_TIMEOUT_S)
        pid, uid, _ = handover.peer_credentials(conn)
        request, fds = handover.recv_message(conn, max_fds=0)
        for fd in fds:
            os.close(fd)
        reply = {"v": handover.HANDOVER_VERSION, "ok": False}
        want = request.get("want")
        if uid not in (os.geteuid(), 0):
            reply["message"] = f"uid {uid} (pid {pid}) is neither this segment's user nor root"
        elif request.get("segment_id") != self.segment_id:
            reply["message"] = f"this is segment {self.segment_id}, not {request.get('segment_id')!r:.40}"
        elif want not in handover.WANTS:
            reply["message"] = f"want: expected one of {list(handover.WANTS)}, got {want!r:.40}"
        elif want == "write" and self._rw < 0:
            reply["message"] = "this segment takes no direct writes (its bytes live in a file); write through requests"
        else:
            fds = [self._rw] if want == "write" else self._read
            names = ["memory"] if want == "write" else ["memory", "table"][:len(fds)]
            reply.update(ok=True, segment_id=self.segment_id, size=self.size, fds=names)
            handover.send_message(conn, reply, fds)
            log.debug("segment %s: handed its memory (%s) to pid %d (uid %d)", self.segment_id, want, pid, uid)
            return
        handover.send_message(conn, reply)
        log.info("segment %s: refused a hand-over to pid %d (uid %d): %s", self.segment_id, pid, uid,
                 reply["message"])

    def close(self) -> None:
        """Stop serving, remove the socket. Idempotent."""
        if self._wake_w < 0:
            return
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        self._release()

    def _release(self) -> None:
        self._sock.close()
        self._dir.unlink(os.path.basename(self.path))
        self._dir.close()
        for fd in self._fds + [self._wake_r, self._wake_w]:
            if fd >= 0:
                os.close(fd)
        self._fds, self._wake_r, self._wake_w = [], -1, -1


def start_handover(segment_id: str, size: int, memory_fd: int, table_fd: int, writable: bool) -> MemoryHandover | None:
    """A :class:`MemoryHandover` serving the segment's memory; None where it cannot be (the segment then says so, and
    clients on this host read and write through requests)."""
    try:
        return MemoryHandover(segment_id, size, memory_fd, table_fd, writable)
    except (OSError, EngramError) as exc:
        log.warning("segment %s: cannot hand its memory to clients on this host (%s); they read and write through "
                    "requests", segment_id, getattr(exc, "strerror", None) or exc)
        return None


def _read_only(fd: int) -> int:
    """A read-only descriptor of the file ``fd`` (opened anew through /proc, so a reader can neither write nor seal
    it), or a duplicate where /proc cannot reopen it."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return os.dup(fd)
