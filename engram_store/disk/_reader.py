"""Reading rows of published layers: distinct blocks, many reads in flight, a hot-row cache in front.

A read of ``ids [M, H]`` (``DiskLayer.read_rows`` or several layers at once with :func:`read_many`):

1. one kernel pass checks every id, copies the rows the cache holds straight into the output, and turns the
   rest into distinct blocks (rows sharing a page are read once);
2. the blocks are read with the engine's ``depth`` reads in flight into page-aligned buffers (O_DIRECT: the page
   cache neither serves nor keeps them), and each block's rows are copied into the output as it arrives. By
   default the calling thread drives Linux native AIO from a Numba ``nogil`` loop (a read submitted as soon as a
   slot frees); ``IOEngine(mode="threads")`` has a pool of threads each ``pread`` one block at a time. Every
   layer of a :func:`read_many` is queued at once, so all their blocks share the same queue depth;
3. the rows read are offered to the cache.

A failed read (an I/O error, a file that shrank) raises :class:`DiskReadError` naming the file and offset; no
row is ever left as zeros. The data files are read (AIO or ``pread``), never mapped, so a truncated file is an
error, not a SIGBUS.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import xxhash

from .. import _fork
from ..errors import (DiskReadError, InvalidArgument, InvalidType, ObjectNotFound, StoreError, TableClosed, describe,
                       is_int)
from .._layer_dir import HeldFd, LayerDir
from . import _kernels as k
from ._cache import RowCache
from ._files import LayerFiles, aligned_empty
from ._layout import DATA_FILE, PAGE_BYTES, DiskLayout, check_layer_id, layer_dir_name, page_checks

log = logging.getLogger(__name__)

#: Reads in flight per engine (per calling thread with native AIO). The device here (a virtio SSD) gives 65-70k
#: IOPS at 32 and 70-80k at 64 in flight with fio; see ``bench/bench_disk.py``.
DEFAULT_DEPTH = 64

# Linux native AIO system calls: (io_setup, io_destroy, io_getevents, io_submit)
_AIO_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_ENGINE_MODES = ("auto", "aio", "threads")


class _AioContext:
    """One thread's Linux AIO context and the buffers of its ``depth`` read slots (destroyed with the thread)."""

    def __init__(self, depth: int, slot_bytes: int):
        self.numbers = _AIO_SYSCALLS[platform.machine()]
        ctx = ctypes.c_ulong(0)
        if _libc.syscall(ctypes.c_long(self.numbers[0]), ctypes.c_uint(depth), ctypes.byref(ctx)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_setup: {os.strerror(err)}")
        self.ctx = int(ctx.value)
        self.depth = depth
        self.slot_bytes = slot_bytes
        self.bufs = aligned_empty(depth * slot_bytes)
        self.iocbs = np.zeros(depth * k.IOCB_WORDS, dtype=np.int64)
        self.ptrs = np.zeros(depth, dtype=np.int64)
        self.events = np.zeros(depth * k.EVENT_WORDS, dtype=np.int64)

    def destroy(self) -> None:
        ctx, self.ctx = self.ctx, 0
        libc = _libc  # None while the interpreter shuts down: the process exit frees the context then
        if ctx and libc is not None:
            libc.syscall(ctypes.c_long(self.numbers[1]), ctypes.c_ulong(ctx))  # waits for reads still in flight

    def __del__(self) -> None:
        self.destroy()


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def aio_available() -> bool:
    """Whether this host has Linux native AIO (a known architecture, and ``io_setup`` succeeds)."""
    if sys.platform != "linux" or platform.machine() not in _AIO_SYSCALLS:
        return False
    try:
        _AioContext(1, PAGE_BYTES).destroy()
        return True
    except OSError as exc:
        log.info("Linux native AIO is unavailable (%s); reading with threads", exc)
        return False


class IOEngine:
    """How reads are issued: ``depth`` reads in flight.

    ``mode="aio"``: Linux native AIO driven by the calling thread (one context per thread, kept for its life), so
    each thread that reads has ``depth`` reads in flight with no thread hand-off. ``mode="threads"``: a pool of
    ``depth`` threads each blocking in ``pread``. ``"auto"`` (default) picks AIO where the host has it. Files
    read through the page cache (no O_DIRECT) always use the threads: AIO on them would block in submit.

    Measured on a 2-core VM shared with other work (``bench/bench_disk.py``, rounds alternating with fio while
    the disk was steady): AIO reads at 0.95-1.06x fio's libaio IOPS at depths 1-64, while 32-64 blocking threads
    fall to a tenth of it whenever the cores are busy: each read's completion must wake a thread, and there are no
    idle cores to run it.
    """

    def __init__(self, depth: int = DEFAULT_DEPTH, mode: str = "auto"):
        if not is_int(depth) or not 1 <= depth <= 1024:
            raise InvalidArgument(f"depth: expected an int in [1, 1024], got {describe(depth)}")
        if mode not in _ENGINE_MODES:
            raise InvalidArgument(f"mode: expected one of {list(_ENGINE_MODES)}, got {describe(mode)}")
        self.depth = int(depth)
        if mode == "aio" and not aio_available():
            raise StoreError("mode='aio': Linux native AIO is not available on this host (use 'auto' or 'threads')")
        self.aio = mode == "aio" or (mode == "auto" and aio_available())
        self.mode = "aio" if self.aio else "threads"
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._local = threading.local()
        self._closed = False
        _fork.in_child(self._forked)

    def _forked(self) -> None:
        """In a forked child: the kernel gave it no AIO context (the forking thread's is the parent's, never used or
        destroyed here) and the pool no thread; the child makes its own on first use (see ``engram_store._fork``)."""
        inherited = getattr(self._local, "aio", None)
        if inherited is not None:
            inherited.ctx = 0  # its id may be a context this child makes later: never destroy it from here
        _fork.keep(self._pool)
        self._pool, self._pool_lock, self._local = None, threading.Lock(), threading.local()

    def buffer(self, nbytes: int) -> np.ndarray:
        """This thread's page-aligned read buffer of at least ``nbytes`` (the threads engine)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < nbytes:
            buf = self._local.buf = aligned_empty(max(nbytes, PAGE_BYTES))
        return buf

    def _context(self, slot_bytes: int) -> _AioContext:
        ctx = getattr(self._local, "aio", None)
        if ctx is None or ctx.slot_bytes < slot_bytes or not ctx.ctx:
            if ctx is not None:
                ctx.destroy()
            ctx = self._local.aio = _AioContext(self.depth, max(slot_bytes, PAGE_BYTES))
        return ctx

    def _submit(self, fn, n: int) -> list:
        with self._pool_lock:
            if self._closed:
                raise StoreError("disk: this IOEngine is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="engram-disk-io")
            return [self._pool.submit(fn) for _ in range(n)]

    def read(self, batch: "_Batch", direct: bool) -> None:
        """Read every block of ``batch`` and serve its rows; failures are left in ``batch.status``."""
        P = batch.offsets.size
        if P == 0:
            return
        if self.aio and direct:
            ctx = self._context(batch.max_block)
            rc = k._aio_drive(ctx.ctx, ctx.numbers[3], ctx.numbers[2], *batch.arrays(), ctx.bufs, ctx.slot_bytes,
                              ctx.iocbs, ctx.ptrs, ctx.events, batch.counter, batch.status)
            if rc < 0:
                ctx.destroy()
                raise DiskReadError(f"disk: io_getevents failed: {os.strerror(-rc)}")
            return
        run = lambda: k._pread_drive(*batch.arrays(), self.buffer(batch.max_block), batch.counter, batch.status)
        if P <= INLINE_BLOCKS:
            run()
            return
        errors = []
        for f in self._submit(run, min(self.depth, P)):
            try:
                f.result()
            except BaseException as exc:  # a kernel never raises; keep the first error after all are done
                errors.append(exc)
        if errors:
            raise errors[0]

    def close(self) -> None:
        with self._pool_lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> "IOEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"IOEngine(depth={self.depth}, mode={self.mode!r})"


#: A read of at most this many blocks through the threads engine runs in the calling thread.
INLINE_BLOCKS = 1

_default_engine: IOEngine | None = None
_default_lock = threading.Lock()


def _forget_default_lock() -> None:
    global _default_lock
    _default_lock = threading.Lock()  # another thread may have held it at a fork


_fork.in_child(_forget_default_lock)


def default_engine() -> IOEngine:
    """The process's shared engine (``DEFAULT_DEPTH`` reads in flight), made on first use."""
    global _default_engine
    with _default_lock:
        if _default_engine is None:
            _default_engine = IOEngine()
        return _default_engine


class DiskLayer:
    """A published layer, opened read-only. Thread-safe; a context manager; ``close()`` is idempotent, and a read
    running when it comes finishes on the layer's file first (reads after it raise TableClosed).

    ``directory``: a path, or a held ``LayerDir`` (``DiskDir`` passes its own). The layer is opened as one snapshot:
    its directory once, then its manifest and data file relative to it, each checked (this user's or root's, not
    writable by others), so a layer removed or published again meanwhile is never read half from each.

    Raises ObjectNotFound if the layer is not published under ``directory``, ConfigError if it was published with
    another ``row_bytes`` or ``sizes`` than the caller's (None accepts what was published), StoreError if its
    files are damaged (a manifest that does not parse, a data file of the wrong size), UnsafeFile if another user
    could change them.

    ``cache``: a :class:`RowCache` (possibly shared with other layers) or None. ``engine``: an :class:`IOEngine`,
    by default the process's. ``direct=False`` reads through the page cache; where the file system refuses
    O_DIRECT the layer falls back to that and says so in a warning and in ``direct``.
    """

    def __init__(self, directory: str | os.PathLike | LayerDir, layer_id: int, row_bytes: int | None = None,
                 sizes: Sequence[int] | None = None, *, cache: RowCache | None = None,
                 engine: IOEngine | None = None, direct: bool = True):
        if not isinstance(directory, LayerDir) and (not isinstance(directory, (str, os.PathLike))
                                                    or not os.fspath(directory)):
            raise InvalidArgument(f"directory: expected a directory path, got {describe(directory)}")
        if cache is not None and not isinstance(cache, RowCache):
            raise InvalidType(f"cache: expected a RowCache or None, got {type(cache).__name__}")
        if engine is not None and not isinstance(engine, IOEngine):
            raise InvalidType(f"engine: expected an IOEngine or None, got {type(engine).__name__}")
        self.layer_id = check_layer_id(layer_id)
        self._held: HeldFd | None = None
        held = directory if isinstance(directory, LayerDir) else LayerDir(directory, "directory", create=False)
        name = layer_dir_name(self.layer_id)
        self.path = held.join(name)
        self.file = os.path.join(self.path, DATA_FILE)
        try:
            files = held.open_published(name, lambda fd, shown: LayerFiles.open(fd, shown, self.layer_id, row_bytes,
                                                                            sizes, direct))
        finally:
            if held is not directory:
                held.close()
        if files is None:
            raise ObjectNotFound(f"disk layer {self.layer_id} is not published under {held.path} (no {self.path})")
        self.layout, self.direct = files.layout, files.direct
        self.checksums: tuple[str, ...] = tuple(files.record["checksum"]["heads"])
        #: How each block read is checked: "xxh64", or "unchecked (why)".
        self.page_checks = page_checks(files.record, files.layout)
        self._held = HeldFd(files.fd, f"disk layer {self.layer_id} ({self.path}): this DiskLayer")
        self.engine = engine
        self.cache = cache
        try:
            self.tag = cache.new_tag(files.layout.row_bytes, self._identity(files.record)) if cache is not None else 0
        except BaseException:
            self._held.close()
            raise
        H = files.layout.num_heads
        self.n_rows = np.asarray(files.layout.sizes, dtype=np.int64)
        self.head_offsets = np.asarray(files.layout.head_offsets, dtype=np.int64)
        self.row_base = np.concatenate(([0], np.cumsum(self.n_rows)[:-1])).astype(np.int64)
        assert self.row_base.size == H, "one row base per head"
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(STAT_FIELDS, 0)
        self._head_misses = np.zeros(H, dtype=np.int64)
        self._head_rows = 0

    def _identity(self, record: dict) -> int:
        """A hash of the published data: the manifest (geometry and every head's checksum) and the data file's
        device, inode, size and modification time. A host cache keys rows by it, so a layer published again under
        the same id never meets the old data's cached rows."""
        st = os.fstat(self._held.fd)
        h = xxhash.xxh3_64(json.dumps(record, sort_keys=True).encode())
        h.update(f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}".encode())
        return h.intdigest() or 1

    @property
    def num_heads(self) -> int:
        return self.layout.num_heads

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes

    def read_rows(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Fill ``out`` (flat, ``M * H * row_bytes`` bytes) with row ``ids[m, h]`` of head ``h`` at byte
        ``(m * H + h) * row_bytes``. ``ids``: C-contiguous int64 ``[M, H]``, each within its head."""
        read_many([(self, ids, out)])

    def stats(self, reset: bool = False) -> dict:
        """Counters since open (or the last reset): ``reads`` (calls), ``rows``, ``pages_read``, ``bytes_read``,
        ``cache_hits`` and ``cache_misses`` (per row looked up), ``direct`` (1 if reads bypass the page cache);
        ``cache_hits_per_head`` and ``cache_misses_per_head``: lists, one count per head."""
        with self._lock:
            snapshot = dict(self._counts)
            misses = self._head_misses.copy()
            head_rows = self._head_rows
            if reset:
                self._counts = dict.fromkeys(STAT_FIELDS, 0)
                self._head_misses[:] = 0
                self._head_rows = 0
        snapshot["direct"] = int(self.direct)
        snapshot["cache_hits_per_head"] = (head_rows - misses).tolist()
        snapshot["cache_misses_per_head"] = misses.tolist()
        return snapshot

    def _count(self, rows: int, hits: int, blocks: int, miss_pos: np.ndarray) -> None:
        H = self.layout.num_heads
        head_misses = np.bincount(miss_pos % H, minlength=H) if miss_pos.size else None
        if self.cache is not None:
            self.cache.count(hits, rows - hits)
        with self._lock:
            if head_misses is not None:
                self._head_misses += head_misses
            self._head_rows += rows // H
            c = self._counts
            c["reads"] += 1
            c["rows"] += rows
            c["cache_hits"] += hits
            c["cache_misses"] += rows - hits
            c["pages_read"] += blocks * (self.layout.block_bytes // PAGE_BYTES)
            c["bytes_read"] += blocks * self.layout.block_bytes

    def enter(self) -> int:
        """The data file's descriptor, held open for a read until :meth:`leave` (TableClosed once closed)."""
        if self._held is None:
            raise TableClosed(f"disk layer {self.layer_id}: this DiskLayer did not open")
        return self._held.enter()

    def leave(self) -> None:
        self._held.leave()

    def close(self) -> None:
        """Close the layer: now, or as the last read running on it ends."""
        if self._held is not None:
            self._held.close()

    def __enter__(self) -> "DiskLayer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DiskLayer({self.layer_id}, {self.num_heads} heads, row_bytes={self.row_bytes}, "
                f"{self.layout.file_bytes} bytes, direct={self.direct})")


STAT_FIELDS = ("reads", "rows", "pages_read", "bytes_read", "cache_hits", "cache_misses")


_EMPTY_META = np.empty(0, dtype=np.int64)
_EMPTY_ROWS = np.empty(0, dtype=np.uint8)
_NO_MISSES = np.empty(0, dtype=np.int64)  # a lookup the cache served whole: its misses and blocks (read-only)
_NO_BLOCKS = np.zeros(1, dtype=np.int64)  # and the starts of its plan of no block
_NO_MISSES.flags.writeable = False
_NO_BLOCKS.flags.writeable = False


def _check_request(index: int, request: Any) -> tuple[DiskLayer, np.ndarray, np.ndarray]:
    where = f"requests[{index}]"
    if not isinstance(request, (tuple, list)) or len(request) != 3:
        raise InvalidArgument(f"{where}: expected a (layer, ids, out) tuple, got {describe(request)}")
    layer, ids, out = request
    if not isinstance(layer, DiskLayer):
        raise InvalidType(f"{where}: expected a DiskLayer first, got {type(layer).__name__}")
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64:
        raise InvalidType(f"ids: expected an int64 array [M, H], got "
                          f"{type(ids).__name__ if not isinstance(ids, np.ndarray) else ids.dtype}")
    if ids.ndim != 2 or ids.shape[1] != layer.num_heads:
        raise InvalidArgument(f"ids: expected shape [M, {layer.num_heads}] (layer {layer.layer_id} has "
                              f"{layer.num_heads} heads), got {ids.shape}")
    if not ids.flags.c_contiguous:
        raise InvalidArgument("ids: expected a C-contiguous array (use np.ascontiguousarray)")
    if not isinstance(out, np.ndarray):
        raise InvalidType(f"out: expected a writable numpy array, got {type(out).__name__}")
    want = ids.size * layer.row_bytes
    if not out.flags.c_contiguous or not out.flags.writeable or out.nbytes != want:
        raise InvalidArgument(f"out: expected a writable C-contiguous buffer of {want} bytes "
                              f"({ids.shape[0]} x {layer.num_heads} rows x {layer.row_bytes} bytes), got shape "
                              f"{out.shape} dtype {out.dtype} ({out.nbytes} bytes, writable={out.flags.writeable}, "
                              f"C-contiguous={out.flags.c_contiguous})")
    return layer, ids, out.reshape(-1).view(np.uint8)


class _Job:
    """One layer's part of a read: what the cache served, and the blocks still to read."""

    def __init__(self, layer: DiskLayer, ids: np.ndarray, out: np.ndarray):
        self.layer, self.ids, self.out = layer, ids, out
        cache = layer.cache
        meta, rows = (cache.meta, cache.rows) if cache is not None else (_EMPTY_META, _EMPTY_ROWS)
        lay = layer.layout
        n = ids.size
        miss_pos, miss_key = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        K = k._serve_hits(ids, layer.n_rows, layer.row_base, layer.tag, meta, rows, lay.row_bytes, out, lay.row_bytes,
                          miss_pos, miss_key)
        if K < 0:
            m, h = divmod(-1 - K, layer.num_heads)
            raise InvalidArgument(f"ids[{m}, {h}] = {int(ids[m, h])} is out of range for head {h} of layer "
                                  f"{layer.layer_id} (expected 0 <= id < {lay.sizes[h]})")
        self.hits = n - K
        if K:
            self.miss_pos, self.miss_key = miss_pos[:K], miss_key[:K]
            self.offsets, self.starts, self.order, self.in_block = k._plan_read(
                ids, self.miss_pos, layer.head_offsets, lay.rows_per_block, lay.block_bytes, lay.row_bytes)
        else:  # every row served by the cache: nothing to plan
            self.miss_pos = self.miss_key = self.offsets = self.order = self.in_block = _NO_MISSES
            self.starts = _NO_BLOCKS
        self.blocks = int(self.offsets.size)


class _Batch:
    """The blocks of several jobs as one read (see ``_kernels``: fds, offsets, lens, starts, dst, src_off,
    row_len), with the status of each block and the job it belongs to."""

    def __init__(self, jobs: list[_Job], fds: list[int]):
        self.jobs = jobs
        parts = []
        rows_before = 0
        for job, fd in zip(jobs, fds):
            lay = job.layer.layout
            P, K = job.blocks, job.order.size
            at = job.out.ctypes.data
            parts.append((np.full(P, fd, dtype=np.int64), job.offsets, np.full(P, lay.block_bytes, dtype=np.int64),
                          job.starts[1:] + rows_before, at + job.miss_pos[job.order] * lay.row_bytes,
                          job.in_block[job.order], np.full(K, lay.row_bytes, dtype=np.int64),
                          np.full(P, lay.summed_bytes, dtype=np.int64)))
            rows_before += K
        cat = [np.concatenate(column) for column in zip(*parts)]
        self.fds, self.offsets, self.lens = cat[0], cat[1], cat[2]
        self.starts = np.concatenate(([0], cat[3])).astype(np.int64)
        self.dst, self.src_off, self.row_len, self.sums = cat[4], cat[5], cat[6], cat[7]
        self.first_block = np.cumsum([0] + [job.blocks for job in jobs])
        self.max_block = max(job.layer.layout.block_bytes for job in jobs)
        self.status = np.full(self.offsets.size, k.NOT_READ, dtype=np.int64)
        self.counter = np.zeros(1, dtype=np.int64)

    def arrays(self) -> tuple:
        return self.fds, self.offsets, self.lens, self.starts, self.dst, self.src_off, self.row_len, self.sums

    def check(self) -> None:
        ok = self.status == self.lens
        if ok.all():
            return
        failed = np.flatnonzero(~ok & (self.status != k.NOT_READ))
        j = int(failed[0]) if failed.size else int(np.flatnonzero(~ok)[0])
        layer = self.jobs[int(np.searchsorted(self.first_block, j, side="right")) - 1].layer
        got, offset, want = int(self.status[j]), int(self.offsets[j]), int(self.lens[j])
        if got == k.NOT_READ:
            raise DiskReadError(f"disk layer {layer.layer_id}: {layer.file}: the block at offset {offset} was not "
                                "read")
        if got == k.BAD_CHECKSUM:
            raise DiskReadError(damaged_block(layer.layer_id, layer.layout, layer.file, offset))
        if got < 0:
            raise DiskReadError(f"disk layer {layer.layer_id}: reading {want} bytes of {layer.file} at offset "
                                f"{offset} failed: {os.strerror(-got)} (errno {-got})")
        raise DiskReadError(f"disk layer {layer.layer_id}: short read of {layer.file} at offset {offset}: got {got} "
                            f"of {want} bytes (the file is shorter than its manifest says: truncated?)")


def damaged_block(layer_id: int, layout: DiskLayout, file: str, offset: int) -> str:
    """What to say of a block that does not match its checksum: the layer, the head (column) and the page."""
    head = int(np.searchsorted(np.asarray(layout.head_offsets), offset, side="right")) - 1
    block = (offset - layout.head_offsets[head]) // layout.block_bytes
    rows = f"rows {block * layout.rows_per_block}-{(block + 1) * layout.rows_per_block - 1}" \
        if layout.rows_per_block > 1 else f"row {block}"
    return (f"disk layer {layer_id}: head {head}, page {block} ({rows}) at offset {offset} of {file} does not match "
            "its checksum: the file was damaged at rest, and none of its rows is served; remove the layer and "
            "populate it again")


def read_many(requests: Sequence[tuple[DiskLayer, np.ndarray, np.ndarray]], engine: IOEngine | None = None) -> None:
    """Serve several ``(layer, ids, out)`` reads at once, as :meth:`DiskLayer.read_rows` would each: every
    request is checked before any read starts, then the blocks of all of them are in flight together.

    ``engine`` overrides the layers' own engines (by default each layer's, else the process's); layers with
    different engines are read one engine after the other."""
    if isinstance(requests, (str, bytes)) or not hasattr(requests, "__len__"):
        raise InvalidType(f"requests: expected a list of (layer, ids, out) tuples, got {type(requests).__name__}")
    if engine is not None and not isinstance(engine, IOEngine):
        raise InvalidType(f"engine: expected an IOEngine or None, got {type(engine).__name__}")
    read_checked([_check_request(i, r) for i, r in enumerate(requests)], engine)


def read_checked(checked: Sequence[tuple[DiskLayer, np.ndarray, np.ndarray]],
                 engine: IOEngine | None = None) -> None:
    """:func:`read_many` of requests already in its form, as an EngramStore's jobs are (C-contiguous int64 ids
    ``[M, H]`` of the layer's ``H`` heads; ``out`` its flat, writable, C-contiguous uint8 bytes, ``M * H *
    row_bytes`` of them): the ids' range is still checked before anything is read."""
    entered: list[DiskLayer] = []
    try:
        fds = []
        for layer, _, _ in checked:  # each layer's file stays open until its read is done, whoever closes it
            fds.append(layer.enter())
            entered.append(layer)
        _read_entered(checked, fds, engine)
    finally:
        for layer in entered:
            layer.leave()


def _read_entered(checked: list[tuple[DiskLayer, np.ndarray, np.ndarray]], fds: list[int],
                  engine: IOEngine | None) -> None:
    """:func:`read_many` of checked requests, each layer's file held open (``fds``)."""
    jobs = [_Job(layer, ids, out) for layer, ids, out in checked]
    groups: dict[tuple[int, bool], tuple[IOEngine, list, list]] = {}
    for job, fd in zip(jobs, fds):
        if job.blocks:
            eng = engine or job.layer.engine or default_engine()
            group = groups.setdefault((id(eng), job.layer.direct), (eng, [], []))
            group[1].append(job)
            group[2].append(fd)
    batches = []
    for (_, direct), (eng, group_jobs, group_fds) in groups.items():
        batch = _Batch(group_jobs, group_fds)
        eng.read(batch, direct)
        batches.append(batch)
    for batch in batches:
        batch.check()
    for job in jobs:
        layer = job.layer
        if layer.cache is not None and job.miss_key.size:
            layer.cache.fill(job.miss_key, job.miss_pos, job.out)
        layer._count(job.ids.size, job.hits, job.blocks, job.miss_pos)
