"""File helpers: page-aligned buffers, O_DIRECT opens with a reported fallback, the layer lock."""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import time

import numpy as np

from .._errors import StoreError
from ._layout import PAGE_BYTES

log = logging.getLogger(__name__)

O_DIRECT = getattr(os, "O_DIRECT", 0)
LOCK_POLL_S = 0.05


def aligned_empty(nbytes: int, align: int = PAGE_BYTES) -> np.ndarray:
    """A flat uint8 buffer of ``nbytes`` whose address is a multiple of ``align`` (O_DIRECT needs both)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


def open_direct(path: str, flags: int, mode: int = 0o600, direct: bool = True) -> tuple[int, bool]:
    """Open ``path`` with O_DIRECT where asked and the file system allows it; returns ``(fd, direct)``.

    File systems without O_DIRECT (tmpfs, some FUSE and network file systems) refuse it with EINVAL; the file
    is then opened through the page cache and the fallback is logged once per open.
    """
    flags |= os.O_CLOEXEC
    if direct and O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT, mode), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            log.warning("%s: the file system refuses O_DIRECT; reading and writing through the page cache", path)
    return os.open(path, flags, mode), False


class LayerLock:
    """The per-layer lock (``flock`` on ``<dir>/layer-<L>.lock``) that writers and removers of a layer hold for
    their whole work, released on close or process death.

    The holder may delete the lock file before it lets go (``close(unlink=True)``): a waiter that opened the
    deleted file gets its lock, sees the file is no longer the one at the path, and locks the one there instead,
    so two processes never both believe they hold the layer.
    """

    def __init__(self, path: str, timeout_s: float):
        self.path = path
        self.fd = -1
        deadline = time.monotonic() + timeout_s
        while True:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise StoreError(f"disk layer: another writer holds {path} (waited {timeout_s:g} s)"
                                             ) from None
                        time.sleep(LOCK_POLL_S)
                if _is_at(fd, path):
                    self.fd = fd
                    return
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # its holder deleted it while we waited: lock the file now at the path

    def close(self, unlink: bool = False) -> None:
        """Release the lock; with ``unlink``, delete the lock file first (still holding it)."""
        if self.fd >= 0:
            try:
                if unlink:
                    try:
                        os.unlink(self.path)
                    except FileNotFoundError:
                        pass
            finally:
                os.close(self.fd)  # releases the flock
                self.fd = -1


def _is_at(fd: int, path: str) -> bool:
    """Whether the open file ``fd`` is the file at ``path`` (not one deleted or replaced since it was opened)."""
    held = os.fstat(fd)
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


def remove_leftover(path: str, left_by: str) -> bool:
    """Delete the directory ``path`` that a writer or remover of the layer left when it died; whether there was
    one. Call it holding the layer's lock: the live writer or remover of a layer holds it for its whole work, so
    what is there under the lock belongs to a dead one."""
    if not os.path.lexists(path):
        return False
    log.warning("removing %s, left by a %s that died", path, left_by)
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError as exc:
        raise StoreError(f"disk layer: cannot remove {path}, left by a {left_by} that died: {exc}; delete it by "
                         "hand") from exc
    return True


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
