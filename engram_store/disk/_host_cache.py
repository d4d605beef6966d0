"""One hot-row cache per host: :class:`RowCache`'s sets in shared memory, for every process that reads the same
layers.

A serving host runs a worker process per GPU; each reading the same SSD layers behind a cache of its own keeps
the same hot rows N times. Processes that open ``HostRowCache(capacity_bytes, row_bytes, scope=...)`` with the
same scope (``EngramStore`` passes its ``disk_dir``) and row size map one file in the user's own directory under
``/dev/shm`` (``ENGRAM_SHM_DIR`` overrides ``/dev/shm``)::

    engram-<uid>/                             mode 0700, this user's alone (see ``engram_store._shared_dirs``)
    engram-<uid>/engram-rowcache-<hash>       header page | set metadata | CLOCK hands | doorkeeper bits | curve | rows
    engram-<uid>/engram-rowcache-<hash>.lock  flock'd by the one process filling the cache (or attaching, or leaving)

Why it is correct, in the simplest design that is:

* **No other user shares it**: the name is predictable, so it lives in a directory only this user may enter, opened
  once and checked with ``fstat``; each file is created exclusively (``O_EXCL``, never through a link) or, when it
  is there, used only if ``fstat`` shows it is this user's own. Another user can neither take the name first, nor
  read the rows, nor hold the lock. Processes of different users keep caches of their own.
* **No silent second cache**: the file is named by the scope and the row size only. A process that asks for
  another capacity or admission than the cache already there attaches to that one, as it is, and says so in a
  warning naming both sizes: a second cache would hold the same hot rows again (a worker restarted with another
  ``row_cache_bytes`` doubled the memory without a word), and refusing would stop a worker from serving over a
  number it can be told about. Every process attached must leave for a new size to take effect.
* **Lookups take no lock**, as in a process's cache: a set is read as a sequence lock (version, keys and row,
  version again) and a row counts as a hit only if the version did not move and no writer was busy in the set.
  Shared memory changes nothing in that argument.
* **Fills between processes** are serialised by ``flock`` on the lock file (and by a thread lock inside each
  process: a flock is per open file, so two threads of one process would both hold it). A fill that cannot
  take it within ``fill_wait_ms`` is skipped and counted (``fills_skipped``): the rows were read and are
  returned; they are only not cached this time. A stopped process holding the lock never blocks another's
  lookups; what must take it (attaching, tags, pins) waits at most ``lock_timeout_ms`` and then raises
  ``LockTimeout`` naming the lock file.
* **A writer killed mid-fill** releases the flock (the kernel drops it with the process). Before changing a set
  a writer writes the set's index to the header's journal word and clears it when the set is readable again,
  so the next process to take the lock finds at most one unfinished set there: it empties that set and moves
  its version on (``_cache_kernels._cache_repair``; counted in ``repairs``). Until then the set's version is
  busy, so readers miss it and never take its half-written row.
* **Keys name the data, not only the layer id**: a layer's tag comes from a registry in the header, keyed by a
  hash of its manifest (sizes, row size, xxh3 of every head) and of its data file's device, inode, size and
  modification time. Every process that opens the same published file gets the same tag; a layer removed and
  published again under the same id gets a new one, so its rows never meet the old data's. Tags are never reused.
* **Memory goes with the last process**: every attached process holds a shared flock on the data file; one that
  closes (or exits) takes the lock file, and if no other process holds the data file, deletes both files. A
  process that died without closing leaves them to the next one: a cache file nobody holds is initialised
  afresh when it is attached again, and any ``engram-rowcache-*`` file nobody holds is deleted when a cache is
  attached in the same directory.
* **Leaving never waits on its own thread** (``_host_files``): a cache dropped without ``close()`` leaves from its
  finalizer, which the garbage collector may run at any point of any thread, also where that thread holds the lock
  of another cache of this process on the same file (a flock is per open file: its own second open would wait for
  it in vain). A finalizer that finds its thread holding a host cache's lock puts the leaving off until the thread
  lets its last one go. Nothing engram makes refers to a cache through a cycle, so a dropped cache leaves where it
  is dropped; a constructor that fails leaves what it attached before it raises.

The header's counters (hits, misses, fills, inserted, skipped fills, repairs, attaches) are updated with atomic
adds by every process and reported by :meth:`stats`.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import signal
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import xxhash

from .. import _fork
from ..errors import EngramError, InvalidArgument, OutOfSpace, StoreError, TableClosed, describe
from ..pages import map_file, prefault_huge, write_zeros
from .._shared_dirs import UserDir, directory_error, shared_base
from . import _cache_kernels as ck
from . import _kernels as k
from ._cache import ADMISSIONS, LINE_BYTES, RowCache, door_words
from ._host_files import CacheFiles, detach, nobody_holds, sweep
from ._host_mrc import REGION_BYTES as CURVE_BYTES
from ._layout import PAGE_BYTES

log = logging.getLogger(__name__)

PREFIX = "engram-rowcache-"
ADMISSION_NAMES = {code: name for name, code in ADMISSIONS.items()}
MAGIC = 0x454E4752414D5243  # "ENGRAMRC"
LAYOUT_VERSION = 2
#: Header words (int64): the file's geometry, the journal, the tag counter, shared counters, the tag registry.
H_MAGIC, H_LAYOUT, H_SETS, H_ROW_BYTES, H_DOOR_WORDS, H_CAPACITY, H_ADMISSION = 0, 1, 2, 3, 4, 5, 6
H_JOURNAL, H_NEXT_TAG, H_DOOR_STATE = 8, 9, 10    # H_DOOR_STATE: 2 words
H_COUNTERS = 16
COUNTERS = ("hits", "misses", "fills", "inserted", "fills_skipped", "repairs", "attaches")
H_REGISTRY = 64                                   # (identity, tag) pairs up to the end of the header
HEADER_WORDS = 2 * PAGE_BYTES // 8
REGISTRY_ENTRIES = (HEADER_WORDS - H_REGISTRY) // 2
#: How long a fill waits for another process's fill before it skips caching its rows.
DEFAULT_FILL_WAIT_MS = 20.0
#: How long attaching, detaching, a new tag or a pin waits for the lock before it raises LockTimeout (a pin of a
#: large profile holds it for a while; a fill for microseconds).
DEFAULT_LOCK_TIMEOUT_MS = 30_000.0
#: What to do when the directory of the shared-memory files will not do.
_HINT = "set ENGRAM_SHM_DIR to a directory this user may write, with room"
#: Test hook: the fill of this process stops half-way through its N-th insertion and the process kills itself.
DIE_MID_FILL_ENV = "ENGRAM_TEST_DIE_MID_FILL"


def shm_dir() -> str:
    return shared_base()


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


class HostRowCache(RowCache):
    """A :class:`RowCache` in shared memory that every process of the host attaching with the same ``scope`` and
    ``row_bytes`` shares (see the module docstring: one asking for another ``capacity_bytes`` or ``admission``
    attaches to the cache there, with a warning). A context manager;
    ``close()`` detaches (and deletes the files when this was the last process); it is also called at exit.

    ``scope``: a string naming what the cache holds (EngramStore passes the ``disk_dir`` path). ``admission``
    defaults to ``"always"`` (measured best on real n-gram traffic, ``bench/bench_cache_policy.py``).
    ``directory``: where this user's directory of shared files is made (default ``ENGRAM_SHM_DIR`` or
    ``/dev/shm``). ``lock_timeout_ms``: the longest wait for the lock before LockTimeout (fills wait
    ``fill_wait_ms`` and skip).
    """

    def __init__(self, capacity_bytes: int, row_bytes: int, *, scope: str, admission: str = "always",
                 directory: str | None = None, fill_wait_ms: float = DEFAULT_FILL_WAIT_MS,
                 lock_timeout_ms: float = DEFAULT_LOCK_TIMEOUT_MS):
        if not isinstance(scope, str) or not scope:
            raise InvalidArgument(f"scope: expected a non-empty string, got {describe(scope)}")
        for flag, value in (("fill_wait_ms", fill_wait_ms), ("lock_timeout_ms", lock_timeout_ms)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise InvalidArgument(f"{flag}: expected a number >= 0, got {describe(value)}")
        self.directory = os.path.abspath(directory or shm_dir())
        self.scope = scope
        self.fill_wait_s = float(fill_wait_ms) / 1e3
        self.lock_timeout_s = float(lock_timeout_ms) / 1e3
        self._capacity_bytes = int(capacity_bytes) if isinstance(capacity_bytes, (int, np.integer)) else 0
        self._mm: mmap.mmap | None = None
        self._files: CacheFiles | None = None
        self._closed = False
        source = "directory=" if directory else "ENGRAM_SHM_DIR" if os.environ.get("ENGRAM_SHM_DIR") else "the default"
        self._where = f"host row cache: {self.directory} ({source}: where it keeps its shared-memory files)"
        try:
            super().__init__(capacity_bytes, row_bytes, admission)
        except OSError as exc:
            raise directory_error(exc, self._where, _HINT) from exc
        # From here it is attached: leaving is the finalizer's (at close, when dropped, at exit), which refers to
        # the files and the mapping, never to the cache (or the cache would never be dropped).
        self._finalizer = weakref.finalize(self, detach, self._files, self._mm, self.lock_timeout_s)
        die_at = os.environ.get(DIE_MID_FILL_ENV)
        self.stop_at = int(die_at) if die_at else -1
        _fork.in_child(self._forked)

    def _forked(self) -> None:
        """In a forked child: the flocks the parent holds belong to open file descriptions the child shares, so the
        child locks and unlocks nothing through them (that would take or drop the parent's locks): it closes its
        copies of the descriptors and attaches with descriptions of its own, as a process of its own."""
        self.lock, self._tag_lock = threading.Lock(), threading.Lock()
        files = self._files
        if files is None or self._closed:
            return
        for fd in (files.lock_fd, files.data_fd):
            if fd >= 0:
                os.close(fd)  # the description (and the parent's flock on it) lives on in the parent
        files.lock_fd = files.data_fd = -1
        try:
            fd, _ = files.dir.open(files.name, os.O_RDWR, create=False)
        except (OSError, EngramError):
            return  # the parent's last user deleted it: the child reads its mapping, attached to nothing
        if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) != self._file_id:
            os.close(fd)
            return
        fcntl.flock(fd, fcntl.LOCK_SH)
        files.data_fd = fd

    # ---- the shared file -------------------------------------------------------------------------------

    def _layout(self) -> dict[str, tuple[int, int]]:
        """Byte offset and size of each region of the file."""
        regions, at = {}, 0
        for name, nbytes, align in (("header", HEADER_WORDS * 8, PAGE_BYTES),
                                    ("meta", self.n_sets * k.META_WORDS * 8, PAGE_BYTES),
                                    ("hands", self.n_sets, LINE_BYTES),
                                    ("door", door_words(self.n_sets) * 8, LINE_BYTES),
                                    ("curve", CURVE_BYTES, PAGE_BYTES),
                                    ("rows", self.n_sets * k.WAYS * self.row_bytes, PAGE_BYTES)):
            at = _align(at, align)
            regions[name] = (at, nbytes)
            at += nbytes
        regions["file"] = (0, _align(at, PAGE_BYTES))
        return regions

    @property
    def name(self) -> str:
        key = f"{self.scope}\0{self.row_bytes}\0{LAYOUT_VERSION}"  # not the size: one cache per scope and row size
        return PREFIX + xxhash.xxh3_64_hexdigest(key.encode())

    @property
    def path(self) -> str:
        return os.path.join(self.directory, f"engram-{os.geteuid()}", self.name)

    def _alloc(self) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise directory_error(exc, self._where, _HINT) from None
        own = UserDir(self.directory, self._where, _HINT)
        regions = self._layout()
        size = regions["file"][1]
        files = self._files = CacheFiles(own, self.name)
        try:
            sweep(own, PREFIX, keep=self.name)
            files.lock_or_raise(self.lock_timeout_s, "attaching")
            try:
                files.data_fd, _ = own.open(self.name, os.O_RDWR)
                fresh = nobody_holds(files.data_fd)  # no live process has it: (re)initialise it
                if not fresh and self._adopt(files.data_fd):  # another size or admission asked: the one there
                    regions = self._layout()
                    size = regions["file"][1]
                if not fresh and os.fstat(files.data_fd).st_size != size:
                    raise StoreError(f"host row cache {files.data_path}: the file in use holds "
                                     f"{os.fstat(files.data_fd).st_size} bytes, expected {size}")
                if fresh:
                    self._initialise(files.data_fd, size)
                fcntl.flock(files.data_fd, fcntl.LOCK_SH)  # we are attached from here (converts an exclusive)
                st = os.fstat(files.data_fd)
                self._file_id = (st.st_dev, st.st_ino)
                self._map(files.data_fd, size, regions, fresh)
                ck._counter_add(self.counters, COUNTERS.index("attaches"), 1)
            finally:
                files.unlock()
        except BaseException:
            files.close()
            own.close()
            raise

    def _adopt(self, fd: int) -> bool:
        """Take the geometry of the cache other processes hold (its sets, capacity and admission) where this
        process asked for another, with a warning naming both; whether it changed."""
        header = np.frombuffer(os.pread(fd, HEADER_WORDS * 8, 0), dtype=np.int64)
        if header.size < HEADER_WORDS or header[H_MAGIC] != MAGIC or header[H_LAYOUT] != LAYOUT_VERSION \
                or header[H_ROW_BYTES] != self.row_bytes:
            return False  # not a cache of this layout: _map refuses it, naming what it found
        theirs = (int(header[H_CAPACITY]), ADMISSION_NAMES.get(int(header[H_ADMISSION]), "?"))
        if theirs == (self._capacity_bytes, self.admission):
            return False
        log.warning("host row cache for %s (rows of %d B): asked for row_cache_bytes=%d (admission %s), attached to "
                    "the cache other processes use, of %d bytes (admission %s): one cache per disk_dir and row "
                    "size; to change its size, restart every process with the same row_cache_bytes (%s)",
                    self.scope, self.row_bytes, self._capacity_bytes, self.admission, theirs[0], theirs[1],
                    self.path)
        self._capacity_bytes, self.admission = theirs
        self.n_sets = int(header[H_SETS])
        return True

    def _initialise(self, fd: int, size: int) -> None:
        os.ftruncate(fd, 0)  # a dead process's leftover: drop its pages
        try:
            os.posix_fallocate(fd, 0, size)  # the memory is there now, or this fails here (not SIGBUS later)
            write_zeros(fd, size)  # written pages: collapsed into 2 MiB ones 12x faster than reserved ones (_map)
        except OSError as exc:
            os.ftruncate(fd, 0)
            raise OutOfSpace(f"row_cache_bytes: a host row cache of {size} bytes does not fit in "
                             f"{self.directory} ({exc.strerror}); free memory there or use a smaller cache"
                             ) from None

    def _map(self, fd: int, size: int, regions: dict, fresh: bool) -> None:
        mm, offset = map_file(fd, size, writable=True)  # at a 2 MiB boundary: each 2 MiB can be one huge page
        self._mm = mm
        buf = np.frombuffer(mm, dtype=np.uint8, count=size, offset=offset)
        # 2 MiB pages: a probe's random sets and rows then miss the TLB less (a decode step's rows all cached: 0.91-0.96x
        # the time in 4 KiB pages, two runs each). A fresh file's pages are collapsed into them whatever the host's
        # shmem policy (see engram_store.pages), before anything maps them in; a file other processes made was
        # collapsed by the first of them. The pages are mapped in now, not at the first lookups.
        prefault_huge(buf.ctypes.data, size, f"host row cache {self.path}", collapse_first=fresh)

        def region(name, dtype):
            at, nbytes = regions[name]
            return buf[at:at + nbytes].view(dtype)

        header = region("header", np.int64)
        self.meta = region("meta", np.int64)
        self.hands = region("hands", np.uint8)
        self.door = region("door", np.uint64)
        self.rows = region("rows", np.uint8)
        self.curve_region = region("curve", np.uint8)  # the host's hit rate at every size (_host_mrc)
        self.door_state = header[H_DOOR_STATE:H_DOOR_STATE + 2]
        self.journal = header[H_JOURNAL:H_JOURNAL + 1]
        self.counters = header[H_COUNTERS:H_COUNTERS + len(COUNTERS)]
        self._header = header
        geometry = [LAYOUT_VERSION, self.n_sets, self.row_bytes, self.door.size, self._capacity_bytes,
                    ADMISSIONS[self.admission]]
        if fresh:
            self.meta[:] = -1
            self.meta[::k.META_WORDS] = 0
            header[H_JOURNAL] = -1
            header[H_NEXT_TAG] = 1
            self.door_state[1] = self.capacity_rows
            header[H_LAYOUT:H_ADMISSION + 1] = geometry
            header[H_MAGIC] = MAGIC  # last: a file without it was never fully initialised
        elif header[H_MAGIC] != MAGIC or header[H_LAYOUT:H_ADMISSION + 1].tolist() != geometry:
            raise StoreError(f"host row cache {self.path}: the file in use has another layout "
                             f"({header[H_LAYOUT:H_ADMISSION + 1].tolist()}, expected {geometry})")

    # ---- tags, fills, counters -------------------------------------------------------------------------

    def new_tag(self, row_bytes: int, identity: int = 0) -> int:
        """The tag of the published data ``identity`` names (see the module docstring): the one every process
        of the host uses for it, or a new one. ``identity`` 0 always gets a new tag."""
        self._check_row_bytes(row_bytes)
        identity = int(identity) & 0x7FFF_FFFF_FFFF_FFFF
        with self.lock:
            self._check_open("a layer's tag")
            self._files.lock_or_raise(self.lock_timeout_s, "a layer's tag")
            try:
                reg = self._header[H_REGISTRY:H_REGISTRY + 2 * REGISTRY_ENTRIES].reshape(-1, 2)
                if identity:
                    found = np.flatnonzero(reg[:, 0] == identity)
                    if found.size:
                        return int(reg[found[0], 1])
                tag = int(self._header[H_NEXT_TAG])
                if tag > k.MAX_TAG:
                    raise StoreError(f"host row cache {self.path}: all {k.MAX_TAG} layer tags are used; delete the "
                                     "file when no process uses it")
                self._header[H_NEXT_TAG] = tag + 1
                free = np.flatnonzero(reg[:, 0] == 0)
                if identity and free.size:  # a full registry only stops sharing new layers' rows
                    reg[free[0]] = (identity, tag)
                return tag
            finally:
                self._files.unlock()

    def _check_open(self, what: str) -> None:
        """Under ``self.lock``: TableClosed once closed (its files are no longer this cache's to lock)."""
        if self._closed:
            raise TableClosed(f"host row cache {self.path}: {what}: the cache is closed")

    def fill(self, miss_key: np.ndarray, miss_pos: np.ndarray, out: np.ndarray) -> int:
        with self.lock:
            if self._closed:
                return 0  # a read that ran into the close: its rows are served, only not cached
            if not self._files.lock(self.fill_wait_s):
                ck._counter_add(self.counters, COUNTERS.index("fills_skipped"), 1)
                return 0
            try:
                self._repair()
                n = self._fill_locked(miss_key, miss_pos, out)
                if n < 0:  # the test hook: die here, holding the lock, the set half-written
                    os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(60)
            finally:
                self._files.unlock()
        ck._counter_add(self.counters, COUNTERS.index("fills"), 1)
        ck._counter_add(self.counters, COUNTERS.index("inserted"), n)
        return n

    @contextmanager
    def locked(self, timeout_s: float) -> Iterator[bool]:
        """Hold the cache's locks (this process's and the host's) to change shared state other than rows (the
        curve of ``_host_mrc``); yields whether they were taken within ``timeout_s``."""
        with self.lock:
            if self._closed or not self._files.lock(timeout_s):
                yield False
                return
            try:
                yield True
            finally:
                self._files.unlock()

    def _pin_locked(self, keys: np.ndarray, rows: np.ndarray, max_ways: int) -> int:
        self._check_open("pinning rows")
        self._files.lock_or_raise(self.lock_timeout_s, "pinning rows")
        try:
            self._repair()
            return super()._pin_locked(keys, rows, max_ways)
        finally:
            self._files.unlock()

    def _repair(self) -> None:
        """Under the lock: empty the set a writer that died left unfinished (see the module docstring)."""
        s = int(self.journal[0])
        if s >= 0:
            log.warning("host row cache %s: a process died filling set %d; emptying it", self.path, s)
            ck._cache_repair(self.meta, s)
            self.journal[0] = -1
            ck._counter_add(self.counters, COUNTERS.index("repairs"), 1)

    def count(self, hits: int, misses: int) -> None:
        ck._count_lookup(self.counters, hits, misses)

    def stats(self) -> dict[str, int]:
        """The shared cache's counters since it was created (all processes together) and its state."""
        out = {name: int(v) for name, v in zip(COUNTERS, self.counters)}
        out.update(super().stats())
        out["bytes"] = int(self._layout()["file"][1])
        return out

    def clear(self) -> None:
        with self.lock:
            self._check_open("clearing")
            self._files.lock_or_raise(self.lock_timeout_s, "clearing")
            try:
                meta = self.meta.reshape(-1, k.META_WORDS)
                meta[:, 0] += k.BUSY
                meta[:, 1:] = -1
                meta[:, 0] = (meta[:, 0] + k.BUSY) & ~(k.REF_MASK | k.PIN_MASK)
                self.door[:] = 0
                self.door_state[0] = 0
            finally:
                self._files.unlock()

    def close(self) -> None:
        """Detach; the last process attached deletes the files. Idempotent."""
        with self.lock:  # no fill, tag or pin is using the files now, and none will
            if self._closed:
                return
            self._closed = True
        self._finalizer()

    def __enter__(self) -> "HostRowCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"HostRowCache({self.capacity_rows} rows of {self.row_bytes} B, {self.nbytes / 2**20:.1f} MiB, "
                f"admission={self.admission!r}, {self.path})")
