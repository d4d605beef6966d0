"""Writing a layer to disk with bounded memory, published atomically (see ``_layout`` for the files).

A :class:`LayerWriter` takes each head either as an array ``[N_h, row_bytes]`` (any dtype, seen as bytes) or as
a fill callback ``fill(start_row, out)`` that writes rows ``start_row .. start_row + len(out)`` into ``out``, a
C-contiguous ``uint8 [n, row_bytes]`` buffer; so a checkpoint loader can produce a 100 GB layer a chunk at a
time. Rows are packed into page-aligned blocks and written by a background thread while the next chunk is
filled (two chunk buffers: memory stays at about ``3 * chunk_bytes``), with O_DIRECT where the file system
allows it (the page cache is not filled with a table nobody reads yet).

Publication is create-only: the writer takes the layer's lock, removes a staging directory a dead writer left
(and a directory a dead remover of the layer left), writes into a fresh one, and on :meth:`LayerWriter.commit`
fsyncs the data and the manifest, renames the staging directory into place and fsyncs the parent. Until then
readers see nothing; on any failure (or :meth:`LayerWriter.abort`) the staging directory is removed. Every name is
opened, made or renamed relative to the ``disk_dir`` held open (``engram_store._layer_dir.LayerDir``), and every
file made exclusively, never through a link.
"""
from __future__ import annotations

import errno
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence, Union

import numpy as np
import xxhash

from ..errors import InvalidArgument, InvalidType, ObjectExists, OutOfSpace, StoreError, describe, is_int
from ..pages import reserve
from ..progress import Progress
from .._shared_dirs import file_mode
from . import _kernels
from .._layer_dir import LayerDir, LayerLock
from ._files import aligned_empty, open_direct
from ._layout import DATA_FILE, MANIFEST, DiskLayout, check_layer_id, dumps, layer_dir_name, manifest

log = logging.getLogger(__name__)

#: Rows handed to a fill callback (or packed from an array) at a time, in bytes of blocks.
DEFAULT_CHUNK_BYTES = 32 << 20
#: Layers above this size show a progress bar (where stderr is a terminal) unless ``progress`` says otherwise.
PROGRESS_MIN_BYTES = 256 << 20
DEFAULT_LOCK_TIMEOUT_S = 60.0

#: The errnos of a full disk (or a full quota).
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

Fill = Callable[[int, np.ndarray], object]
HeadSource = Union[np.ndarray, Fill]


