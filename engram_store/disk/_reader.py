"""Reading rows of published layers: distinct blocks, many reads in flight, a hot-row cache in front.

A read of ``ids [M, H]`` (``DiskLayer.read_rows`` or several layers at once with :func:`read_many`):

1. one kernel pass checks every id, copies the rows the cache holds straight into the output, and turns the
   rest into distinct blocks (rows sharing a page are read once);
2. the blocks are read by the engine's worker threads, each a Numba ``nogil`` loop that claims the next block,
   ``pread``\\ s it into its own page-aligned buffer (O_DIRECT: the page cache neither serves nor keeps it) and
   copies the rows it holds into the output. With ``threads`` workers, that many reads are in flight; every
   layer of a :func:`read_many` is queued at once, so all their blocks share the same queue depth;
3. the rows read are offered to the cache.

A failed read (an I/O error, a file that shrank) raises :class:`DiskReadError` naming the file and offset; no
row is ever left as zeros. The data files are read with ``pread`` only, never mapped, so a truncated file is an
error, not a SIGBUS.
"""
from __future__ import annotations

import errno as _errno
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from .._errors import InvalidArgument, InvalidType, ObjectNotFound, StoreError, describe
from . import _kernels as k
from ._cache import RowCache
from ._files import aligned_empty, open_direct
from ._layout import DATA_FILE, PAGE_BYTES, check_expected, check_layer_id, layer_dir_name, read_manifest

log = logging.getLogger(__name__)

#: Reads in flight per engine. The device here (a virtio SSD) reaches 65k IOPS at 32 and 80k at 64 in flight
#: (fio, psync threads and io_uring alike); see ``bench/bench_disk.py``.
DEFAULT_THREADS = 64
#: A read of at most this many blocks runs in the calling thread (a pool round trip costs more than it saves).
INLINE_BLOCKS = 1


class DiskReadError(StoreError):
    """Reading a layer's file failed: an I/O error, or fewer bytes than the layout promises (a truncated file)."""

    code = "DISK_READ"


class IOEngine:
    """A pool of ``threads`` reader threads shared by every layer that uses it (one per process by default)."""

    def __init__(self, threads: int = DEFAULT_THREADS):
        if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or not 1 <= threads <= 1024:
            raise InvalidArgument(f"threads: expected an int in [1, 1024], got {describe(threads)}")
        self.threads = int(threads)
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(self.threads,
                                                                   thread_name_prefix="engram-disk-io")
        self._local = threading.local()

    def buffer(self, nbytes: int) -> np.ndarray:
        """This thread's page-aligned read buffer of at least ``nbytes``."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < nbytes:
            buf = self._local.buf = aligned_empty(max(nbytes, PAGE_BYTES))
        return buf

    def submit(self, fn, n: int) -> list:
        if self._pool is None:
            raise StoreError("disk: this IOEngine is closed")
        return [self._pool.submit(fn) for _ in range(n)]

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> "IOEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_default_engine: IOEngine | None = None
_default_lock = threading.Lock()


def default_engine() -> IOEngine:
    """The process's shared engine (``DEFAULT_THREADS`` readers), started on first use."""
    global _default_engine
    with _default_lock:
        if _default_engine is None:
            _default_engine = IOEngine()
        return _default_engine


