"""Files engram keeps in a directory a flag or an argument names: a master's journal, a durable segment's file,
catalogue (``<file>.manifest``) and generation table (``<file>.gen``), their lock files, and what a model saves.

Such a directory may be one every user writes in (``/tmp``, ``/dev/shm``), so a name there may be anyone's to take
first: as a link that would make engram write through it into another file, or as a file of theirs that engram
would adopt. So:

* **The directory is opened once and held** (:class:`HeldDir`): every file in it is opened, created, renamed and
  removed relative to that descriptor (``dir_fd``), so a path another user changes after the check (a parent
  renamed, a link swapped) changes nothing. A directory of durable files is also checked on that descriptor
  (:class:`DurableDir`): this user's or root's, and where others may write, sticky (else they could rename a file
  of engram's away and put theirs in its place).
* **Files are created exclusively, never through a link** (``O_CREAT | O_EXCL | O_NOFOLLOW``); one opened again is
  kept only when ``fstat`` shows a regular file of this user that no one else may write
  (``_shared_dirs.open_own``).
* **A file replaced whole** (a journal compacted at start, a catalogue) is written under a private temporary name
  (``<name>.tmp-<random>``, created exclusively, so no name another user made first is ever written), synced, and
  renamed over the old one relative to the descriptor (:meth:`HeldDir.write_replacing`); a rename replaces a
  link, never what it points to.
* **Temporaries a crash left** are removed at start, under the file's owner lock, only when they are this user's
  (:meth:`HeldDir.remove_stale`); another user's name is left where it is, never opened, and logged.
* **One owner**: :meth:`HeldDir.lock` takes ``<name>.lock`` in the directory (:class:`HeldLock`, an
  ``owner.OwnerLock`` opened relative to the descriptor); a second process refuses, naming the holder.
"""
from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from typing import Callable

from .errors import ConfigError, UnsafeFile
from .owner import OwnerLock
from ._shared_dirs import HeldDirectory, directory_error, open_own

log = logging.getLogger(__name__)

__all__ = ["DurableDir", "HeldDir", "HeldLock", "write_replacing"]

#: How a private temporary name ends: ``<name>.tmp-`` and 16 random hex digits.
TMP_INFIX = ".tmp-"


