"""Another local user, for the security tests: started as root, it loads what it needs and then drops to an
unprivileged uid (``--uid``, default 65534) before it acts, so every action runs with that user's rights only.

    python intruder_worker.py [--uid N] ACTION ARGS...

Actions (each prints one line saying what it did, or what the system refused, and exits 0). Everything it uses is
imported before it drops (the interpreter's own files may be closed to that user):

    plant PATH...                 empty files, mode 0666 (umask 0), as a user taking names first would
    symlink TARGET LINK           a symbolic link
    relink TARGET LINK            point the link LINK at TARGET instead, in one rename (a new link over the old)
    swap PATH PATH                exchange two names in a directory of this user's (through a third name)
    mkdir PATH                    a directory, mode 0777
    fill PATH BYTE                overwrite the whole file with BYTE (an int), if this user may
    hold-lock PATH                open (or create) PATH and hold an exclusive flock on it, printing "held", until
                                  stdin closes
    truncate PATH SIZE            truncate the file, if this user may
    swap-layer DIR LAYER BYTE     move DIR/layer-LAYER away and put a layer of its own (head files of BYTE) in place
    read PATH...                  try to read each file (list each directory): "readable PATH" or "refused PATH"
    connect PATH                  try to connect to a Unix socket: "connected" or "refused <reason>"
    write PATH TEXT               write a file of this text
    chmod PATH MODE               change a file's mode (octal)
    open-own PATH                 open PATH as engram opens a file in a shared place (``_shared_dirs.open_own``):
                                  "opened", or the error's class and message
    rogue-segment MASTER FILE     register a segment with the master whose shm_path names FILE (of FILE's size) and
                                  answer its requests like a segment that takes direct writes, until stdin closes
    mkfifo PATH                   a named pipe, mode 0666
    hostile-table MASTER CAPACITY register a segment that hands its memory over (a sealed memfd of 1 MiB) with a
                                  4 KiB generation table whose header says CAPACITY entries, until stdin closes
"""
from __future__ import annotations

import fcntl
import os
import socket
import sys
import uuid

INTRUDER_UID = 65534


def _drop(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    os.umask(0)


def plant(*paths: str) -> str:
    for path in paths:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o666))
    return f"planted {len(paths)}"


def symlink(target: str, link: str) -> str:
    os.symlink(target, link)
    return "linked"


def relink(target: str, link: str) -> str:
    fresh = f"{link}.{uuid.uuid4().hex}"
    os.symlink(target, fresh)
    os.rename(fresh, link)
    return "relinked"


def swap(first: str, second: str) -> str:
    aside = f"{first}.{uuid.uuid4().hex}"
    try:
        os.rename(first, aside)
        os.rename(second, first)
        os.rename(aside, second)
    except OSError as exc:
        return f"refused {exc.strerror}"
    return "swapped"


def mkdir(path: str) -> str:
    os.mkdir(path, 0o777)
    return "made"


def fill(path: str, byte: str) -> str:
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as exc:
        return f"refused {exc.strerror}"
    try:
        os.pwrite(fd, bytes([int(byte)]) * os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)
    return "filled"


def hold_lock(path: str) -> str:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.read()
    return "released"


def truncate(path: str, size: str) -> str:
    try:
        os.truncate(path, int(size))
    except OSError as exc:
        return f"refused {exc.strerror}"
    return "truncated"


def swap_layer(directory: str, layer: str, byte: str) -> str:
    final = os.path.join(directory, f"layer-{layer}")
    try:
        layout = open(os.path.join(final, "layout"), "rb").read()
        os.rename(final, os.path.join(directory, f"moved-{uuid.uuid4().hex}"))
    except OSError as exc:
        return f"refused {exc.strerror}"
    lines = layout.decode().split("\n")
    row_bytes, sizes = int(lines[1]), [int(n) for n in lines[2:] if n]
    os.mkdir(final, 0o777)
    with open(os.path.join(final, "layout"), "wb") as f:
        f.write(layout)
    for h, n in enumerate(sizes):
        with open(os.path.join(final, f"head-{h}.bin"), "wb") as f:
            f.write(bytes([int(byte)]) * (n * row_bytes))
    return "swapped"


def read(*paths: str) -> str:
    out = []
    for path in paths:
        try:
            if os.path.isdir(path):
                os.listdir(path)
            else:
                with open(path, "rb") as f:
                    f.read(1)
            out.append(f"readable {path}")
        except OSError:
            out.append(f"refused {path}")
    return "\n".join(out)