class DiskLayer:
    """A published layer, opened read-only. Thread-safe; a context manager; ``close()`` is idempotent.

    Raises ObjectNotFound if the layer is not published under ``directory``, ConfigError if it was published with
    another ``row_bytes`` or ``sizes`` than the caller's (None accepts what was published), StoreError if its
    files are damaged (a manifest that does not parse, a data file of the wrong size).

    ``cache``: a :class:`RowCache` (possibly shared with other layers) or None. ``engine``: an :class:`IOEngine`,
    by default the process's. ``direct=False`` reads through the page cache; where the file system refuses
    O_DIRECT the layer falls back to that and says so in a warning and in ``direct``.
    """

    def __init__(self, directory: str | os.PathLike, layer_id: int, row_bytes: int | None = None,
                 sizes: Sequence[int] | None = None, *, cache: RowCache | None = None,
                 engine: IOEngine | None = None, direct: bool = True):
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise InvalidArgument(f"directory: expected a directory path, got {describe(directory)}")
        if cache is not None and not isinstance(cache, RowCache):
            raise InvalidType(f"cache: expected a RowCache or None, got {type(cache).__name__}")
        if engine is not None and not isinstance(engine, IOEngine):
            raise InvalidType(f"engine: expected an IOEngine or None, got {type(engine).__name__}")
        self.layer_id = check_layer_id(layer_id)
        self.path = os.path.join(os.path.abspath(os.fspath(directory)), layer_dir_name(self.layer_id))
        self.file = os.path.join(self.path, DATA_FILE)
        self._fd = -1
        if not os.path.isdir(self.path):
            raise ObjectNotFound(f"disk layer {self.layer_id} is not published under {os.fspath(directory)} "
                                 f"(no {self.path})")
        record, layout = read_manifest(self.path)
        if record.get("layer_id") != self.layer_id:
            raise StoreError(f"disk layer: {self.path} holds layer {describe(record.get('layer_id'))}, "
                             f"expected {self.layer_id}")
        check_expected(self.path, layout, row_bytes, sizes)
        self.layout = layout
        self.checksums: tuple[str, ...] = tuple(record["checksum"]["heads"])
        try:
            self._fd, self.direct = open_direct(self.file, os.O_RDONLY, direct=direct)
            size = os.fstat(self._fd).st_size
        except OSError as exc:
            self.close()
            raise StoreError(f"disk layer {self.layer_id}: cannot open {self.file}: {exc.strerror}") from None
        if size != layout.file_bytes:
            self.close()
            raise DiskReadError(f"disk layer {self.layer_id}: {self.file} holds {size} bytes, the manifest "
                                f"promises {layout.file_bytes} (truncated or replaced)")
        if self.direct and not self._direct_read_works():
            os.close(self._fd)
            self._fd, self.direct = open_direct(self.file, os.O_RDONLY, direct=False)
        self.engine = engine
        self.cache = cache
        self.tag = cache.new_tag(layout.row_bytes) if cache is not None else 0
        H = layout.num_heads
        self.n_rows = np.asarray(layout.sizes, dtype=np.int64)
        self.head_offsets = np.asarray(layout.head_offsets, dtype=np.int64)
        self.row_base = np.concatenate(([0], np.cumsum(self.n_rows)[:-1])).astype(np.int64)
        assert self.row_base.size == H, "one row base per head"
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(STAT_FIELDS, 0)

    def _direct_read_works(self) -> bool:
        """Some file systems accept O_DIRECT at open and refuse the reads (EINVAL): try one block."""
        buf = aligned_empty(self.layout.block_bytes)
        try:
            os.preadv(self._fd, [memoryview(buf)], 0)
            return True
        except OSError as exc:
            if exc.errno != _errno.EINVAL:
                raise DiskReadError(f"disk layer {self.layer_id}: reading {self.file} at offset 0 failed: "
                                    f"{exc.strerror}") from None
            log.warning("%s: O_DIRECT reads refused (EINVAL); reading through the page cache", self.file)
            return False

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
        ``cache_hits`` and ``cache_misses`` (per row looked up), ``direct`` (1 if reads bypass the page cache)."""
        with self._lock:
            snapshot = dict(self._counts)
            if reset:
                self._counts = dict.fromkeys(STAT_FIELDS, 0)
        snapshot["direct"] = int(self.direct)
        return snapshot

    def _count(self, rows: int, hits: int, blocks: int) -> None:
        with self._lock:
            c = self._counts
            c["reads"] += 1
            c["rows"] += rows
            c["cache_hits"] += hits
            c["cache_misses"] += rows - hits
            c["pages_read"] += blocks * (self.layout.block_bytes // PAGE_BYTES)
            c["bytes_read"] += blocks * self.layout.block_bytes

    def _fileno(self) -> int:
        if self._fd < 0:
            raise StoreError(f"disk layer {self.layer_id}: this DiskLayer is closed")
        return self._fd

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> "DiskLayer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"DiskLayer({self.layer_id}, {self.num_heads} heads, row_bytes={self.row_bytes}, "
                f"{self.layout.file_bytes} bytes, direct={self.direct})")


STAT_FIELDS = ("reads", "rows", "pages_read", "bytes_read", "cache_hits", "cache_misses")

_EMPTY_META = np.empty(0, dtype=np.int64)
_EMPTY_ROWS = np.empty(0, dtype=np.uint8)


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
    """One layer's part of a read: its plan, its blocks, and the status of each block read."""

    def __init__(self, layer: DiskLayer, ids: np.ndarray, out: np.ndarray):
        self.layer, self.ids, self.out = layer, ids, out
        cache = layer.cache
        meta, rows = (cache.meta, cache.rows) if cache is not None else (_EMPTY_META, _EMPTY_ROWS)
        lay = layer.layout
        (bad, hits, self.miss_pos, self.miss_key, self.offsets, self.starts, self.order,
         self.in_block) = k._plan_read(ids, layer.n_rows, layer.head_offsets, layer.row_base, lay.rows_per_block,
                                       lay.block_bytes, lay.row_bytes, layer.tag, meta, rows, lay.row_bytes, out)
        if bad >= 0:
            m, h = divmod(int(bad), layer.num_heads)
            raise InvalidArgument(f"ids[{m}, {h}] = {int(ids[m, h])} is out of range for head {h} of layer "
                                  f"{layer.layer_id} (expected 0 <= id < {lay.sizes[h]})")
        self.hits = int(hits)
        self.blocks = int(self.offsets.size)
        self.status = np.full(self.blocks, k.NOT_READ, dtype=np.int64)
        self.counter = np.zeros(1, dtype=np.int64)

    def run(self, engine: IOEngine, fd: int) -> int:
        lay = self.layer.layout
        return int(k._read_blocks(fd, self.offsets, self.starts, self.order, self.miss_pos, self.in_block,
                                  lay.row_bytes, lay.block_bytes, self.out, engine.buffer(lay.block_bytes),
                                  self.counter, self.status))

    def check(self) -> None:
        lay = self.layer.layout
        failed = np.flatnonzero((self.status != lay.block_bytes) & (self.status != k.NOT_READ))
        if failed.size == 0 and np.all(self.status == lay.block_bytes):
            return
        layer = self.layer
        if failed.size == 0:
            raise DiskReadError(f"disk layer {layer.layer_id}: {layer.file}: some blocks were not read")
        j = int(failed[0])
        got, offset = int(self.status[j]), int(self.offsets[j])
        if got < 0:
            raise DiskReadError(f"disk layer {layer.layer_id}: reading {lay.block_bytes} bytes of {layer.file} at "
                                f"offset {offset} failed: {os.strerror(-got)} (errno {-got})")
        raise DiskReadError(f"disk layer {layer.layer_id}: short read of {layer.file} at offset {offset}: got {got} "
                            f"of {lay.block_bytes} bytes (the file is shorter than its manifest says: truncated?)")


