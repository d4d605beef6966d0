"""Tables on this host without a store: caller-owned buffers and layers published under a local directory.

Two ways to hold a layer's tables in this host's memory and read them with the local-direct kernel:

* ``bind_local``: the caller's own immutable arrays, used in place (no copy).
* ``local_dir``: ``populate`` copies the tables into files under a directory (``/dev/shm/engram`` keeps them
  in memory, shared by every process on the host), published atomically per layer; any process opening the
  same directory maps the published layers read-only and shares their pages.

The directory layout is Mooncake's, so a directory written by either is read by the other::

    <dir>/layer-<L>/layout        "mooncake-engram-v1\\n<row_bytes>\\n<N_0>\\n<N_1>\\n..."
    <dir>/layer-<L>/head-<h>.bin  the rows of head h, [N_h, row_bytes], C order
    <dir>/layer-<L>.lock          flock'd by a writer for the whole populate (removed when it is done; mode 0600)
    <dir>/layer-<L>.tmp/          where a writer stages the files before one rename publishes them

A reader never sees a half-written layer: the layer directory appears by ``rename`` only once every file in it
is complete. A staging directory left by a writer that died is removed by the next writer. A reader opens the
directory once (held open, ``engram_store._layer_dir.LayerDir``) and a layer as one snapshot: ``layer-<L>`` once,
then its layout and every head relative to it, so a layer removed and populated again while it is opened is never
mapped half from each.

Readers map the head files, so a file that shrank under them would kill them (SIGBUS). Published files are
therefore read-only (the read bits the umask leaves; directories get what it leaves, never writable by others), the
directory must be this user's or root's and no one else's to write, and a layer's directory and every file in it
are used only when they are this user's or root's and no one else may write them (``_layer_dir``). Only this
user, by changing the mode first, or root can still truncate one.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from typing import Any, Callable, Sequence

import numpy as np

from .. import pages as _pages
from .. import kernels as _kernels
from ..errors import ConfigError, ObjectExists, OutOfSpace, StoreError
from .._layer_dir import LayerDir, open_at, read_at
from ..pages import PREFAULT_CHUNK_BYTES, collapse_file, map_file, on_hugetlbfs, reserve
from .._shared_dirs import file_mode

log = logging.getLogger(__name__)

LAYOUT_MAGIC = "mooncake-engram-v1"
#: Tables whose addresses lie within this span are read through one source (one kernel call for all heads).
MAX_SPAN_BYTES = 1 << 40
#: How long a writer of a layer waits for another writer of it to finish.
LOCK_TIMEOUT_S = 600.0


def prefault(array: np.ndarray, background: bool = True) -> threading.Thread | None:
    """Map every page of a read-only file mapping now, in 2 MiB pages where the kernel can make them, so the first
    lookups do not page-fault and random rows miss the TLB less.

    A brand-new mapping of a 2.6 GB table pays ~0.1-0.3 s of page faults on its first random reads; this
    moves that cost into a background thread (see :func:`_pages.prefault`). A file another writer left in 4 KiB
    pages is collapsed into 2 MiB ones first (``_pages.collapse``: in the file, so for every reader). Mappings of
    at most one prefault chunk are mapped in at once.
    """
    address, size = array.ctypes.data, array.nbytes
    if not background or size <= PREFAULT_CHUNK_BYTES:
        _pages.prefault_huge(address, size, "local_dir table")
        return None
    thread = threading.Thread(target=_pages.prefault_huge, args=(address, size, "local_dir table"),
                              name="engram-prefault", daemon=True)
    thread.start()
    return thread


def sources_for(tables: Sequence[tuple[int, np.ndarray]], num_heads: int, row_bytes: int) -> list:
    """Row sources (``_kernels.RowSource``) reading each head's table in place.

    ``tables`` holds ``(head, flat uint8 array of that head's rows)``. Tables whose addresses lie close
    together share one source: a read-only view spanning them all, with each head's offset in it, so one
    kernel call gathers every head. The span also covers memory between the tables, which the kernel never
    touches (every id is checked against its head's row count first). The caller keeps ``tables`` alive.
    """
    ordered = sorted(tables, key=lambda t: t[1].ctypes.data)
    groups: list[list[tuple[int, np.ndarray]]] = []
    for head, table in ordered:
        if groups:
            lo = groups[-1][0][1].ctypes.data
            if table.ctypes.data + table.nbytes - lo <= MAX_SPAN_BYTES:
                groups[-1].append((head, table))
                continue
        groups.append([(head, table)])
    sources = []
    for group in groups:
        lo = group[0][1].ctypes.data
        hi = max(t.ctypes.data + t.nbytes for _, t in group)
        if len(group) == 1:
            span = group[0][1]
        else:
            span = np.frombuffer((ctypes.c_uint8 * (hi - lo)).from_address(lo), dtype=np.uint8)
        base = np.zeros(num_heads, dtype=np.int64)
        heads = []
        for head, table in group:
            base[head] = table.ctypes.data - lo
            heads.append(head)
        sources.append(_kernels.row_source(_kernels.readonly(span), base, np.asarray(heads, dtype=np.int64),
                                           row_bytes))
    return sources


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    written = 0
    while written < data.nbytes:
        written += os.pwrite(fd, data[written:], offset + written)


def layout_text(row_bytes: int, sizes: Sequence[int]) -> bytes:
    return (f"{LAYOUT_MAGIC}\n{row_bytes}\n" + "".join(f"{n}\n" for n in sizes)).encode()


class MappedLayer:
    """A published layer's head files mapped read-only (shared with every process mapping them), opened relative to
    the layer's directory held open (``dir_fd``, named ``path`` in messages): one publication's files, never a mix.
    A file that is not there raises FileNotFoundError (see ``LayerDir.open_published``)."""

    def __init__(self, dir_fd: int, path: str, row_bytes: int, sizes: Sequence[int], prefault_pages: bool = True):
        self.path = path
        self.tables: list[np.ndarray] = []
        self._mmaps: list[mmap.mmap] = []
        expected = layout_text(row_bytes, sizes)
        try:
            found = read_at(dir_fd, "layout", os.path.join(path, "layout"), "local_dir", len(expected) + 1)
            if found != expected:
                raise ConfigError(f"local_dir: layer at {path} was published with layout "
                                  f"{_describe_layout(found)}, but this EngramStore is configured with "
                                  f"{_describe_layout(expected)}; use the configuration it was populated with")
            for h, n in enumerate(sizes):
                self._map(dir_fd, f"head-{h}.bin", n * row_bytes, f"table_vocab_sizes[{h}] = {n} rows x {row_bytes} "
                                                                  "bytes")
        except FileNotFoundError:
            self.close()
            raise
        except OSError as exc:
            self.close()
            raise StoreError(f"local_dir: cannot open the tables of {path}: {exc}") from None
        except BaseException:
            self.close()
            raise
        if prefault_pages:
            for table in self.tables:
                prefault(table)

    def _map(self, dir_fd: int, name: str, nbytes: int, why: str) -> None:
        """Map head file ``name``, of ``nbytes`` bytes (``why`` says where the size comes from)."""
        file = os.path.join(self.path, name)
        fd = open_at(dir_fd, name, file, "local_dir")  # a file another user could truncate would kill its readers
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise StoreError(f"local_dir: {file} holds {size} bytes, expected {nbytes} ({why})")
            mm, offset = map_file(fd, size)  # at a 2 MiB boundary: each 2 MiB of the file can be one page
        finally:
            os.close(fd)
        self._mmaps.append(mm)
        self.tables.append(np.frombuffer(mm, dtype=np.uint8, count=size, offset=offset))

    def close(self) -> None:
        self.tables = []
        for mm in self._mmaps:
            try:
                mm.close()
            except BufferError:
                pass  # a lookup result still views it; the GC unmaps it later
        self._mmaps = []


def _describe_layout(text: bytes) -> str:
    lines = text.decode(errors="replace").split("\n")
    if len(lines) < 3 or lines[0] != LAYOUT_MAGIC:
        return repr(text[:60])
    sizes = [s for s in lines[2:] if s]
    return f"row_bytes={lines[1]}, table_vocab_sizes=[{', '.join(sizes[:8])}{', ...' if len(sizes) > 8 else ''}]"


class LocalDir:
    """A directory of published layers (see the module docstring), held open: ``LayerDir``."""

    def __init__(self, path: str | os.PathLike, create: bool = True, flag: str = "local_dir"):
        self.dir = LayerDir(path, flag, create=create)
        self.path = self.dir.path

    def layer_path(self, layer_id: int) -> str:
        return self.dir.join(layer_name(layer_id))

    def open(self, layer_id: int, row_bytes: int, sizes: Sequence[int],
             prefault_pages: bool = True) -> MappedLayer | None:
        """The published layer, mapped (one publication, whole); None if it is not published (yet). Raises if its
        layout differs."""
        return self.dir.open_published(layer_name(layer_id),
                                       lambda fd, shown: MappedLayer(fd, shown, row_bytes, sizes, prefault_pages))

    def publish(self, layer_id: int, row_bytes: int, sizes: Sequence[int], tables: Sequence[np.ndarray],
                progress: Callable[[int], None] | None = None) -> None:
        """Copy ``tables`` (C-contiguous, ``[N_h, row_bytes]`` bytes each) into a new published layer.

        Create-only: a published layer raises ObjectExists. Writers of one layer are serialised by a lock
        file; whatever fails, the staging directory is removed and nothing is published.
        """
        final = self.layer_path(layer_id)
        try:
            self._publish(layer_id, row_bytes, sizes, tables, progress)
        except OSError as exc:  # a directory we cannot write, a full or failing device: say which file
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OutOfSpace(f"local_dir: cannot publish layer {layer_id} at {final}: the file system is full "
                                 f"({exc.strerror}: {exc.filename or final}); nothing was published") from exc
            raise StoreError(f"local_dir: cannot publish layer {layer_id} at {final}: {exc}") from exc

    def _publish(self, layer_id: int, row_bytes: int, sizes: Sequence[int], tables: Sequence[np.ndarray],
                 progress: Callable[[int], None] | None) -> None:
        name = layer_name(layer_id)
        staging = name + ".tmp"
        with self.dir.using() as top:
            if on_hugetlbfs(top):
                raise ConfigError(f"local_dir: {self.path} is on hugetlbfs, whose files hold whole huge pages and "
                                  "cannot be written with write(2); use a directory under /dev/shm (engram moves "
                                  "its layers into 2 MiB pages itself) or a tmpfs mounted with huge=always")
        lock = self.dir.lock(name + ".lock", LOCK_TIMEOUT_S, "local_dir")
        try:
            if self.dir.exists(name):
                raise ObjectExists(f"local_dir: layer {layer_id} is already published at {self.layer_path(layer_id)}; "
                                   "remove that directory to publish it again")
            self.dir.remove_leftover(staging, "writer")
            fd = self.dir.stage(staging)
            try:
                self._write(fd, self.dir.join(staging), row_bytes, sizes, tables, progress)
                self.dir.publish(staging, fd, name)
            except BaseException:
                self.dir.discard(staging)
                raise
            finally:
                os.close(fd)
        finally:
            lock.close(unlink=True)  # nothing left behind: a waiter locks the file at the name, not this one

    @classmethod
    def _write(cls, fd: int, shown: str, row_bytes: int, sizes: Sequence[int], tables: Sequence[Any],
               progress: Callable[[int], None] | None) -> None:
        """Every file of a layer, into the staging directory ``fd``, checked as a reader will check them. Each head
        file is finished (collapsed into 2 MiB pages, synced, made read-only) on a thread of its own while the next
        one is written: the collapse was most of a load's time, and it waits on the kernel, not on this process."""
        done = 0
        finisher = _HeadFinisher()
        try:
            for h, table in enumerate(tables):
                head_fd, file = cls._write_head(fd, f"head-{h}.bin", shown, table, sizes[h] * row_bytes, row_bytes)
                finisher.finish(head_fd, sizes[h] * row_bytes, file)
                done += sizes[h] * row_bytes
                if progress is not None:
                    progress(done)
            finisher.wait()
        finally:
            finisher.stop()
        _write_layout(fd, layout_text(row_bytes, sizes))
        MappedLayer(fd, shown, row_bytes, sizes, prefault_pages=False).close()

    @staticmethod
    def _write_head(dir_fd: int, name: str, shown: str, table: Any, nbytes: int, row_bytes: int) -> tuple[int, str]:
        """Write one head's file from its table, or from ``fill(start_row, out)`` called chunk by chunk; returns
        the file, open, and its name, for :class:`_HeadFinisher`."""
        file = os.path.join(shown, name)
        fd = _create(dir_fd, name)
        try:
            reserve(fd, nbytes, file, "local_dir")  # a full tmpfs fails here, not with SIGBUS later
            step = 64 << 20
            if callable(table) and not isinstance(table, np.ndarray):
                chunk = np.empty((max(1, step // row_bytes), row_bytes), dtype=np.uint8)
                for start in range(0, nbytes // row_bytes, chunk.shape[0]):
                    rows = chunk[:min(chunk.shape[0], nbytes // row_bytes - start)]
                    table(start, rows)
                    _pwrite_all(fd, memoryview(rows.reshape(-1)), start * row_bytes)
            else:
                view = memoryview(table.reshape(-1).view(np.uint8))
                for start in range(0, nbytes, step):  # pwrite: no page faults in this process
                    _pwrite_all(fd, view[start:start + step], start)
        except BaseException:
            os.close(fd)
            raise
        return fd, file

    def close(self) -> None:
        self.dir.close()


class _HeadFinisher:
    """Finishes a layer's head files one at a time on a thread of its own, in the order given: collapses each
    file's pages into 2 MiB pages while no process maps them (``engram_store.pages``), syncs it, makes it read-only
    and closes it. :meth:`wait` raises what finishing a file raised; :meth:`stop` cuts a collapse short (the file
    stays in the pages it has: the staging directory is discarded after a failure) and waits for the thread.

    A file handed over is closed exactly once, by the side that claims it under its lock: the thread as it begins,
    or the writer where handing it over failed (an interrupt can land after the thread was made and before
    ``start`` returns; the thread then finds the file taken back and leaves it alone)."""

    def __init__(self) -> None:
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def finish(self, fd: int, nbytes: int, file: str) -> None:
        """Finish ``fd`` (which this takes over, closed whatever happens) once the file before it is finished."""
        handed = _Handed(fd)
        try:
            self.wait()
            self._thread = threading.Thread(target=self._run, args=(handed, nbytes, file),
                                            name="engram-local-dir-finish", daemon=True)
            self._thread.start()
        except BaseException:
            handed.claim("writer")
            raise

    def _run(self, handed: "_Handed", nbytes: int, file: str) -> None:
        fd = handed.claim("thread")
        if fd is None:
            return
        try:
            collapse_file(fd, nbytes, file, self._halt)
            if not self._halt.is_set():
                os.fsync(fd)
                os.fchmod(fd, file_mode())
        except BaseException as exc:  # raised in the writer's thread by wait()
            self._error = exc
        finally:
            os.close(fd)

    def _join(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            try:
                thread.join()
            except RuntimeError:  # never started: its file was taken back (finish)
                pass

    def wait(self) -> None:
        """Wait for the file in hand to be finished; raise what finishing it raised."""
        self._join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def stop(self) -> None:
        self._halt.set()
        self._join()


class _Handed:
    """A file descriptor one of two sides closes: the first to :meth:`claim` it."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd
        self.lock = threading.Lock()

    def claim(self, side: str) -> int | None:
        """The descriptor for the thread to use and close, or None if the writer took it back; for the writer,
        closes it unless the thread has it."""
        with self.lock:
            fd, self.fd = self.fd, None
        if fd is not None and side == "writer":
            os.close(fd)
            return None
        return fd


def layer_name(layer_id: int) -> str:
    return f"layer-{layer_id}"


def _create(dir_fd: int, name: str) -> int:
    """A new file in a staging directory: exclusively, never through a link (open for reading too: its pages are
    mapped to be collapsed into huge ones)."""
    return os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)


def _write_layout(dir_fd: int, text: bytes) -> None:
    fd = _create(dir_fd, "layout")
    try:
        _pwrite_all(fd, memoryview(text), 0)
        os.fsync(fd)
        os.fchmod(fd, file_mode())
    finally:
        os.close(fd)
