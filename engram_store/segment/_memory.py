"""A segment's memory: anonymous shared memory sealed against shrinking (a memfd), or the file of a durable segment,
mapped read-write; and what knows about them.

Clients on the same host read a segment's memory in place and write their puts straight into it; they get it as a
descriptor the segment hands them (``_handover``), never by a path. The memory is a memfd: it has no name another
user could take first or open, it goes when the last process holding it does (nothing is left behind by a kill),
and it is sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``), so no process holding
it, the segment's own clients included, can take pages from under a reader's mapping (which would kill the reader
with SIGBUS). Where the kernel makes no memfd, an anonymous file in this user's directory (created exclusively and
unlinked at once) stands in, without seals.

A durable segment (``--file``) keeps its bytes in a regular file, which cannot be sealed. It is created exclusively,
never through a link, relative to its directory held open (``engram_store.durable``), or used only when ``fstat``
shows a regular file of this user that no one else may write (see ``engram_store._shared_dirs``); its user (changing the mode first) and root can still truncate it, which kills the
segment and the clients mapping it (docs/operating.md says so).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import socket
import threading
import uuid

import numpy as np

from ..errors import ConfigError, InvalidArgument, StoreError
from ..durable import DurableDir, HeldDir
from ..pages import MADV_HUGEPAGE, PREFAULT_CHUNK_BYTES, madvise, prefault, reserve, reserve_memory
from .._shared_dirs import UserDir, open_own, shared_base
from ..wire import handover

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
THP_SHMEM_SETTING = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
#: Seals of a segment's memory: it can neither shrink nor grow, and no one can add a seal (F_SEAL_WRITE would stop
#: the segment's own writes).
SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x2)
SEALS = SEAL_SHRINK | getattr(fcntl, "F_SEAL_GROW", 0x4) | getattr(fcntl, "F_SEAL_SEAL", 0x1)


def anonymous_memory(size: int, name: str, what: str) -> tuple[int, bool]:
    """A shared-memory file of ``size`` bytes with no name in any directory, its pages reserved: a memfd sealed
    against shrinking and growing, or (no memfd here) a file made and unlinked in this user's directory. Returns
    ``(fd, sealed)``; OutOfSpace (naming ``what``) when the memory is not there."""
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError) as exc:
        log.info("%s: no memfd here (%s); using an unlinked file in this user's directory, without seals", what,
                 getattr(exc, "strerror", None) or exc)
        own = UserDir(shared_base(), what, "set ENGRAM_SHM_DIR to another directory")
        unique = f"{name}-{uuid.uuid4().hex}"
        try:
            fd, _ = own.open(unique, os.O_RDWR)
            own.unlink(unique)
        finally:
            own.close()
        try:
            reserve(fd, size, own.path, what)
        except BaseException:
            os.close(fd)
            raise
        return fd, False
    try:
        # Sealed against shrinking while still empty (nothing to shrink), so no process of this user can truncate it
        # while its pages are reserved (a pause there left it unsealed for as long); growing it to its size is
        # still allowed, then growth and further seals are shut off too.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEAL_SHRINK)
        reserve_memory(fd, size, what)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd, True
def host_id() -> str:
    """Identifies this machine (and boot), so a client can tell whether a segment's file is local."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def reap_orphans(directory: str | None = None) -> list[str]:
    """Remove the hand-over sockets that segments which died without cleaning up (e.g. after SIGKILL) left in this
    user's directory under ``directory`` (default: ``shared_base()``); their memory went with them."""
    base = directory or shared_base()
    if not os.path.isdir(os.path.join(base, f"engram-{os.geteuid()}")):
        return []
    try:
        own = UserDir(base, "segment hand-over")
    except StoreError as exc:
        log.warning("%s", exc)
        return []
    removed = []
    try:
        for name in own.names():
            owner = handover.owner_of(own.join(name))
            if owner is None:
                continue
            try:
                os.kill(owner[1], 0)
                continue  # still running
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            own.unlink(name)
            removed.append(name)
    finally:
        own.close()
    if removed:
        log.info("removed %d hand-over socket(s) left by dead segments in %s", len(removed), own.path)
    return removed


_thp_logged = False


