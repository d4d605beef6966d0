"""File helpers: page-aligned buffers, O_DIRECT opens with a reported fallback, a published layer's files opened from
its directory held open (:class:`LayerFiles`); the directory itself, the layer lock and the rest of a layer
directory's life are :mod:`engram_store._layer_dir`'s (shared with ``local_dir``)."""
from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import DiskReadError, StoreError, describe
from .._layer_dir import check_held, link_refused, open_at
from ._layout import DATA_FILE, PAGE_BYTES, DiskLayout, check_expected, read_manifest_at

__all__ = ["LayerFiles", "O_DIRECT", "aligned_empty", "open_direct"]

log = logging.getLogger(__name__)

O_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned_empty(nbytes: int, align: int = PAGE_BYTES) -> np.ndarray:
    """A flat uint8 buffer of ``nbytes`` whose address is a multiple of ``align`` (O_DIRECT needs both)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


def open_direct(path: str, flags: int, mode: int = 0o600, direct: bool = True, *, dir_fd: int | None = None,
                shown: str | None = None) -> tuple[int, bool]:
    """Open ``path`` (relative to the held directory ``dir_fd``, if given; ``shown`` names it in the log) with
    O_DIRECT where asked and the file system allows it; returns ``(fd, direct)``.

    File systems without O_DIRECT (tmpfs, some FUSE and network file systems) refuse it with EINVAL; the file
    is then opened through the page cache and the fallback is logged once per open.
    """
    flags |= os.O_CLOEXEC
    if direct and O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT, mode, dir_fd=dir_fd), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            log.warning("%s: the file system refuses O_DIRECT; reading and writing through the page cache",
                        shown or path)
    return os.open(path, flags, mode, dir_fd=dir_fd), False


@dataclass
class LayerFiles:
    """A published layer opened from its directory held open (see ``LayerDir.open_published``): its manifest, and
    its data file open for reading (O_DIRECT where asked and the file system allows it)."""

    record: dict
    layout: DiskLayout
    fd: int
    direct: bool

    @classmethod
    def open(cls, dir_fd: int, path: str, layer_id: int, row_bytes: int | None, sizes: Sequence[int] | None,
             direct: bool) -> "LayerFiles":
        """Read the manifest of the layer directory ``dir_fd`` (``path``) and open its data file, both checked;
        FileNotFoundError when one is not there (see ``LayerDir.open_published``)."""
        record, layout = read_manifest_at(dir_fd, path)
        if record.get("layer_id") != layer_id:
            raise StoreError(f"disk layer: {path} holds layer {describe(record.get('layer_id'))}, expected {layer_id}")
        check_expected(path, layout, row_bytes, sizes)
        file = os.path.join(path, DATA_FILE)
        try:
            fd, direct = open_direct(DATA_FILE, os.O_RDONLY | os.O_NOFOLLOW, direct=direct, dir_fd=dir_fd, shown=file)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise link_refused(file, "disk layer") from None
            raise StoreError(f"disk layer {layer_id}: cannot open {file}: {exc.strerror}") from None
        try:
            size = check_held(fd, file, "disk layer").st_size
            if size != layout.file_bytes:
                raise DiskReadError(f"disk layer {layer_id}: {file} holds {size} bytes, the manifest promises "
                                    f"{layout.file_bytes} (truncated or replaced)")
            if direct and not _direct_read_works(fd, layout.block_bytes, layer_id, file):
                os.close(fd)
                fd, direct = -1, False
                fd = open_at(dir_fd, DATA_FILE, file, "disk layer")
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return cls(record, layout, fd, direct)


def _direct_read_works(fd: int, block_bytes: int, layer_id: int, file: str) -> bool:
    """Some file systems accept O_DIRECT at open and refuse the reads (EINVAL): try one block."""
    buf = aligned_empty(block_bytes)
    try:
        os.preadv(fd, [memoryview(buf)], 0)
        return True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise DiskReadError(f"disk layer {layer_id}: reading {file} at offset 0 failed: {exc.strerror}") from None
        log.warning("%s: O_DIRECT reads refused (EINVAL); reading through the page cache", file)
        return False