class LayerWriter:
    """Streams one layer's heads into a staging directory; :meth:`commit` publishes them. A context manager:
    leaving the block normally commits, leaving it with an exception aborts.

    ``progress``: a callable given the logical bytes written so far, ``False`` for none, or None for a progress
    bar on a terminal for layers over 256 MiB.
    """

    def __init__(self, directory: str | os.PathLike | LayerDir, layer_id: int, row_bytes: int, sizes: Sequence[int],
                 *, progress: Callable[[int], None] | bool | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 direct: bool = True, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S):
        if not isinstance(directory, LayerDir) and (not isinstance(directory, (str, os.PathLike))
                                                    or not os.fspath(directory)):
            raise InvalidArgument(f"directory: expected a directory path, got {describe(directory)}")
        self.layer_id = check_layer_id(layer_id)
        self.layout = DiskLayout.of(row_bytes, sizes, checked=True)  # where the rows leave room in a page
        if not is_int(chunk_bytes) or chunk_bytes <= 0:
            raise InvalidArgument(f"chunk_bytes: expected a byte count > 0, got {describe(chunk_bytes)}")
        self._name = layer_dir_name(self.layer_id)
        self.directory = directory.path if isinstance(directory, LayerDir) else os.path.abspath(os.fspath(directory))
        self.path = os.path.join(self.directory, self._name)
        self.staging = self.path + ".tmp"
        lay = self.layout
        blocks_per_chunk = max(1, int(chunk_bytes) // lay.block_bytes)
        self._chunk_rows = blocks_per_chunk * lay.rows_per_block
        total = sum(lay.sizes) * lay.row_bytes
        if progress is None:
            progress = Progress(total, f"write layer {self.layer_id}",
                                enabled=None if total > PROGRESS_MIN_BYTES else False)
        self._progress = progress or None
        self._done_bytes = 0
        self._checksums: list[str | None] = [None] * lay.num_heads
        self._fd = self._staging_fd = -1
        self._lock: LayerLock | None = None
        self._closed = False
        self._dir: LayerDir | None = directory if isinstance(directory, LayerDir) else None
        self._own_dir = self._dir is None
        try:
            self._start(lock_timeout_s, direct)
        except OSError as exc:
            self._cleanup()
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise StoreError(f"disk layer {self.layer_id}: cannot write under disk_dir {self.directory}: "
                                 f"{exc.strerror} ({exc.filename or self.directory}); writing a layer needs a "
                                 "directory this process may write in") from exc
            raise StoreError(f"disk layer {self.layer_id}: cannot write under disk_dir {self.directory}: {exc}"
                             ) from exc
        except BaseException:
            self._cleanup()
            raise
        self._rows = np.empty((self._chunk_rows, lay.row_bytes), dtype=np.uint8)
        self._blocks = [aligned_empty(blocks_per_chunk * lay.block_bytes) for _ in range(2)]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engram-disk-write")
        self._pending: Future | None = None

    def _start(self, lock_timeout_s: float, direct: bool) -> None:
        """Take the layer's lock, clear what a dead writer or remover left, and open the staging directory and its
        data file (every name relative to the directory held open)."""
        if self._dir is None:
            self._dir = LayerDir(self.directory, "disk_dir")
        held, name = self._dir, self._name
        self._lock = held.lock(name + ".lock", lock_timeout_s)
        if held.exists(name):
            raise ObjectExists(f"disk layer {self.layer_id} is already published at {self.path}; remove that "
                               "directory to write it again")
        held.remove_leftover(name + ".tmp", "writer")
        held.remove_leftover(name + ".removing", "remover")
        self._staging_fd = held.stage(name + ".tmp")  # published with the mode the umask leaves (dir_mode)
        file = os.path.join(self.staging, DATA_FILE)
        self._fd, self.direct = open_direct(DATA_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600,
                                            direct, dir_fd=self._staging_fd, shown=file)
        _reserve(self._fd, file, self.layout.file_bytes)

    # ---- writing heads ----

    def write_head(self, head: int, source: HeadSource) -> str:
        """Write head ``head`` from an array or a fill callback; returns its xxh3_64 checksum (hex)."""
        self._check_open()
        lay = self.layout
        if not is_int(head) or not 0 <= head < lay.num_heads:
            raise InvalidArgument(f"head: expected an int in [0, {lay.num_heads}), got {describe(head)}")
        head = int(head)
        if self._checksums[head] is not None:
            raise InvalidArgument(f"head: head {head} of layer {self.layer_id} was already written")
        n = lay.sizes[head]
        if isinstance(source, np.ndarray):
            table = _table_bytes(source, n, lay.row_bytes, head)
            fill = None
        elif callable(source):
            table, fill = None, source
        else:
            raise InvalidType(f"heads[{head}]: expected an array [N_h, row_bytes] or a callable fill(start_row, out), "
                              f"got {type(source).__name__}")
        hasher = xxhash.xxh3_64()
        try:
            for start in range(0, n, self._chunk_rows):
                count = min(self._chunk_rows, n - start)
                if fill is not None:
                    rows = self._rows[:count]
                    fill(start, rows)
                    flat = rows.reshape(-1)
                else:
                    flat = table[start * lay.row_bytes:(start + count) * lay.row_bytes]
                hasher.update(flat)
                self._write_chunk(flat, lay.head_offsets[head] + (start // lay.rows_per_block) * lay.block_bytes)
                self._done_bytes += flat.size
                if self._progress is not None:
                    self._progress(self._done_bytes)
            self._wait()
        except BaseException:
            self.abort()
            raise
        self._checksums[head] = hasher.hexdigest()
        return self._checksums[head]

    def _write_chunk(self, flat: np.ndarray, offset: int) -> None:
        lay = self.layout
        blocks = self._blocks[0]  # free: the write in flight (if any) holds the other buffer
        nbytes = _kernels._pack_rows(flat, lay.row_bytes, lay.rows_per_block, lay.block_bytes, blocks, offset,
                                     lay.summed_bytes)
        self._wait()
        self._blocks.reverse()
        self._pending = self._pool.submit(_pwrite_all, self._fd, blocks[:nbytes], offset, self.staging)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    # ---- publishing ----

    def commit(self) -> str:
        """Publish the layer (every head must have been written); returns the layer's directory."""
        self._check_open()
        missing = [h for h, c in enumerate(self._checksums) if c is None]
        if missing:
            self.abort()
            raise InvalidArgument(f"disk layer {self.layer_id}: heads {missing[:8]}{'...' if len(missing) > 8 else ''}"
                                  " were never written; nothing was published")
        try:
            os.fsync(self._fd)
            os.fchmod(self._fd, file_mode())
            os.close(self._fd)
            self._fd = -1
            _write_file(self._staging_fd, MANIFEST, os.path.join(self.staging, MANIFEST),
                        dumps(manifest(self.layer_id, self.layout, self._checksums)), self.layer_id)
            self._dir.publish(self._name + ".tmp", self._staging_fd, self._name)
            os.close(self._staging_fd)
            self._staging_fd = -1
        except OSError as exc:
            self.abort()
            raise StoreError(f"disk layer {self.layer_id}: cannot publish {self.path}: {exc}") from exc
        except BaseException:
            self.abort()
            raise
        self._finish()
        log.info("published disk layer %s at %s (%d bytes)", self.layer_id, self.path, self.layout.file_bytes)
        return self.path

    def abort(self) -> None:
        """Drop everything written; nothing is published. Idempotent."""
        if self._closed:
            return
        try:
            if getattr(self, "_pending", None) is not None:
                try:
                    self._pending.result()
                except BaseException:
                    pass
                self._pending = None
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._staging_fd >= 0:  # only a staging directory this writer made (another's is its own business)
            os.close(self._staging_fd)
            self._staging_fd = -1
            self._dir.discard(self._name + ".tmp")
        self._finish()

    def _finish(self) -> None:
        self._closed = True
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if self._own_dir and self._dir is not None:
            self._dir.close()
        if callable(getattr(self._progress, "close", None)):
            self._progress.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"disk layer {self.layer_id}: this writer was already committed or aborted")

    def __enter__(self) -> "LayerWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if not self._closed:
                self.commit()
        else:
            self.abort()


def write_layer(directory: str | os.PathLike | LayerDir, layer_id: int, row_bytes: int, sizes: Sequence[int],
                heads: Sequence[HeadSource], *, progress: Callable[[int], None] | bool | None = None,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES, direct: bool = True) -> str:
    """Write and publish a layer whose head ``h`` comes from ``heads[h]`` (array or fill callback); returns its
    directory. All-or-nothing: on any error nothing is published."""
    layout = DiskLayout.of(row_bytes, sizes)
    if isinstance(heads, (str, bytes)) or not hasattr(heads, "__len__") or len(heads) != layout.num_heads:
        raise InvalidArgument(f"heads: expected {layout.num_heads} tables or fill callbacks (one per entry of "
                              f"sizes), got {describe(heads)}")
    with LayerWriter(directory, layer_id, row_bytes, sizes, progress=progress, chunk_bytes=chunk_bytes,
                     direct=direct) as writer:
        for h, source in enumerate(heads):
            writer.write_head(h, source)
    return writer.path


def _table_bytes(table: np.ndarray, n: int, row_bytes: int, head: int) -> np.ndarray:
    if not table.flags.c_contiguous:
        raise InvalidArgument(f"heads[{head}]: expected a C-contiguous array (use np.ascontiguousarray)")
    if table.ndim < 1 or table.shape[0] != n or table.nbytes != n * row_bytes:
        raise InvalidArgument(f"heads[{head}]: expected {n} rows of {row_bytes} bytes (sizes[{head}] = {n}), got "
                              f"shape {table.shape} dtype {table.dtype} ({table.nbytes} bytes)")
    return table.reshape(-1).view(np.uint8)


def _reserve(fd: int, file: str, nbytes: int) -> None:
    """Reserve the file's blocks now, so a full disk fails here rather than half way through the write."""
    reserve(fd, nbytes, file, "disk layer")


def _write_file(dir_fd: int, name: str, path: str, data: bytes, layer_id: int) -> None:
    """Write a small new file ``name`` (``path``) in the staging directory ``dir_fd`` whole (exclusively, never
    through a link), synced and read-only; a full disk raises OutOfSpace naming it."""
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
        os.fsync(fd)  # where the file system allocates late, this is where a full disk shows
        os.fchmod(fd, file_mode())
    except OSError as exc:
        if exc.errno in _NO_SPACE:
            raise OutOfSpace(f"disk layer {layer_id}: no space left writing {path} ({len(data)} bytes): "
                             f"{exc.strerror}") from None
        raise
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: np.ndarray, offset: int, where: str) -> None:
    view = memoryview(data)
    written = 0
    while written < view.nbytes:
        try:
            n = os.pwrite(fd, view[written:], offset + written)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise OutOfSpace(f"disk layer: {where}: no space left writing at offset {offset + written}") from None
            raise StoreError(f"disk layer: {where}/{DATA_FILE}: write at offset {offset + written} failed: "
                             f"{exc.strerror}") from exc
        if n <= 0:
            raise StoreError(f"disk layer: {where}/{DATA_FILE}: write at offset {offset + written} wrote nothing")
        written += n
