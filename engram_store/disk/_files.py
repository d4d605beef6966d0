"""File helpers: page-aligned buffers, O_DIRECT opens with a reported fallback, the layer lock."""
from __future__ import annotations

import errno
import fcntl
import logging
import os
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
    """The per-layer writer lock (``flock`` on ``<dir>/layer-<L>.lock``), released on close or process death."""

    def __init__(self, path: str, timeout_s: float):
        self.path = path
        self.fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    self.fd = -1
                    raise StoreError(f"disk layer: another writer holds {path} (waited {timeout_s:g} s)") from None
                time.sleep(LOCK_POLL_S)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the flock
            self.fd = -1


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
