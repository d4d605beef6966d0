"""What engram creates in places other users share (``/dev/shm``, ``/tmp``, a directory a flag or a peer names), and
how it makes sure that what it opens there is its own.

Another local user is not trusted (containers run with ``--ipc=host`` share ``/dev/shm`` too). A predictable name in
a world-writable directory is anyone's to take first: as a file of theirs that we would initialise and then share
with them, as a symbolic link that makes us write through it, or as a lock they hold for ever. So:

* **Names the processes of a host must share live in a directory of the user's own**, ``<base>/engram-<uid>`` (mode
  0700, :class:`UserDir`), made with ``mkdir`` and opened with ``O_NOFOLLOW | O_DIRECTORY``; ``fstat`` on that
  descriptor must show a directory of this user that no one else may enter, or it is refused. Files in it are
  opened relative to the descriptor (``dir_fd``), so renaming the path after the check changes nothing. Another user
  can neither create, read nor replace a name in it (root can, and is trusted).
* **Files are created exclusively and never through a link** (``O_CREAT | O_EXCL | O_NOFOLLOW``); a file opened
  again is kept only when ``fstat`` on its descriptor shows a regular file of this user that no one else may write
  (:func:`check_own_file`). Nothing ever opens an existing file with ``O_CREAT``, so ``fs.protected_regular`` never
  refuses engram's own opens; a refusal of another kind still comes as an :class:`UnsafeFile` naming the file.
* **Directories of layers** (``local_dir``, ``disk_dir``) are used only when this user or root owns them, no one
  else may write to them, and each directory above them is no one else's to rename; they are resolved once and
  held open (``engram_store._layer_dir``): whoever may write in a directory of layers can move a published layer
  away and put their own in its place.
* **Modes follow the umask**: published files are read-only with the read bits the umask leaves
  (:func:`file_mode`), directories get what the umask leaves (:func:`dir_mode`); nothing is made readable by others
  that the umask keeps private.

Every refusal is an :class:`UnsafeFile` that says what was found (owner, mode, a link) and what to do.
"""
from __future__ import annotations

import errno
import os
import stat
import tempfile
import threading
from contextlib import contextmanager
from typing import Iterator

from .errors import NO_FILES, ConfigError, OutOfSpace, StoreError, UnsafeFile, too_many_open_files

_OPEN_TRIES = 8
_umask_lock = threading.Lock()


def shared_base() -> str:
    """Where this user's directory of shared files is made: ``ENGRAM_SHM_DIR``, else ``/dev/shm`` (memory, seen by
    every process of the host), else the temporary directory."""
    base = os.environ.get("ENGRAM_SHM_DIR")
    if base:
        return base
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def umask() -> int:
    """The process's umask, read without changing it (``/proc/self/status``; elsewhere set and restored at once)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode of a published (read-only) file: the read bits the umask leaves."""
    return 0o444 & ~umask()


def dir_mode() -> int:
    """The mode of a published directory: what the umask leaves."""
    return 0o777 & ~umask()


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _kind(st: os.stat_result) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(st.st_mode):
            return name
    return "not a regular file"


def check_own_file(fd: int, path: str, what: str) -> os.stat_result:
    """``fstat`` of the open file ``fd`` (at ``path``): a regular file of this user that no one else may write, or
    UnsafeFile (``what`` names the use in the message)."""
    st = os.fstat(fd)
    euid = os.geteuid()
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{what}: {path} is {_kind(st)}, not a file engram made; remove it, or choose another place")
    if st.st_uid != euid:
        raise UnsafeFile(f"{what}: {path} belongs to uid {st.st_uid} (mode {_mode(st)}), not to this user (uid "
                         f"{euid}), so another user made it first; remove it (as its owner or root), or choose "
                         "another place")
    if st.st_mode & 0o022:
        raise UnsafeFile(f"{what}: {path} may be written by other users (mode {_mode(st)}); remove it, or "
                         f"`chmod go-w {path}`")
    return st


def open_refused(exc: OSError, path: str, what: str) -> OSError | UnsafeFile:
    """The error for an ``open`` of ``path`` that the system refused: UnsafeFile for a link (``O_NOFOLLOW``) or a file
    engram may not open because another user has it (its mode, or ``fs.protected_regular``'s refusal in a sticky
    directory); any other refusal (a full disk, a directory where a file should be) stays the OSError it was, for
    the caller to say what it was doing."""
    try:
        st = os.lstat(path)
    except OSError:
        st = None
    if exc.errno == errno.ELOOP or (st is not None and stat.S_ISLNK(st.st_mode)):
        return UnsafeFile(f"{what}: {path} is a symbolic link; engram does not open files in shared places through a "
                          "link: remove it, or pass the path of the file itself")
    if exc.errno in (errno.EACCES, errno.EPERM) and st is not None and st.st_uid != os.geteuid():
        return UnsafeFile(f"{what}: {path} belongs to uid {st.st_uid} (mode {_mode(st)}) and this user (uid "
                          f"{os.geteuid()}) may not open it ({exc.strerror}; in a sticky world-writable directory "
                          "fs.protected_regular refuses another user's files even where the mode allows); remove it "
                          "(as its owner or root), or choose another place")
    return exc


