"""File helpers: page-aligned buffers, O_DIRECT opens with a reported fallback; the layer lock and the rest of a
layer directory's life are :mod:`engram_store._layer_dir`'s (shared with ``local_dir``)."""
from __future__ import annotations

import errno
import logging
import os

import numpy as np

from .._layer_dir import LayerLock, fsync_dir, remove_leftover
from ._layout import PAGE_BYTES

__all__ = ["LayerLock", "O_DIRECT", "aligned_empty", "fsync_dir", "open_direct", "remove_leftover"]

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


