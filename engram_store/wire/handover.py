"""Handing a segment's memory to a process on the same host: descriptors passed over a Unix socket (SCM_RIGHTS).

A client on a segment's host maps the segment's memory to read it in place, and writes its puts straight into it.
It must map and write only memory the segment itself hands over: a path a peer names (a registration's) could name
any file the client may write, and a client running as root would write its table bytes into it. So a segment
listens on a Unix socket in its user's own directory (``<base>/engram-<uid>/engram-<pid>-<token>.sock``; that
directory is mode 0700, see ``engram_store._shared_dirs``) and sends the descriptors of its memory with SCM_RIGHTS,
and the kernel vouches for the rest:

* the client connects only to a socket named in that pattern, in a directory of the uid its name gives that this uid
  owns and no one else may enter, and checks with SO_PEERCRED that the process at the other end runs as that uid,
  with that pid;
* the segment checks the client the same way: only its own user and root get its memory (as only they could open
  its file in /dev/shm before);
* what arrives is a descriptor the segment itself had open, so a client can be led to no file the segment could not
  reach already.

One request and one reply on a SOCK_SEQPACKET connection: a msgpack map ``{v, segment_id, want}`` (``want``
``"read"``: the memory read-only, and its generation table; ``"write"``: the memory read-write), answered by
``{v, ok: true, segment_id, size, fds}`` (``fds`` names the descriptors that come with it, in order) or
``{v, ok: false, message}``.
"""
from __future__ import annotations

import array
import errno
import os
import re
import socket
import stat
import struct
from dataclasses import dataclass, field

import msgpack

from ..errors import ProtocolError, UnsafeFile, out_of_files, too_many_open_files

HANDOVER_VERSION = 1
MAX_MESSAGE_BYTES = 4096
MAX_FDS = 4
WANTS = ("read", "write")
_SOCKET_NAME = re.compile(r"^engram-(\d+)-[0-9a-f]{8,32}\.sock$")
_DIR_NAME = re.compile(r"^engram-(\d+)$")
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def socket_name(pid: int, token: str) -> str:
    """The name of a segment's hand-over socket in its user's directory."""
    return f"engram-{pid}-{token}.sock"


def owner_of(path: str) -> tuple[int, int] | None:
    """``(uid, pid)`` a hand-over socket's path names (its directory, its name); None if it is not such a path."""
    name, directory = os.path.basename(path), os.path.basename(os.path.dirname(path))
    m, d = _SOCKET_NAME.match(name), _DIR_NAME.match(directory)
    if m is None or d is None or not os.path.isabs(path):
        return None
    return int(d.group(1)), int(m.group(1))


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket, as the kernel recorded them."""
    return _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))


def send_message(sock: socket.socket, header: dict, fds: list[int] = ()) -> None:
    data = msgpack.packb(header, use_bin_type=True)
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(data)


def recv_message(sock: socket.socket, max_fds: int = MAX_FDS) -> tuple[dict, list[int]]:
    """One message and the descriptors that came with it (close-on-exec); ProtocolError if it is malformed (any
    descriptor that came is closed first), ConnectionResetError if the peer closed without one."""
    size = socket.CMSG_SPACE(max_fds * array.array("i").itemsize)
    data, ancillary, flags, _ = sock.recvmsg(MAX_MESSAGE_BYTES, size, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
    if not data and not ancillary:
        raise ConnectionResetError(errno.ECONNRESET, "the peer closed the connection without a message")
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    fds = list(fds)
    try:
        if flags & socket.MSG_CTRUNC and out_of_files():  # the descriptors found no room here
            raise too_many_open_files("receiving a segment's memory on its hand-over socket")
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ProtocolError(f"hand-over message cut short (more than {MAX_MESSAGE_BYTES} bytes or {max_fds} "
                                "descriptors)")
        try:
            header = msgpack.unpackb(data, raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise ProtocolError(f"hand-over message is not msgpack: {exc}") from None
        if not isinstance(header, dict) or header.get("v") != HANDOVER_VERSION:
            raise ProtocolError(f"hand-over message: expected a map with v={HANDOVER_VERSION}, got {header!r:.80}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return header, fds


@dataclass
class Handed:
    """What a segment handed over: its descriptors by name (the receiver closes them), and who sent them."""

    fds: dict[str, int] = field(default_factory=dict)
    size: int = 0
    pid: int = 0
    uid: int = 0

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def fetch(path: str, segment_id: str, want: str, timeout_s: float = 2.0) -> Handed:
    """Ask the segment listening at ``path`` for its memory (``want``: ``"read"`` or ``"write"``); see the module
    docstring for what is checked. Raises UnsafeFile where the socket or its peer is not what its path claims,
    ProtocolError where the reply is, OSError where no one answers."""
    owner = owner_of(path)
    if owner is None:
        raise UnsafeFile(f"segment {segment_id}: {path!r} is not a segment's hand-over socket "
                         "(<dir>/engram-<uid>/engram-<pid>-<token>.sock)")
    uid, pid = owner
    directory = os.lstat(os.path.dirname(path))
    if not stat.S_ISDIR(directory.st_mode) or directory.st_uid != uid or stat.S_IMODE(directory.st_mode) & 0o077:
        raise UnsafeFile(f"segment {segment_id}: {os.path.dirname(path)} is not a directory of uid {uid} closed to "
                         f"others (uid {directory.st_uid}, mode {stat.S_IMODE(directory.st_mode):04o})")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout_s)
        sock.connect(path)
        peer_pid, peer_uid, _ = peer_credentials(sock)
        if (peer_pid, peer_uid) != (pid, uid):
            raise UnsafeFile(f"segment {segment_id}: the process at {path} is pid {peer_pid} of uid {peer_uid}, not "
                             f"pid {pid} of uid {uid} as its name says")
        send_message(sock, {"v": HANDOVER_VERSION, "segment_id": segment_id, "want": want})
        header, fds = recv_message(sock)
    handed = Handed(pid=peer_pid, uid=peer_uid)
    try:
        names = header.get("fds")
        if not header.get("ok"):
            raise ProtocolError(f"segment {segment_id} at {path} refused the hand-over: {header.get('message')}")
        if header.get("segment_id") != segment_id or not isinstance(names, list) or len(names) != len(fds) \
                or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names) \
                or type(header.get("size")) is not int:
            raise ProtocolError(f"segment {segment_id} at {path}: a hand-over reply for segment "
                                f"{header.get('segment_id')!r} with descriptors {names!r:.60} ({len(fds)} came)")
        handed.fds, handed.size = dict(zip(names, fds)), header["size"]
        fds = []
    finally:
        for fd in fds:
            os.close(fd)
    return handed
