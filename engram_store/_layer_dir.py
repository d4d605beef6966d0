"""Layers published as directories of files (``local_dir``, ``disk_dir``): the directory held open, and what both
kinds share.

* **A path is resolved once.** :class:`LayerDir` opens the directory a flag names component by component from
  ``/`` (:func:`resolve_dir`) and holds it open; every later open, create, rename and remove under it is relative
  to that descriptor (``dir_fd``). A layer is opened as one snapshot (:meth:`LayerDir.open_published`): its
  directory once, then each of its files relative to that, so one open sees exactly one publication; a layer
  removed or published again meanwhile is opened again whole, never mixed. Once open, a table keeps the directory
  it opened, whatever the path names later (a link changed, the directory renamed or replaced).
* **Links** on the way are followed then, once, and only when this user or root owns them, as
  ``fs.protected_symlinks`` does in sticky directories but everywhere: another user's link could name another
  directory at the next open.
* **What is checked, on descriptors** (``fstat``, never a path again): the directory must belong to this user or
  root and be writable by its owner alone, and no directory above it may let another user rename it; a layer's
  directory and every file read under it must be this user's or root's and not writable by others (files
  regular). Whoever could write there could put their own rows in place of a published layer's.
* **Writers**: a writer of layer L holds ``layer-<L>.lock`` (:class:`LayerLock`) for its whole work, stages the
  layer in a directory of its own (:meth:`LayerDir.stage`) whose files it creates with ``O_EXCL | O_NOFOLLOW``,
  and publishes it with one rename (:meth:`LayerDir.publish`); whatever a writer or remover that died left is
  deleted by the next one, under the lock (:meth:`LayerDir.remove_leftover`). Published files are read-only with
  the read bits the umask leaves; directories get what it leaves.
* **Closing**: the descriptors a table reads through are :class:`HeldFd`: closed once their owner closed them and
  no read still uses them, so a read in flight never meets a descriptor number another open has taken, and a
  read that starts after the close raises :class:`TableClosed`.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from .errors import EngramError, InvalidArgument, LockTimeout, StoreError, TableClosed, UnsafeFile, describe
from ._shared_dirs import HeldDirectory, dir_mode, open_own

log = logging.getLogger(__name__)

LOCK_POLL_S = 0.05
#: How often an open of a layer starts again when the layer was removed (or published again) while it was opened.
OPEN_TRIES = 8
#: Links followed while resolving one path (the kernel's own limit).
MAX_LINKS = 40
_PATH = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

T = TypeVar("T")


def _trusted(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


class HeldFd:
    """A descriptor that reads use (:meth:`use`) and its owner closes (:meth:`close`): it is closed when both are
    done, so a read that began before the close finishes on it, and one that begins after raises TableClosed
    (``what`` names the table in the message).

    No lock: a lookup enters and leaves once per layer, and at a model step's cadence two lock round trips cost
    several times the list operations below, which the interpreter makes atomic. A read adds itself to ``_users``
    before it looks at ``_closing``, and the close sets ``_closing`` before it looks at ``_users``, so one of them
    always sees the other; whichever finds the descriptor free last closes it, and ``_fds.pop()`` hands it to
    exactly one of them."""

    __slots__ = ("fd", "what", "_users", "_closing", "_fds")

    def __init__(self, fd: int, what: str):
        self.fd = fd
        self.what = what
        self._users: list = []
        self._closing = False
        self._fds = [fd]  # emptied by the one release that closes it

    def enter(self) -> int:
        """The descriptor, held open until :meth:`leave`; TableClosed once closed."""
        self._users.append(None)
        if self._closing:
            self.leave()
            raise TableClosed(f"{self.what} is closed")
        return self.fd

    def leave(self) -> None:
        self._users.pop()
        if self._closing and not self._users:
            self._release()

    @contextmanager
    def use(self) -> Iterator[int]:
        fd = self.enter()
        try:
            yield fd
        finally:
            self.leave()

    @property
    def closed(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Close now, or when the last read using it ends; idempotent."""
        self._closing = True
        if not self._users:
            self._release()

    def _release(self) -> None:
        try:
            fd = self._fds.pop()
        except IndexError:
            return  # closed already
        os.close(fd)

    def __del__(self) -> None:  # no read can use it any more: nothing else owns the descriptor
        try:
            self._release()
        except Exception:
            pass