def pwrite_all(fd: int, data, offset: int) -> int:
    """Write all of ``data`` (bytes-like) at ``offset`` of the file ``fd`` with ``pwrite``, which releases the
    GIL; returns its length. A segment's writes and same-host clients' puts into a segment file use it."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    done, n = 0, view.nbytes
    while done < n:
        written = os.pwrite(fd, view[done:], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset + done}")
        done += written
    return n


def shmem_huge_pages() -> str:
    """The kernel's transparent-huge-page policy for shared memory: ``never``, ``advise``, ``within_size``,
    ``always``, ... (the bracketed word of /sys/kernel/mm/transparent_hugepage/shmem_enabled), or ``""``."""
    try:
        with open(THP_SHMEM_SETTING) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def _log_huge_page_policy(policy: str) -> None:
    global _thp_logged
    if _thp_logged:
        return
    _thp_logged = True
    if policy in ("advise", "within_size", "always", "force"):
        log.info("transparent huge pages for shared memory: shmem_enabled=%s; segment mappings ask for 2 MiB "
                 "pages (madvise MADV_HUGEPAGE)", policy)
    else:
        log.info("transparent huge pages for shared memory: shmem_enabled=%s; segments use 4 KiB pages "
                 "(set it to 'advise' or 'within_size' for 2 MiB pages)", policy or "unavailable")


class SegmentMemory:
    """A segment's bytes, mapped read-write: a sealed memfd, or (``path``) the file of a durable segment, kept on
    close when ``keep_file``.

    The file stays open (``fd``): writes go in with ``pwrite`` (:meth:`write`), which moves bytes at memory speed
    where a copy into a freshly mapped page pays a fault per 4 KiB, and :meth:`flush` is an ``fsync`` of it. The
    mapping is what reads gather from; :meth:`prefault` maps it in ahead of them. ``sealed``: no process can
    shrink it (a memfd's seals).
    """

    def __init__(self, size: int, path: str | None = None, keep_file: bool = False,
                 directory: HeldDir | None = None):
        if size <= 0:
            raise InvalidArgument(f"segment size: expected > 0 bytes, got {size}")
        self.path = os.path.abspath(path) if path is not None else None
        self.size = size
        self._keep_file = keep_file
        self._dir, self._own_dir = directory, False  # a file's directory, held open (see engram_store.durable)
        if self.path is None:
            fd, self.sealed = anonymous_memory(size, f"engram-segment-{os.getpid()}", "segment size")
            self.name = f"memfd {os.getpid()}/{fd}"
        else:
            if directory is None:
                self._dir, self._own_dir = DurableDir(os.path.dirname(self.path), "segment file"), True
            try:
                fd = _open_file(self._dir, os.path.basename(self.path), self.path, size, keep_file)
            except BaseException:
                self._close_dir()
                raise
            self.sealed, self.name = False, self.path
        try:
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            self._close_dir()
            raise
        self.fd = fd
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = self.array.ctypes.data
        self._closed = False
        if path is None:
            policy = shmem_huge_pages()
            _log_huge_page_policy(policy)
            if policy in ("advise", "within_size", "always", "force"):
                err = madvise(self.address, size, MADV_HUGEPAGE)
                if err:
                    log.debug("segment %s: madvise(MADV_HUGEPAGE) failed: %s", self.name, os.strerror(err))

    def write(self, offset: int, data: memoryview) -> int:
        """Write ``data`` at ``offset`` with ``pwrite`` (the caller checked that it fits); returns its length."""
        return pwrite_all(self.fd, data, offset)

    def prefault(self, stop: threading.Event, chunk_bytes: int = PREFAULT_CHUNK_BYTES) -> int:
        """Map every page of the segment into this process (see :func:`_pages.prefault`) until done or ``stop``
        is set; returns the bytes prefaulted. The caller sets ``stop`` and joins before closing the memory."""
        if self._closed:
            return 0
        return prefault(self.address, self.size, stop, name=f"segment {self.name}", chunk_bytes=chunk_bytes)

    def flush(self) -> None:
        """Make the segment's bytes durable in its file (fsync; writes went in with pwrite)."""
        if not self._closed:
            os.fsync(self.fd)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.array = None
        try:
            self._mmap.close()
        except BufferError:
            log.debug("segment %s: memory still referenced at close; leaving the mapping to the GC", self.name)
        os.close(self.fd)
        if self.path is not None and not self._keep_file:
            self._dir.unlink(os.path.basename(self.path))
        self._close_dir()

    def _close_dir(self) -> None:
        if self._own_dir:
            self._dir.close()
            self._own_dir = False


def _open_file(directory: HeldDir, name: str, path: str, size: int, keep_file: bool) -> int:
    """The file of a durable segment (``name`` in ``directory``, at ``path``), opened read-write and its pages
    reserved: created exclusively (never through a link; its mode what the umask leaves of 0644), or used again
    only if it is this user's own (UnsafeFile) and of the segment's size (ConfigError)."""
    fd, created = open_own(name, os.O_RDWR, "segment file", 0o644, dir_fd=directory.fd, create=True)
    if not keep_file and not created:
        os.close(fd)
        raise ConfigError(f"segment file {path!r} exists already; pass another path")
    try:
        existing = os.fstat(fd).st_size
        if existing > size:
            raise ConfigError(f"segment file {path!r} holds {existing} bytes but the segment size is {size}; "
                              "pass the size it was created with, or another file")
        if 0 < existing < size:  # (its manifest says the size is right: it lost its tail)
            log.error("segment file %s holds %d of its %d bytes (truncated): the rest reads as zeros, and the "
                      "objects there fail their checksums", path, existing, size)
        reserve(fd, size, path, "segment size")  # every page now: no SIGBUS later, faster first writes
    except BaseException:
        os.close(fd)
        if created:
            directory.unlink(name)
        raise
    return fd
