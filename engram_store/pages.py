"""Pages of files and mappings: reserving a file's blocks up front, and huge pages and prefaulting through
``madvise(2)``.

Segments (their shared memory) and ``local_dir`` layers (their mapped head files) both ask for 2 MiB pages
where the OS allows them and map their pages in ahead of the first reads, in pieces, from a background
thread. ``madvise`` goes through ctypes, which releases the GIL for the call (Python's ``mmap.madvise`` does
not), so prefaulting gigabytes does not stall the threads serving reads.

Huge pages in shared memory, whatever the host's policy: a random row read from a table of gigabytes misses the
TLB, and with 4 KiB pages each row costs a page walk of its own (two levels of them in a virtual machine). The
kernel's policy for shared memory (``shmem_enabled``) is ``never`` on most hosts, and ``/dev/shm`` is mounted
without ``huge=``, so files there get 4 KiB pages. ``MADV_COLLAPSE`` (Linux 6.1) ignores that policy: asked of a
mapping of a file's pages, it moves each 2 MiB of them into one huge page, in the file itself, for every process
that maps it. It needs the mapping's address to agree with the file's offset modulo 2 MiB, which Python's
``mmap`` does not arrange: :func:`map_file` does. :func:`collapse` is the ask; where the kernel cannot (older than
6.1, a policy of ``deny``, no 2 MiB of free memory in one piece, a file system that is not memory) it changes
nothing and the pages stay as they were: the same bytes, read a little slower.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import shutil
import threading

import numpy as np

from .errors import OutOfSpace

log = logging.getLogger(__name__)

# madvise(2) advice values (Linux): MADV_POPULATE_READ needs 5.14; MADV_HUGEPAGE asks for 2 MiB pages where the
# policy allows them; MADV_COLLAPSE (6.1) makes them now, whatever the policy (see the module docstring).
MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22
MADV_COLLAPSE = 25
#: The size of a huge page (x86-64's and arm64's with 4 KiB base pages): what mappings are aligned to.
HUGE_PAGE_BYTES = 2 << 20
#: Prefaulting maps this much per madvise call (and checks whether to stop in between).
PREFAULT_CHUNK_BYTES = 64 << 20

_c_functions: dict = {}


def _c_function(name: str, argtypes: list, restype: type) -> object | None:
    """The C library's function ``name`` with its signature (errno kept for ``ctypes.get_errno``), loaded once; None
    where there is none (not Linux/glibc): each caller goes on without it. One private function object per name, so
    no caller sees another's signature."""
    if name not in _c_functions:
        try:
            fn = ctypes.CDLL(None, use_errno=True)[name]  # (indexing makes a function object of its own)
            fn.argtypes, fn.restype = argtypes, restype
        except (OSError, AttributeError):
            fn = None
        _c_functions[name] = fn
    return _c_functions[name]


def madvise(address: int, length: int, advice: int) -> int:
    """``madvise(2)`` of ``length`` bytes from ``address`` (widened to whole pages): 0, or the errno
    (ENOSYS where libc cannot be loaded, e.g. not Linux/glibc; everything still works without advice)."""
    fn = _c_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)
    if fn is None:
        return errno.ENOSYS
    if length <= 0:
        return 0
    start = address - address % mmap.PAGESIZE
    if fn(start, length + (address - start), advice) == 0:
        return 0
    return ctypes.get_errno() or errno.EINVAL


def prefault(address: int, length: int, stop: threading.Event | None = None, *, name: str = "mapping",
             chunk_bytes: int = PREFAULT_CHUNK_BYTES) -> int:
    """Map every page of ``length`` bytes from ``address`` into this process (MADV_POPULATE_READ), chunk by
    chunk, until done or ``stop`` is set; returns the bytes prefaulted. Kernels before 5.14 lack the advice:
    nothing happens."""
    done = 0
    while done < length and not (stop is not None and stop.is_set()):
        n = min(chunk_bytes, length - done)
        err = madvise(address + done, n, MADV_POPULATE_READ)
        if err:
            log.debug("%s: prefault stopped at %d bytes: %s", name, done, os.strerror(err))
            break
        done += n
    return done