def connect(path: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        try:
            sock.connect(path)
        except OSError as exc:
            return f"refused {exc.strerror}"
    return "connected"


def write(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return "written"


def chmod(path: str, mode: str) -> str:
    os.chmod(path, int(mode, 8))
    return "changed"


def open_own(path: str) -> str:
    from engram_store import EngramError
    from engram_store._shared_dirs import open_own as engram_open_own

    try:
        fd, _ = engram_open_own(path, os.O_RDWR, "a shared file")
    except EngramError as exc:
        return f"{type(exc).__name__}: {exc}"
    os.close(fd)
    return "opened"


def rogue_segment(master: str, file: str) -> str:
    """A segment that says its memory is ``file`` (a path it may not even read) and takes direct writes."""
    from engram_store.segment import host_id
    from engram_store.wire import Connection, RpcServer

    def _drop_now() -> None:
        _drop(int(os.environ.get("INTRUDER_UID", INTRUDER_UID)))

    size = os.stat(file).st_size  # as root, before the drop: the rogue only names the file
    me = uuid.uuid4().hex
    handlers = {"ping": lambda req: {"role": "segment", "segment_id": me, "size": size},
                "write_open": lambda req: {"offset": 0, "size": size},
                "write": lambda req: {"written": 0},
                "write_close": lambda req: {"fenced": False},
                "catalog_add": lambda req: {"added": 0},
                "catalog_drop": lambda req: {"dropped": 0}}
    _drop_now()
    server = RpcServer("127.0.0.1", 0, "rogue", handlers).start()
    conn = Connection(master)
    try:
        conn.call("register_segment", {
            "segment_id": me, "address": server.address, "size": size, "read_addresses": [], "shm_path": file,
            "host_id": host_id(), "public_key": "", "objects": [], "write_key": os.urandom(32),
            "registration": uuid.uuid4().hex, "held": [], "direct_writes": True}, timeout_ms=5000)
        print("registered", flush=True)
        sys.stdin.read()
    finally:
        conn.close()
        server.stop()
        server.close()
    return "gone"


def mkfifo(path: str) -> str:
    os.mkfifo(path, 0o666)
    return "made"


def hostile_table(master: str, capacity: str) -> str:
    """A segment whose generation table's header says ``capacity`` entries in 4 KiB: a client that trusted it read
    past its mapping."""
    import struct

    from engram_store.segment import host_id
    from engram_store.segment._handover import start_handover
    from engram_store.segment._memory import SEALS
    from engram_store.wire import Connection, RpcServer

    def sealed(size: int, name: str) -> int:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        return fd

    here = host_id()
    _drop(int(os.environ.get("INTRUDER_UID", INTRUDER_UID)))
    size, me = 1 << 20, uuid.uuid4().hex
    memory, table = sealed(size, "hostile"), sealed(4096, "hostile-table")
    os.pwrite(table, struct.pack("<8q", 0, 500, int(capacity), 0, 0, 0, 0, 0), 0)
    handlers = {"ping": lambda req: {"role": "segment", "segment_id": me, "size": size},
                "write": lambda req: {"written": len(req.frames[0])},
                "catalog_add": lambda req: {"added": 0}, "catalog_drop": lambda req: {"dropped": 0}}
    server = RpcServer("127.0.0.1", 0, "hostile", handlers).start()
    handed = start_handover(me, size, memory, table, writable=False)
    conn = Connection(master)
    try:
        conn.call("register_segment", {
            "segment_id": me, "address": server.address, "size": size, "read_addresses": [],
            "shm_path": handed.path, "host_id": here, "public_key": "", "objects": [],
            "write_key": os.urandom(32), "registration": uuid.uuid4().hex, "held": [], "direct_writes": False},
            timeout_ms=5000)
        print("registered", flush=True)
        sys.stdin.read()
    finally:
        conn.close()
        handed.close()
        server.stop()
        server.close()
    return "gone"


ACTIONS = {"plant": plant, "symlink": symlink, "mkdir": mkdir, "fill": fill, "hold-lock": hold_lock,
           "truncate": truncate, "swap-layer": swap_layer, "read": read, "connect": connect, "write": write,
           "chmod": chmod, "open-own": open_own,
           "rogue-segment": rogue_segment, "mkfifo": mkfifo, "hostile-table": hostile_table}
ACTIONS.update({"relink": relink, "swap": swap})  # on directories of layers (test_layer_dirs.py)


def main(argv: list[str]) -> int:
    uid = INTRUDER_UID
    if argv[:1] == ["--uid"]:
        uid, argv = int(argv[1]), argv[2:]
    action, args = ACTIONS[argv[0]], argv[1:]
    os.environ["INTRUDER_UID"] = str(uid)
    if action is open_own:
        import engram_store._shared_dirs  # noqa: F401  (loaded before the drop: the interpreter's files may be closed)
    if action not in (rogue_segment, hostile_table):  # they load their modules first, then drop
        _drop(uid)
    print(action(*args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