class HeldDir(HeldDirectory):
    """The directory ``path``, opened once (following the links of the path as it is now) and held: every file is
    reached relative to its descriptor (see the module). ``what`` names the use in errors, ``hint`` what to do."""

    def __init__(self, path: str, what: str, hint: str = "choose another directory"):
        self.path = os.path.abspath(path)
        self.base = os.path.dirname(self.path)
        self.what = what
        self.hint = hint
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise directory_error(exc, f"{what}: cannot open the directory {self.path}", hint) from None

    def create_temporary(self, name: str, mode: int = 0o644, flags: int = 0) -> tuple[int, str]:
        """A new file, open for writing (and ``flags``, e.g. ``O_APPEND``), under a private name beside ``name``
        (``<name>.tmp-<random>``), made exclusively and never through a link; returns ``(fd, its name)``."""
        for _ in range(8):
            tmp = f"{name}{TMP_INFIX}{secrets.token_hex(8)}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | flags, mode,
                             dir_fd=self.fd)
            except FileExistsError:
                continue  # another user guessed 64 random bits: take another name
            return fd, tmp
        raise FileExistsError(errno.EEXIST, f"every private name tried beside {name} exists", self.join(name))

    def replace(self, tmp: str, name: str) -> None:
        """Rename ``tmp`` over ``name`` (both in this directory) and sync the directory."""
        os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        os.fsync(self.fd)

    def write_replacing(self, name: str, write: Callable[[int], None], mode: int = 0o644, flags: int = 0) -> int:
        """Replace ``name`` whole: ``write(fd)`` fills a private temporary (:meth:`create_temporary`, with
        ``flags``), which is synced and renamed over ``name``. Returns the descriptor of the new file (open for
        writing, at its end: the caller closes it). On any failure the temporary is removed and ``name`` is as it
        was."""
        fd, tmp = self.create_temporary(name, mode, flags)
        try:
            write(fd)
            os.fsync(fd)
            self.replace(tmp, name)
        except BaseException:
            os.close(fd)
            self.unlink(tmp)
            raise
        return fd

    def replace_bytes(self, name: str, data: bytes, mode: int = 0o644, flags: int = 0) -> int:
        """:meth:`write_replacing` with ``data`` as the new file's bytes."""
        def write(fd: int) -> None:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        return self.write_replacing(name, write, mode, flags)

    def remove_stale(self, name: str) -> list[str]:
        """Remove the temporaries of ``name`` a crash left (``<name>.tmp-*``, and ``<name>.tmp`` of earlier
        versions) that are this user's; another user's are left alone, never opened, and logged. Call it only while
        holding ``name``'s owner lock (no live writer of ours then). Returns the names removed."""
        removed = []
        for entry in self.names():
            if entry != f"{name}.tmp" and not entry.startswith(name + TMP_INFIX):
                continue
            try:
                st = os.stat(entry, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if st.st_uid != os.geteuid() or stat.S_ISDIR(st.st_mode):
                log.warning("%s: %s is not a temporary of this user's (uid %d, mode %04o): left alone, and never "
                            "written (this user's temporaries take private names); remove it as its owner or "
                            "root", self.what, self.join(entry), st.st_uid, stat.S_IMODE(st.st_mode))
                continue
            self.unlink(entry)
            removed.append(entry)
        if removed:
            log.info("%s: removed %d temporary file(s) a crash left in %s", self.what, len(removed), self.path)
        return removed

    def lock(self, name: str, what: str) -> "HeldLock":
        """The owner lock of ``name`` (``<name>.lock`` here), or FileInUse naming its holder."""
        return HeldLock(self, name, what)


class DurableDir(HeldDir):
    """A :class:`HeldDir` for durable files, checked on its descriptor: a directory of this user or root, and
    where others may write in it, sticky (UnsafeFile otherwise)."""

    def __init__(self, path: str, what: str, hint: str = "choose another directory"):
        super().__init__(path, what, hint)
        st = os.fstat(self.fd)
        euid = os.geteuid()
        problem = ""
        if st.st_uid not in (euid, 0):
            problem = f"belongs to uid {st.st_uid}, who may replace any file in it"
        elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            problem = (f"may be written by other users (mode {stat.S_IMODE(st.st_mode):04o}) and is not sticky, so "
                       "they may rename a file of engram's away and put their own in its place")
        if problem:
            self.close()
            raise UnsafeFile(f"{what}: the directory {self.path} {problem}; use a directory of this user (uid "
                             f"{euid}) that only its owner may write, or a sticky one such as /tmp, or {hint}")


class HeldLock(OwnerLock):
    """:class:`~.owner.OwnerLock` of ``<name>.lock`` in a held directory: opened, checked and unlinked relative
    to its descriptor."""

    def __init__(self, directory: HeldDir, name: str, what: str):
        self.directory, self.name = directory, name + ".lock"
        super().__init__(directory.join(name), what)

    def _open_lock(self) -> int:
        return open_own(self.name, os.O_RDWR, f"{self.what} lock", dir_fd=self.directory.fd)[0]

    def _is_current(self, fd: int) -> bool:
        return self.directory.same_file(fd, self.name)

    def _unlink(self) -> None:
        self.directory.unlink(self.name)


def write_replacing(path: str | os.PathLike, write: Callable[[object], None], what: str, mode: int = 0o666) -> None:
    """Write the file ``path`` whole and atomically, as :meth:`HeldDir.write_replacing` does (a private temporary
    made exclusively in the held directory, renamed into place): ``write(f)`` gets a binary file object. For files
    a user saves (checkpoints, token maps): another user who planted a name or a link beside ``path`` cannot make
    this write go anywhere else. ``mode`` is given to the new file (less the umask)."""
    where = os.fspath(path)
    name = os.path.basename(where)
    if not name:
        raise ConfigError(f"{what}: expected a file path, got the directory {where!r}")

    def fill(fd: int) -> None:
        with os.fdopen(os.dup(fd), "wb") as f:
            write(f)

    with HeldDir(os.path.dirname(os.path.abspath(where)), what) as directory:
        os.close(directory.write_replacing(name, fill, mode))
