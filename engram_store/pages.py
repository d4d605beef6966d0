"""Pages of files and mappings: reserving a file's blocks up front, and huge pages and prefaulting through
``madvise(2)``.

Segments (their shared memory) and ``local_dir`` layers (their mapped head files) both ask for 2 MiB pages
where the OS allows them and map their pages in ahead of the first reads, in pieces, from a background
thread. ``madvise`` goes through ctypes, which releases the GIL for the call (Python's ``mmap.madvise`` does
not), so prefaulting gigabytes does not stall the threads serving reads.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import shutil
import threading

from .errors import OutOfSpace

log = logging.getLogger(__name__)

# madvise(2) advice values (Linux): MADV_POPULATE_READ needs 5.14; MADV_HUGEPAGE asks for 2 MiB pages.
MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22
#: Prefaulting maps this much per madvise call (and checks whether to stop in between).
PREFAULT_CHUNK_BYTES = 64 << 20

_libc: ctypes.CDLL | None = None
_libc_missing = False


def madvise(address: int, length: int, advice: int) -> int:
    """``madvise(2)`` of ``length`` bytes from ``address`` (widened to whole pages): 0, or the errno
    (ENOSYS where libc cannot be loaded, e.g. not Linux/glibc; everything still works without advice)."""
    global _libc, _libc_missing
    if _libc is None:
        if _libc_missing:
            return errno.ENOSYS
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            lib.madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            _libc_missing = True
            return errno.ENOSYS
        _libc = lib
    if length <= 0:
        return 0
    start = address - address % mmap.PAGESIZE
    if _libc.madvise(start, length + (address - start), advice) == 0:
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


_libc = None


def trim_heap() -> None:
    """Give memory the allocator holds free back to the system (glibc's ``malloc_trim``; nothing elsewhere). A
    server that received a burst of large messages keeps their freed pages otherwise, for good."""
    global _libc
    if _libc is None:
        try:
            import ctypes
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)

__all__ = ["trim_heap"]