def map_file(fd: int, size: int, writable: bool = False) -> tuple[mmap.mmap, int]:
    """``size`` bytes of the file ``fd`` mapped shared (read-only unless ``writable``) at an address that is a
    multiple of :data:`HUGE_PAGE_BYTES`, so that each 2 MiB of the file can be one huge page in the mapping.

    Returns ``(owner, offset)``: the file's bytes are ``owner[offset:offset + size]``. ``owner`` spans the mapping
    and the slack around it (an anonymous reservation that is never touched), and unmaps all of it when closed, as
    any ``mmap`` does: ``close`` raises BufferError while a view of it lives. Where the mapping cannot be placed
    (no libc to call), a plain ``mmap`` of the file is returned at offset 0.
    """
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    if size < HUGE_PAGE_BYTES or _place() is None:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, prot), 0
    owner = mmap.mmap(-1, size + HUGE_PAGE_BYTES, mmap.MAP_PRIVATE, prot)  # the address range, reserved
    try:
        base = np.frombuffer(owner, dtype=np.uint8, count=1).ctypes.data  # (a read-only mmap: no ctypes buffer)
        offset = -base % HUGE_PAGE_BYTES
        placed = _place()(base + offset, size, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if placed != base + offset:
            raise OSError(ctypes.get_errno(), f"mmap: {os.strerror(ctypes.get_errno())}")
    except BaseException:
        owner.close()
        raise
    return owner, offset


def collapse(address: int, length: int, name: str = "mapping", stop: threading.Event | None = None,
             chunk_bytes: int = PREFAULT_CHUNK_BYTES) -> int:
    """Move the pages of ``length`` bytes of a shared mapping from ``address`` into 2 MiB pages now
    (``MADV_COLLAPSE``; see the module docstring), chunk by chunk, until done or ``stop`` is set. Returns the
    bytes collapsed; a kernel that cannot collapse them leaves them as they are (logged at debug level; a chunk
    with a busy page is passed over), and only whole 2 MiB pages of the file whose address agrees with their offset
    are collapsed (see :func:`map_file`). The pages must be there (written or reserved with ``fallocate``): holes
    are left as holes."""
    done = 0
    start = address + (-address % HUGE_PAGE_BYTES)
    end = address + length - (address + length) % HUGE_PAGE_BYTES
    at = start
    while at < end and not (stop is not None and stop.is_set()):
        n = min(chunk_bytes, end - at)
        err = madvise(at, n, MADV_COLLAPSE)
        if err == 0:
            done += n
        elif err != errno.EAGAIN:  # EAGAIN: a page was busy, the next chunk may do; anything else stops
            log.debug("%s: pages not collapsed into huge pages from byte %d on: %s", name, at - address,
                      os.strerror(err))
            break
        at += n
    return done


def prefault_huge(address: int, length: int, name: str, collapse_first: bool = True) -> None:
    """:func:`prefault` ``length`` bytes of a shared mapping from ``address`` in 2 MiB pages: asked for where the
    host's policy allows them (MADV_HUGEPAGE), and first collapsed where it does not (:func:`collapse`; before the
    prefault, as pages this process maps in collapse slower) unless ``collapse_first`` is False."""
    madvise(address, length, MADV_HUGEPAGE)
    if collapse_first:
        collapse(address, length, name)
    prefault(address, length, name=name)


def collapse_file(fd: int, size: int, name: str, stop: threading.Event | None = None) -> int:
    """Move the pages of the first ``size`` bytes of the file ``fd`` (open for reading) into 2 MiB pages, through a
    mapping of its own (see :func:`collapse`); returns the bytes collapsed.

    Call it once the pages are written and before any process maps them: measured on a GiB of ``/dev/shm``, written
    pages no one maps collapse in 0.3 s, pages only reserved (``fallocate``) in 3.9 s, and pages mapped in by a
    prefault in 1.0-2.7 s (their mappings are taken apart). Writing zeros over reserved pages first costs 0.25 s
    (:func:`write_zeros`)."""
    if size < HUGE_PAGE_BYTES:
        return 0
    owner, offset = map_file(fd, size)
    try:
        return collapse(np.frombuffer(owner, dtype=np.uint8, count=1, offset=offset).ctypes.data, size, name, stop)
    finally:
        owner.close()


def write_zeros(fd: int, size: int) -> None:
    """Write zeros over the first ``size`` bytes of the file ``fd`` (reserved pages become written ones, which
    :func:`collapse_file` moves 12x faster)."""
    zeros = memoryview(bytes(min(size, 4 << 20)))
    done = 0
    while done < size:
        done += os.pwrite(fd, zeros[:min(len(zeros), size - done)], done)


#: statfs(2)'s f_type of hugetlbfs.
HUGETLBFS_MAGIC = 0x958458F6


def on_hugetlbfs(fd: int) -> bool:
    """Whether the file or directory ``fd`` is on hugetlbfs, whose files are sized in whole huge pages and cannot be
    written with ``write(2)`` (False where the system does not say)."""
    fstatfs = _c_function("fstatfs", [ctypes.c_int, ctypes.c_void_p], ctypes.c_int)
    if fstatfs is None:
        return False
    buf = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on 64-bit Linux); f_type is its first word
    if fstatfs(fd, buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF == HUGETLBFS_MAGIC


_MAP_FIXED = 0x10


def _place():
    """libc's ``mmap``, to map a file at a chosen address (Python's ``mmap`` cannot); None where there is none."""
    return _c_function("mmap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                ctypes.c_long], ctypes.c_void_p)


def reserve(fd: int, nbytes: int, path: str, what: str) -> None:
    """Allocate the first ``nbytes`` of the file ``fd`` (at ``path``) now and make that its size.

    A write into a shared-memory page that cannot be allocated kills the process with SIGBUS, and a disk that
    fills half way through a long write wastes it; so a file that does not fit fails here, with OutOfSpace naming
    ``what`` and the bytes free before the attempt (a failed fallocate may keep what it took). Writes into
    reserved blocks are also faster than into holes. File systems without fallocate allocate on write.
    """
    directory = os.path.dirname(path) or "."
    try:
        free = shutil.disk_usage(directory).free  # ext4 keeps what a failed fallocate took: ask first
    except OSError:
        free = None
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT):
            had = "free space unknown" if free is None else f"{free} bytes free before the attempt"
            raise OutOfSpace(f"{what}: cannot reserve {nbytes} bytes in {directory} ({had}) for "
                             f"{os.path.basename(path)}: {exc.strerror}") from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
    os.ftruncate(fd, nbytes)


#: Where a cgroup (v2, then v1) says how much memory its processes may use, and how much they use.
_CGROUP_MEMORY = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available_memory() -> tuple[int | None, str]:
    """Bytes of memory this process may still take without pushing the host (or its cgroup) into the OOM killer,
    and where that figure comes from; ``(None, "")`` where the system does not say."""
    best: tuple[int | None, str] = (None, "")
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    best = (int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in _CGROUP_MEMORY:
        try:
            with open(limit_file, encoding="ascii") as f:
                limit = f.read().strip()
            with open(usage_file, encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            left = max(0, int(limit) - usage)
            if best[0] is None or left < best[0]:
                best = (left, f"the limit of this process's cgroup ({limit_file})")
        break
    return best


def reserve_memory(fd: int, nbytes: int, what: str) -> None:
    """Allocate ``nbytes`` of the anonymous shared-memory file ``fd`` (a memfd) now and make that its size.

    Such memory is bounded by no file system, so a size past what the host (or the process's cgroup) has available
    is refused up front with OutOfSpace naming ``what``: allocating it page by page would end in the OOM killer,
    not in an error. Within it, a page that cannot be had fails here rather than with SIGBUS on first touch.
    """
    available, source = available_memory()
    if available is not None and nbytes > available:
        raise OutOfSpace(f"{what}: cannot reserve {nbytes} bytes of memory ({available} bytes available, by "
                         f"{source}); ask for less, or free memory first")
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT):
            raise OutOfSpace(f"{what}: cannot reserve {nbytes} bytes of memory: {exc.strerror}") from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
    os.ftruncate(fd, nbytes)


def trim_heap() -> None:
    """Give memory the allocator holds free back to the system (glibc's ``malloc_trim``; nothing elsewhere). A
    server that received a burst of large messages keeps their freed pages otherwise, for good."""
    fn = _c_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
    if fn is not None:
        fn(0)


__all__ = ["trim_heap"]
