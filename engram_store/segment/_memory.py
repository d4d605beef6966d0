"""A segment's memory: a shared-memory (or regular) file mapped read-write, and what knows about such files.

Segment files live in ``/dev/shm`` as ``engram-<pid>-<id>``, so a client on the same host can map one read-only
(local-direct reads) and a new segment can remove the files of processes that died without cleaning up.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import socket
import threading
import uuid

import numpy as np

from .._errors import ConfigError, InvalidArgument, OutOfSpace
from .._pages import MADV_HUGEPAGE, PREFAULT_CHUNK_BYTES, madvise, prefault, reserve

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
THP_SHMEM_SETTING = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def host_id() -> str:
    """Identifies this machine (and boot), so a client can tell whether a segment's file is local."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def reap_orphans(directory: str = SHM_DIR) -> list[str]:
    """Remove segment files left by processes that died without cleaning up (e.g. after SIGKILL)."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "engram" or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        try:
            os.kill(pid, 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # someone else's live process
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("removed %d segment file(s) left by dead processes in %s", len(removed), directory)
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
    """A segment's bytes: a shared-memory (or regular) file mapped read-write, removed on close.

    The file stays open (``fd``): writes go in with ``pwrite`` (:meth:`write`), which moves bytes at
    memory speed where a copy into a freshly mapped page pays a fault per 4 KiB, and :meth:`flush` is an
    ``fsync`` of it. The mapping is what reads gather from; :meth:`prefault` maps it in ahead of them.
    """

    def __init__(self, size: int, path: str | None = None, keep_file: bool = False):
        if size <= 0:
            raise InvalidArgument(f"segment size: expected > 0 bytes, got {size}")
        if path is None:
            directory = SHM_DIR if os.path.isdir(SHM_DIR) else os.environ.get("TMPDIR", "/tmp")
            reap_orphans(directory)
            path = os.path.join(directory, f"engram-{os.getpid()}-{uuid.uuid4().hex}")
        self.path = path
        self.size = size
        self._keep_file = keep_file
        fd = os.open(path, os.O_RDWR | os.O_CREAT | (0 if keep_file else os.O_EXCL), 0o600)
        try:
            existing = os.fstat(fd).st_size
            if keep_file and existing > size:
                raise ConfigError(f"segment file {path!r} holds {existing} bytes but the segment size is {size}; "
                                  "pass the size it was created with, or another file")
            if keep_file and 0 < existing < size:  # (its manifest says the size is right: it lost its tail)
                log.error("segment file %s holds %d of its %d bytes (truncated): the rest reads as zeros, and the "
                          "objects there fail their checksums", path, existing, size)
            reserve(fd, size, path, "segment size")  # every page now: no SIGBUS later, faster first writes
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ConfigError, OutOfSpace):
            os.close(fd)
            if not keep_file:
                os.unlink(path)
            raise
        self.fd = fd
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = self.array.ctypes.data
        self._closed = False
        if os.path.dirname(path) == SHM_DIR:
            policy = shmem_huge_pages()
            _log_huge_page_policy(policy)
            if policy in ("advise", "within_size", "always", "force"):
                err = madvise(self.address, size, MADV_HUGEPAGE)
                if err:
                    log.debug("segment %s: madvise(MADV_HUGEPAGE) failed: %s", path, os.strerror(err))

    def write(self, offset: int, data: memoryview) -> int:
        """Write ``data`` at ``offset`` with ``pwrite`` (the caller checked that it fits); returns its length."""
        return pwrite_all(self.fd, data, offset)

    def prefault(self, stop: threading.Event, chunk_bytes: int = PREFAULT_CHUNK_BYTES) -> int:
        """Map every page of the segment into this process (see :func:`_pages.prefault`) until done or ``stop``
        is set; returns the bytes prefaulted. The caller sets ``stop`` and joins before closing the memory."""
        if self._closed:
            return 0
        return prefault(self.address, self.size, stop, name=f"segment {self.path}", chunk_bytes=chunk_bytes)

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
            log.debug("segment %s: memory still referenced at close; leaving the mapping to the GC", self.path)
        os.close(self.fd)
        if not self._keep_file:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