def open_own(path: str, flags: int, what: str, mode: int = 0o600, *, dir_fd: int | None = None,
             create: bool = True) -> tuple[int, bool]:
    """Open ``path`` (relative to ``dir_fd`` if given) for ``flags``: created exclusively when it is not there (and
    ``create``), else opened without following a link and kept only if it is this user's own (see
    :func:`check_own_file`). Returns ``(fd, created)``; FileNotFoundError when it is not there and not ``create``."""
    shown = path if dir_fd is None else f"{_fd_path(dir_fd)}/{path}"
    flags = (flags & ~(os.O_CREAT | os.O_EXCL)) | os.O_NOFOLLOW | os.O_CLOEXEC
    where = {} if dir_fd is None else {"dir_fd": dir_fd}
    for _ in range(_OPEN_TRIES):
        if create:
            try:
                return os.open(path, flags | os.O_CREAT | os.O_EXCL, mode, **where), True
            except FileExistsError:
                pass
            except OSError as exc:
                raise open_refused(exc, shown, what) from None
        try:
            fd = os.open(path, flags, **where)
        except FileNotFoundError:
            if not create:
                raise
            continue  # removed between the two opens: create it
        except OSError as exc:
            raise open_refused(exc, shown, what) from None
        try:
            check_own_file(fd, shown, what)
        except BaseException:
            os.close(fd)
            raise
        return fd, False
    raise StoreError(f"{what}: {shown} kept appearing and disappearing ({_OPEN_TRIES} tries); try again")


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<directory fd {fd}>"


def directory_error(exc: OSError, where: str, hint: str) -> StoreError:
    """What a directory that cannot be made or used (``where`` says which, and for what) raises, by the cause: out
    of descriptors, of bytes or inodes, not a directory, not this process's to write; ``hint`` says what to do."""
    if exc.errno in NO_FILES:
        return too_many_open_files(where)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutOfSpace(f"{where}: no space left ({exc.strerror}: out of bytes or of inodes); free some there, "
                          f"or {hint}")
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return ConfigError(f"{where}: expected a directory, got a path that is not one ({exc.strerror}); {hint}")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ConfigError(f"{where}: this process may not create files there ({exc.strerror}); {hint}")
    return StoreError(f"{where}: {exc.strerror or exc}; {hint}")


class HeldDirectory:
    """A directory opened once and held: every file in it is opened, listed, renamed and removed relative to its
    descriptor (``dir_fd``), so a path changed after the open (a parent renamed, a link swapped) changes nothing.

    The subclasses open and check it: :class:`UserDir` (this user's directory in a shared place),
    ``durable.HeldDir`` (a directory a flag names, for durable files) and ``_layer_dir.LayerDir`` (a directory of
    layers, resolved component by component, whose descriptor tables read through while its owner may close it).
    :meth:`using` is the way to the descriptor; ``path`` is for messages, ``what`` names the use in errors.
    A context manager; :meth:`close` is idempotent."""

    path: str
    what: str
    fd: int = -1

    @contextmanager
    def using(self) -> Iterator[int]:
        """The descriptor, for one operation."""
        yield self.fd

    def open(self, name: str, flags: int, mode: int = 0o600, create: bool = True) -> tuple[int, bool]:
        """:func:`open_own` of ``name`` in this directory."""
        with self.using() as fd:
            return open_own(name, flags, self.what, mode, dir_fd=fd, create=create)

    def join(self, name: str) -> str:
        """``name``'s path, for messages (nothing is opened by it)."""
        return os.path.join(self.path, name)

    def lstat(self, name: str) -> os.stat_result | None:
        """``name``'s own status here (a link's, not its target's), or None where there is no such name."""
        with self.using() as fd:
            try:
                return os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return None

    def same_file(self, fd: int, name: str) -> bool:
        """Whether the open file ``fd`` is the file now named ``name`` here (not one removed or replaced since)."""
        there = self.lstat(name)
        if there is None:
            return False
        held = os.fstat(fd)
        return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)

    def unlink(self, name: str) -> None:
        with self.using() as fd:
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass

    def names(self) -> list[str]:
        with self.using() as fd:
            return os.listdir(fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class UserDir(HeldDirectory):
    """``<base>/engram-<uid>``: this user's directory in a shared place, held open (see the module docstring).

    ``what`` names the use in errors; ``hint`` says how to choose another base (e.g. an environment variable)."""

    def __init__(self, base: str, what: str, hint: str = "choose another directory"):
        self.base = os.path.abspath(base)
        self.path = os.path.join(self.base, f"engram-{os.geteuid()}")
        self.what = what
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise directory_error(exc, f"{what}: cannot create {self.path}", hint) from None
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                st = os.lstat(self.path)
                raise UnsafeFile(f"{what}: {self.path} is {_kind(st)} (uid {st.st_uid}), not the directory of this "
                                 f"user's shared files; remove it (as its owner or root), or {hint}") from None
            raise StoreError(f"{what}: cannot open {self.path}: {exc.strerror}; {hint}") from None
        st = os.fstat(self.fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            os.close(self.fd)
            self.fd = -1
            raise UnsafeFile(f"{what}: {self.path} belongs to uid {st.st_uid} with mode {_mode(st)}; engram keeps "
                             f"this user's shared files in a directory only this user (uid {os.geteuid()}) may "
                             f"enter (mode 0700): remove it (as its owner or root), or {hint}")
