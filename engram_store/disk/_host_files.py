"""The files of one host row cache (see ``_host_cache``) and how a process leaves them.

A cache's lock file and data file live in this user's directory of shared files (``engram_store._shared_dirs``):
:class:`CacheFiles` takes and lets go of the lock (a ``flock``, polled up to a deadline) and holds both descriptors.
:func:`detach` leaves a cache: the last process attached deletes its files. It may run from a finalizer the garbage
collector starts at any point of any thread, also where that thread holds the lock of another cache of this process
on the same file, through another open file (a flock is per open file: its own second open would wait for it in
vain). So every lock taken is counted per thread, and a finalizer that finds its thread holding one puts the
leaving off until the thread lets its last one go (:meth:`CacheFiles.unlock`). :func:`sweep` deletes the caches no
process holds any more (left by processes that died).
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import time

from .. import _fork
from ..errors import EngramError, LockTimeout
from .._shared_dirs import UserDir

log = logging.getLogger(__name__)

_holding = threading.local()  # .count: the host cache locks this thread holds now
_deferred: list = []  # leavings a finalizer put off (list.append and list.pop need no lock)


def _held_here() -> int:
    return getattr(_holding, "count", 0)


def _forget_deferred() -> None:
    """In a forked child: the parent's leavings are the parent's (its flocks are shared with the child)."""
    global _holding
    _fork.keep(*_deferred)
    _deferred.clear()
    _holding = threading.local()


_fork.in_child(_forget_deferred)


class CacheFiles:
    """The lock file and the data file of one host cache in this user's directory, and the flocks on them."""

    def __init__(self, directory: UserDir, name: str):
        self.dir = directory
        self.name = name
        self.lock_name = name + ".lock"
        self.lock_path = directory.join(self.lock_name)
        self.data_path = directory.join(name)
        self.lock_fd = -1
        self.data_fd = -1
        self.locked = False  # this holds the lock now (counted per thread)

    def lock(self, timeout_s: float) -> bool:
        """Take the lock file (opening the file at the name anew if its holder deleted it meanwhile); False if
        ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while True:
            if self.lock_fd < 0:
                self.lock_fd, _ = self.dir.open(self.lock_name, os.O_RDWR)
            try:
                fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
                continue
            if self.dir.same_file(self.lock_fd, self.lock_name):
                self.locked = True
                _holding.count = _held_here() + 1
                return True
            os.close(self.lock_fd)  # deleted by the last process leaving: lock the file now at the name
            self.lock_fd = -1

    def lock_or_raise(self, timeout_s: float, what: str) -> None:
        """Take the lock within ``timeout_s``, or raise LockTimeout naming the lock file."""
        if not self.lock(timeout_s):
            raise LockTimeout(f"host row cache: {what}: another process held {self.lock_path} for more than "
                              f"{timeout_s:g} s (a stopped or stuck process of this user; `fuser {self.lock_path}` "
                              "names it); stop it, or use cache_scope='process'")

    def unlock(self) -> None:
        fcntl.flock(self.lock_fd, fcntl.LOCK_UN)
        self._let_go()

    def _let_go(self) -> None:
        """The lock is no longer held: count it, and when this thread holds none, leave what finalizers put off."""
        if not self.locked:
            return
        self.locked = False
        _holding.count = _held_here() - 1
        while not _holding.count and _deferred:
            _detach_now(*_deferred.pop())

    def close(self) -> None:
        for name in ("data_fd", "lock_fd"):
            fd = getattr(self, name)
            setattr(self, name, -1)
            if fd >= 0:
                os.close(fd)  # closing the lock file's last descriptor lets its flock go
        self._let_go()


def nobody_holds(fd: int) -> bool:
    """Whether no other open file holds a flock on ``fd``'s file (tried by taking it exclusively)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def detach(files: CacheFiles | None, mm: mmap.mmap | None, timeout_s: float) -> None:
    """Leave the cache (see the module docstring): now, or, where this thread holds a host cache's lock (a
    finalizer the garbage collector ran inside it), when it lets its last one go. ``timeout_s``: the longest wait
    for the lock."""
    if _held_here():
        _deferred.append((files, mm, timeout_s))
        return
    _detach_now(files, mm, timeout_s)


def _detach_now(files: CacheFiles | None, mm: mmap.mmap | None, timeout_s: float) -> None:
    """Leave the cache: the last process attached deletes its files (one that cannot take the lock in time leaves
    them to the next process to attach)."""
    if files is None or files.data_fd < 0:
        if files is not None:
            files.close()
        return
    try:
        if files.lock(timeout_s):
            fcntl.flock(files.data_fd, fcntl.LOCK_UN)
            if nobody_holds(files.data_fd):
                files.dir.unlink(files.name)
                files.dir.unlink(files.lock_name)
        else:
            log.warning("host row cache %s: another process held %s for more than %g s; detached without "
                        "cleaning up", files.data_path, files.lock_path, timeout_s)
    except FileNotFoundError as exc:  # its files were removed meanwhile (by hand, or their directory): nothing to clean
        log.debug("host row cache %s: its files are gone already: %s", files.data_path, exc)
    except (OSError, EngramError) as exc:
        log.warning("host row cache %s: detaching failed: %s", files.data_path, exc)
    finally:
        files.close()
        files.dir.close()
    if mm is not None:
        try:
            mm.close()
        except BufferError:  # arrays still view it: the mapping goes when they do
            pass


def sweep(directory: UserDir, prefix: str, keep: str) -> None:
    """Delete the host caches (``prefix``...) in this user's ``directory`` that no process holds (left by processes
    that died), but ``keep``."""
    for name in directory.names():
        if not name.startswith(prefix) or name.endswith(".lock") or name == keep:
            continue
        files = CacheFiles(directory, name)
        try:
            if not files.lock(0):
                continue
            files.data_fd, _ = directory.open(name, os.O_RDWR, create=False)
            if nobody_holds(files.data_fd):
                log.info("removing the host row cache %s: no process uses it", files.data_path)
                directory.unlink(name)
                directory.unlink(files.lock_name)
        except (OSError, EngramError):
            pass
        finally:
            files.close()