def read_many(requests: Sequence[tuple[DiskLayer, np.ndarray, np.ndarray]], engine: IOEngine | None = None) -> None:
    """Serve several ``(layer, ids, out)`` reads at once, as :meth:`DiskLayer.read_rows` would each: every
    request is checked before any read starts, then the blocks of all of them are in flight together.

    ``engine`` overrides the layers' own engines (by default each layer's, else the process's)."""
    if isinstance(requests, (str, bytes)) or not hasattr(requests, "__len__"):
        raise InvalidType(f"requests: expected a list of (layer, ids, out) tuples, got {type(requests).__name__}")
    if engine is not None and not isinstance(engine, IOEngine):
        raise InvalidType(f"engine: expected an IOEngine or None, got {type(engine).__name__}")
    checked = [_check_request(i, r) for i, r in enumerate(requests)]
    fds = [layer._fileno() for layer, _, _ in checked]
    jobs = [_Job(layer, ids, out) for layer, ids, out in checked]
    futures = []
    inline = []
    for job, fd in zip(jobs, fds):
        if job.blocks == 0:
            continue
        if job.blocks <= INLINE_BLOCKS:
            inline.append((job, fd))
            continue
        eng = engine or job.layer.engine or default_engine()
        workers = min(eng.threads, job.blocks)
        futures.extend(eng.submit(lambda job=job, eng=eng, fd=fd: job.run(eng, fd), workers))
    for job, fd in inline:
        job.run(engine or job.layer.engine or default_engine(), fd)
    errors = []
    for f in futures:
        try:
            f.result()
        except BaseException as exc:  # a kernel never raises; keep the first error after all workers are done
            errors.append(exc)
    if errors:
        raise errors[0]
    for job in jobs:
        job.check()
    for job in jobs:
        layer = job.layer
        if layer.cache is not None and job.miss_key.size:
            layer.cache.fill(job.miss_key, job.miss_pos, job.out)
        layer._count(job.ids.size, job.hits, job.blocks)