def resolve_dir(path: str, flag: str, create: bool) -> tuple[int, str, bool]:
    """Open the directory at the absolute ``path``, one component at a time from ``/`` (see the module docstring:
    links of this user or root only; ``create``: make what is missing, as ``os.makedirs``). Returns a descriptor
    opened for reading, the path it resolved to and whether the last directory was made here."""
    parts = [p for p in path.split("/") if p][::-1]  # a stack: the next component last
    fd = os.open("/", _PATH)
    here: list[str] = []
    links = 0
    created = False
    try:
        while parts:
            name = parts.pop()
            if name == ".":
                continue
            try:
                nxt = os.open(name, _PATH, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise InvalidArgument(f"{flag}: expected a directory, got {path!r} (no such directory)") from None
                if _make(fd, name, "/" + "/".join(here + [name]), flag) and not parts:
                    created = True
                parts.append(name)
                continue
            except OSError as exc:
                target = _link(fd, name, exc, "/" + "/".join(here + [name]), flag)
                links += 1
                if links > MAX_LINKS:
                    raise InvalidArgument(f"{flag}: {path!r} passes through more than {MAX_LINKS} links") from None
                if target.startswith("/"):
                    # (the new descriptor held before the old one is closed: an interrupt between them leaks one,
                    # never closes one twice, which could close another thread's file that took its number)
                    old, fd = fd, os.open("/", _PATH)
                    here = []
                    os.close(old)
                parts.extend(p for p in reversed(target.split("/")) if p)
                continue
            old, fd = fd, nxt
            os.close(old)
            if name == "..":
                here = here[:-1]
            else:
                here.append(name)
        opened = os.open(".", _DIR, dir_fd=fd)
    except OSError as exc:
        raise _dir_error(exc, path, flag) from None
    finally:
        os.close(fd)
    return opened, "/" + "/".join(here), created


def _make(fd: int, name: str, shown: str, flag: str) -> bool:
    """Make directory ``name`` under ``fd`` (mode as the umask leaves); whether this call made it."""
    try:
        os.mkdir(name, 0o777, dir_fd=fd)
        return True
    except FileExistsError:
        return False  # made meanwhile: opened on the next turn
    except OSError as exc:
        raise InvalidArgument(f"{flag}: cannot create {shown}: {exc.strerror}") from None


def _link(fd: int, name: str, exc: OSError, shown: str, flag: str) -> str:
    """What the link ``name`` under ``fd`` names, if it is a link engram may follow; else the error to raise."""
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        raise exc from None
    if not stat.S_ISLNK(st.st_mode):
        raise InvalidArgument(f"{flag}: expected a directory, got {shown} (not a directory)") from None
    if not _trusted(st.st_uid):
        raise UnsafeFile(f"{flag}: {shown} is a symbolic link of uid {st.st_uid}, who may point it elsewhere at "
                         f"any time; engram follows links to a directory of layers only when this user (uid "
                         f"{os.geteuid()}) or root owns them: pass the directory's own path") from None
    return os.readlink(name, dir_fd=fd)


def _dir_error(exc: OSError, path: str, flag: str) -> StoreError:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return StoreError(f"{flag}: cannot open {path}: {exc.strerror}; use a directory this process may read")
    return StoreError(f"{flag}: cannot open {path}: {exc.strerror or exc}")


def check_dir(fd: int, shown: str, flag: str) -> None:
    """Refuse (UnsafeFile) the directory ``fd`` unless this user or root owns it and only its owner may write it,
    and every directory above it is safe from another user's rename (see the module docstring)."""
    st = os.fstat(fd)
    euid = os.geteuid()
    if not _trusted(st.st_uid):
        raise UnsafeFile(f"{flag}: {shown} belongs to uid {st.st_uid}; engram reads and publishes layers only in a "
                         f"directory of this user (uid {euid}) or root, since its owner can put their own files in "
                         "place of published layers: use a directory you own")
    if st.st_mode & 0o022:
        raise UnsafeFile(f"{flag}: {shown} may be written by other users (mode {_mode(st)}), who could move a "
                         f"published layer away and put their own in its place: `chmod go-w {shown}`, or use a "
                         "directory only you may write")
    _check_above(fd, st, shown, flag)


def _check_above(fd: int, st: os.stat_result, shown: str, flag: str) -> None:
    """Walk up from ``fd`` through ``..`` (descriptors, not the path): no directory above may let another user
    rename what lies in it (a sticky directory such as ``/tmp`` is fine)."""
    below, here = st, os.open("..", _PATH, dir_fd=fd)
    parent = os.path.dirname(shown)
    try:
        while True:
            up = os.fstat(here)
            if (up.st_dev, up.st_ino) == (below.st_dev, below.st_ino):
                return  # the root
            if not _trusted(up.st_uid) or (up.st_mode & 0o022 and not up.st_mode & stat.S_ISVTX):
                raise UnsafeFile(f"{flag}: {shown} lies in {parent} (uid {up.st_uid}, mode {_mode(up)}), where "
                                 "another user may rename it and put a directory of their own in its place; use a "
                                 "directory whose parents only you or root may change")
            nxt = os.open("..", _PATH, dir_fd=here)
            old, here = here, nxt  # (held before the old one is closed: see resolve_dir)
            below, parent = up, os.path.dirname(parent)
            os.close(old)
    finally:
        os.close(here)


def check_held(fd: int, shown: str, what: str, directory: bool = False) -> os.stat_result:
    """``fstat`` of a layer's directory or of a file read under one: this user's or root's, not writable by others
    (and a regular file, unless ``directory``), or UnsafeFile naming ``shown``."""
    st = os.fstat(fd)
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok or not _trusted(st.st_uid) or st.st_mode & 0o022:
        kind = "directory" if directory else "file"
        raise UnsafeFile(f"{what}: {shown} (uid {st.st_uid}, mode {_mode(st)}) is not a {kind} of this user (uid "
                         f"{os.geteuid()}) or root that only its owner may write; another user could change it under "
                         "its readers: remove the layer and publish it again")
    return st


def link_refused(shown: str, what: str) -> UnsafeFile:
    """What an open of a layer's file that is a link raises (``O_NOFOLLOW`` refused it)."""
    return UnsafeFile(f"{what}: {shown} is a symbolic link; a published layer's files are never links: remove the "
                      "layer and publish it again")


def open_at(dir_fd: int, name: str, shown: str, what: str, flags: int = os.O_RDONLY) -> int:
    """Open the file ``name`` in the held directory ``dir_fd`` (never through a link) and check it
    (:func:`check_held`). FileNotFoundError when it is not there; other refusals as UnsafeFile or the OSError."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise link_refused(shown, what) from None
        raise
    try:
        check_held(fd, shown, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_at(dir_fd: int, name: str, shown: str, what: str, limit: int) -> bytes:
    """At most ``limit`` bytes of the checked file ``name`` in ``dir_fd`` (see :func:`open_at`)."""
    fd = open_at(dir_fd, name, shown, what)
    try:
        return os.read(fd, min(limit, os.fstat(fd).st_size + 1))  # a file of a published layer does not change
    finally:
        os.close(fd)


class LayerDir(HeldDirectory):
    """A directory of layers (``flag`` names the argument in errors), resolved once and held open; created if
    ``create`` and need be. Its descriptor is a :class:`HeldFd` (tables read through it while the owner may close
    it): :meth:`close` is idempotent and lets running operations finish."""

    def __init__(self, path: object, flag: str, *, create: bool = True):
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise InvalidArgument(f"{flag}: expected a directory path, got {describe(path)}")
        self.flag = self.what = flag
        #: The path as given (absolute), and the directory it named when it was opened.
        self.path = os.path.abspath(os.fspath(path))
        fd, self.resolved, self.created = resolve_dir(self.path, flag, create)
        try:
            check_dir(fd, self.path, flag)
        except BaseException:
            os.close(fd)
            raise
        self.held = HeldFd(fd, f"{flag} {self.path}")

    def using(self):
        """The descriptor, held open for one operation (TableClosed once closed)."""
        return self.held.use()

    def exists(self, name: str) -> bool:
        return self.lstat(name) is not None

    def is_dir(self, name: str) -> bool:
        """Whether ``name`` is a directory here (a link to one is not)."""
        st = self.lstat(name)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def open_published(self, name: str, build: Callable[[int, str], T],
                       missing: Callable[[str], EngramError] | None = None) -> T | None:
        """``build(dir_fd, shown)`` of the published layer ``name``, opened once (checked), its files to be opened
        relative to ``dir_fd`` (which is closed after); None if it is not published. A FileNotFoundError out of
        ``build`` means the layer was removed meanwhile (it is opened again) or lacks a file: ``missing(file)``
        is raised then (by default a StoreError saying the layer is damaged)."""
        shown = self.join(name)
        with self.using() as top:
            for _ in range(OPEN_TRIES):
                try:
                    fd = os.open(name, _DIR, dir_fd=top)
                except FileNotFoundError:
                    return None
                except OSError as exc:
                    raise _not_opened(top, name, shown, self.flag, exc) from None
                try:
                    check_held(fd, shown, self.flag, directory=True)
                    return build(fd, shown)
                except FileNotFoundError as exc:
                    if _same(top, name, fd):
                        file = os.path.join(shown, exc.filename or "?")
                        raise (missing or _damaged)(file) from None
                finally:
                    os.close(fd)
        raise StoreError(f"{self.flag}: {shown} was removed or published again {OPEN_TRIES} times while it was "
                         "opened; try again")

    def lock(self, name: str, timeout_s: float, what: str = "layer") -> "LayerLock":
        return LayerLock(self, name, timeout_s, what)

    def remove_leftover(self, name: str, left_by: str) -> bool:
        """Delete ``name``, left by a writer or remover of the layer that died; whether there was one. Call it
        holding the layer's lock: the live writer or remover of a layer holds it for its whole work, so what is
        there under the lock belongs to a dead one."""
        st = self.lstat(name)
        if st is None:
            return False
        log.warning("removing %s, left by a %s that died", self.join(name), left_by)
        try:
            self._delete(name, st)
        except OSError as exc:
            raise StoreError(f"layer: cannot remove {self.join(name)}, left by a {left_by} that died: {exc}; delete it "
                             "by hand") from exc
        return True

    def _delete(self, name: str, st: os.stat_result) -> None:
        with self.using() as fd:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)

    def discard(self, name: str) -> None:
        """Delete ``name`` (a directory this process staged) if it is there; errors are ignored."""
        with self.using() as fd:
            shutil.rmtree(name, ignore_errors=True, dir_fd=fd)

    def retire(self, name: str, doomed: str) -> None:
        """Unpublish the layer ``name``: one rename to ``doomed`` (readers opening it stop seeing it at once), then
        its files are deleted (readers that have them open read on). Under the layer's lock."""
        with self.using() as fd:
            os.rename(name, doomed, src_dir_fd=fd, dst_dir_fd=fd)
            shutil.rmtree(doomed, dir_fd=fd)

    def stage(self, name: str) -> int:
        """Make the staging directory ``name`` (mode 0700, exclusively) and open it; its descriptor."""
        with self.using() as top:
            os.mkdir(name, 0o700, dir_fd=top)
            fd = os.open(name, _DIR, dir_fd=top)
        try:
            check_held(fd, self.join(name), self.flag, directory=True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def publish(self, staging: str, staging_fd: int, final: str) -> None:
        """Publish a staged layer directory: its files are flushed, then one rename makes it the layer, and the
        directory holding both is flushed so the rename outlives a crash."""
        os.fchmod(staging_fd, dir_mode() & ~0o022)  # as the umask says, but never writable by others
        os.fsync(staging_fd)
        with self.using() as fd:
            os.rename(staging, final, src_dir_fd=fd, dst_dir_fd=fd)
            os.fsync(fd)

    def close(self) -> None:
        self.held.close()

    def __repr__(self) -> str:
        return f"LayerDir({self.path!r}{'' if self.resolved == self.path else f' -> {self.resolved!r}'})"


def _damaged(file: str) -> StoreError:
    return StoreError(f"layer: cannot open {file}: No such file or directory; the layer is damaged: remove it and "
                      "publish it again")


def _not_opened(dir_fd: int, name: str, shown: str, flag: str, exc: OSError) -> EngramError:
    """Why the layer directory ``name`` in ``dir_fd`` did not open: a link (never followed there), something other
    than a directory, or what the system said."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        return UnsafeFile(f"{flag}: {shown} is a symbolic link (uid {st.st_uid}); a published layer is a directory, "
                          "never a link: remove it, and publish the layer again")
    if st is not None and not stat.S_ISDIR(st.st_mode):
        return StoreError(f"{flag}: {shown} is not a directory; remove it, and publish the layer again")
    return StoreError(f"{flag}: cannot open {shown}: {exc.strerror or exc}")


def _same(dir_fd: int, name: str, fd: int) -> bool:
    """Whether the open directory ``fd`` is still the one named ``name`` in ``dir_fd``."""
    try:
        there = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


class LayerLock:
    """The per-layer lock (``flock`` on ``<dir>/layer-<L>.lock``, opened relative to the held directory) that
    writers and removers of a layer hold for their whole work, released on close or process death.

    The holder may delete the lock file before it lets go (``close(unlink=True)``): a waiter that opened the
    deleted file gets its lock, sees the file is no longer the one at the name, and locks the one there instead,
    so two processes never both believe they hold the layer.
    """

    def __init__(self, directory: LayerDir, name: str, timeout_s: float, what: str = "layer"):
        self.dir = directory
        self.name = name
        self.path = directory.join(name)
        self.fd = -1
        deadline = time.monotonic() + timeout_s
        with directory.using() as top:
            while True:
                fd, _ = open_own(name, os.O_RDWR, f"{what} lock", dir_fd=top)
                try:
                    self._wait(fd, deadline, timeout_s, what)
                    if _same(top, name, fd):
                        self.fd = fd
                        return
                except BaseException:
                    os.close(fd)
                    raise
                os.close(fd)  # its holder deleted it while we waited: lock the file now at the name

    def _wait(self, fd: int, deadline: float, timeout_s: float, what: str) -> None:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeout(f"{what}: another writer holds {self.path} (waited {timeout_s:g} s)") from None
                time.sleep(LOCK_POLL_S)

    def close(self, unlink: bool = False) -> None:
        """Release the lock; with ``unlink``, delete the lock file first (still holding it)."""
        if self.fd < 0:
            return
        try:
            if unlink:
                with self.dir.held.use() as top:
                    try:
                        os.unlink(self.name, dir_fd=top)
                    except FileNotFoundError:
                        pass
        finally:
            os.close(self.fd)  # releases the flock
            self.fd = -1
