"""Another local user who floods a listening socket with connections, for the security tests: started as root, it
raises its own open-files limit, drops to an unprivileged uid (``--uid``, default 65534) and then opens connections
to 127.0.0.1 only.

    python flood_worker.py [--uid N] ACTION PORT COUNT

Actions (each opens up to COUNT connections, stopping at the first the system refuses, prints ``held K`` once they
are open, holds them until stdin closes, then closes them all and exits 0):

    idle PORT COUNT     plain TCP connections that send nothing (a stranger without the cluster's keys)
    zmtp PORT COUNT     connections that complete a ZeroMQ handshake without keys (ZMTP 3.0, NULL mechanism, as a
                        DEALER) and then say nothing more; against a server without --auth they are established peers
    raw PORT COUNT      connections to a segment's raw read channel that each read nothing once (a whole request,
                        answered: against a segment without --auth they are established readers) and then idle

A connection the server closes at once is tried again with the next; the first one that is not answered within
5 s (the server no longer accepts) ends the flood there.
"""
from __future__ import annotations

import os
import resource
import socket
import struct
import sys

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the suite's helpers

from intruder_worker import INTRUDER_UID, _drop  # noqa: E402
from suite_helpers import ZMTP_GREETING, ZMTP_READY  # noqa: E402

#: The raw read channel's read of no ranges (magic, version 3, op 1, request id 1, count 0) and its reply's size.
RAW_READ = struct.pack("<4sHHQQ", b"ENGR", 3, 1, 1, 0)
RAW_REPLY_BYTES = 24
#: What each action sends once connected, and how many bytes of answer it waits for.
SAY = {"idle": (b"", 0), "zmtp": (ZMTP_GREETING + ZMTP_READY, 64), "raw": (RAW_READ, RAW_REPLY_BYTES)}


def _open(port: int, say: bytes, answer_bytes: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(5)
        sock.connect(("127.0.0.1", port))
        sock.sendall(say)
        got = 0
        while got < answer_bytes:  # the server's answer (a greeting, a reply): the connection is established
            chunk = sock.recv(answer_bytes - got)
            if not chunk:
                raise ConnectionResetError("the server closed the connection")
            got += len(chunk)
    except BaseException:
        sock.close()
        raise
    return sock


def hold(port: int, count: int, action: str) -> str:
    socks = []
    try:
        for _ in range(count):
            try:
                socks.append(_open(port, *SAY[action]))
            except socket.timeout:
                break  # no longer accepted: the flood stands where it is
            except OSError:
                continue  # closed by the server: the next one
        print(f"held {len(socks)}", flush=True)
        sys.stdin.read()
    finally:
        for sock in socks:
            sock.close()
    return "closed"


def main(argv: list[str]) -> int:
    uid = INTRUDER_UID
    if argv[:1] == ["--uid"]:
        uid, argv = int(argv[1]), argv[2:]
    action, port, count = argv[0], int(argv[1]), int(argv[2])
    if action not in SAY:
        raise SystemExit(f"unknown action {action!r}: expected one of {sorted(SAY)}")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = count + 64
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))  # as root, before the drop
    _drop(uid)
    print(hold(port, count, action), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
