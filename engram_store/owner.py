"""One owner per durable file: an exclusive ``flock`` on ``<path>.lock`` that names its holder.

A second process that opens the same journal (or any file guarded this way) must refuse before it reads or writes
anything, and say who holds it. The lock file holds one line naming the holder (pid, host, when, what it serves);
the kernel releases the lock when the holder exits, however it exits, so a stale file never blocks anyone. A clean
release unlinks the file while still holding the lock; an acquirer checks that the file it locked is still the one
at the path (else it was unlinked meanwhile, and it tries again), so two processes never hold locks on two
different files of the same name.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time

from .errors import ConfigError
from ._shared_dirs import open_own

__all__ = ["OwnerLock", "FileInUse"]

log = logging.getLogger(__name__)


class FileInUse(ConfigError):
    """A durable file is owned by another live process (its lock file names it)."""


class OwnerLock:
    """``OwnerLock(path, what)`` takes ``<path>.lock`` or raises :class:`FileInUse` naming the holder."""

    def __init__(self, path: str, what: str):
        self.path = os.path.abspath(path) + ".lock"
        self.what = what
        self._since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        self._fd: int | None = None
        for _ in range(100):
            fd = self._open_lock()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_holder(fd)
                os.close(fd)
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise ConfigError(f"{what} {path!r}: cannot lock {self.path!r}: {exc.strerror}") from None
                raise FileInUse(f"{what} {path!r} is in use by another process ({holder or 'holder unknown'}); "
                                f"stop it first, or choose another path") from None
            if self._is_current(fd):
                self._fd = fd
                try:
                    self.describe()
                except OSError as exc:  # a full disk: the lock holds all the same, its holder unnamed
                    log.debug("%s: cannot name the holder in %s: %s", what, self.path, exc.strerror or exc)
                return
            os.close(fd)  # the holder released it and unlinked the file between our open and flock: again
        raise ConfigError(f"{what} {path!r}: could not take {self.path!r} (it kept being replaced)")

    def _open_lock(self) -> int:
        """The lock file, opened read-write: made exclusively, or opened never through a link and kept only when
        it is this user's own."""
        return open_own(self.path, os.O_RDWR, f"{self.what} lock")[0]

    def _is_current(self, fd: int) -> bool:
        """Whether the open lock file ``fd`` is the one now at its path (not one a holder unlinked meanwhile)."""
        try:
            return os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def describe(self, serving: str = "") -> None:
        """Write the holder's line: pid, host, start time and (once known) what it serves."""
        if self._fd is None:
            return
        line = (f"pid {os.getpid()} on {socket.gethostname()} since {self._since}"
                + (f", serving {serving}" if serving else ""))
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (line + "\n").encode(), 0)

    def release(self) -> None:
        """Unlink the lock file and let go (idempotent)."""
        if self._fd is None:
            return
        self._unlink()
        os.close(self._fd)
        self._fd = None


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""
