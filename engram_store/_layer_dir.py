"""Layers published as directories of files (``local_dir``, ``disk_dir``): the primitives both kinds share.

A writer of layer L holds ``<dir>/layer-<L>.lock`` (:class:`LayerLock`) for its whole work, stages the layer's files
in a directory of its own and publishes them with one rename (:func:`publish_staged`); whatever a writer or remover
that died left is deleted by the next one, under the lock (:func:`remove_leftover`). Readers never see a layer half
written: it is there whole, or not at all.

A directory of layers is used only when this user or root owns it and no one else may write to it
(``_shared_dirs.check_layer_dir``): another user who could would move a published layer away and put their own in
its place. Published files are read-only with the read bits the umask leaves; directories get what it leaves.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time

from ._errors import InvalidArgument, LockTimeout, StoreError, describe
from ._shared_dirs import check_layer_dir, open_own

log = logging.getLogger(__name__)

LOCK_POLL_S = 0.05


def open_layer_dir(path: object, flag: str) -> str:
    """The absolute path of a directory of layers (``flag`` names the argument in errors), created if need be and
    refused (UnsafeFile) where another user could change it. A directory created here is no warning: a writer makes
    one on purpose, and a reader of a mistyped path is told when it finds no layer there (``DiskDir.created``)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise InvalidArgument(f"{flag}: expected a directory path, got {describe(path)}")
    path = os.path.abspath(os.fspath(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise InvalidArgument(f"{flag}: cannot create {path}: {exc.strerror}") from None
    check_layer_dir(path, flag)
    return path


class LayerLock:
    """The per-layer lock (``flock`` on ``<dir>/layer-<L>.lock``) that writers and removers of a layer hold for
    their whole work, released on close or process death.

    The holder may delete the lock file before it lets go (``close(unlink=True)``): a waiter that opened the
    deleted file gets its lock, sees the file is no longer the one at the path, and locks the one there instead,
    so two processes never both believe they hold the layer.
    """

    def __init__(self, path: str, timeout_s: float, what: str = "layer"):
        self.path = path
        self.fd = -1
        deadline = time.monotonic() + timeout_s
        while True:
            fd, _ = open_own(path, os.O_RDWR, f"{what} lock")
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise LockTimeout(f"{what}: another writer holds {path} (waited {timeout_s:g} s)"
                                              ) from None
                        time.sleep(LOCK_POLL_S)
                if _is_at(fd, path):
                    self.fd = fd
                    return
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # its holder deleted it while we waited: lock the file now at the path

    def close(self, unlink: bool = False) -> None:
        """Release the lock; with ``unlink``, delete the lock file first (still holding it)."""
        if self.fd >= 0:
            try:
                if unlink:
                    try:
                        os.unlink(self.path)
                    except FileNotFoundError:
                        pass
            finally:
                os.close(self.fd)  # releases the flock
                self.fd = -1


def _is_at(fd: int, path: str) -> bool:
    """Whether the open file ``fd`` is the file at ``path`` (not one deleted or replaced since it was opened)."""
    held = os.fstat(fd)
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


def remove_leftover(path: str, left_by: str) -> bool:
    """Delete the directory ``path`` that a writer or remover of the layer left when it died; whether there was
    one. Call it holding the layer's lock: the live writer or remover of a layer holds it for its whole work, so
    what is there under the lock belongs to a dead one."""
    if not os.path.lexists(path):
        return False
    log.warning("removing %s, left by a %s that died", path, left_by)
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError as exc:
        raise StoreError(f"layer: cannot remove {path}, left by a {left_by} that died: {exc}; delete it by "
                         "hand") from exc
    return True


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_staged(staging: str, final: str) -> None:
    """Publish a staged layer directory: its files are flushed, then one rename makes it the layer, and the
    directory holding both is flushed so the rename outlives a crash."""
    fsync_dir(staging)
    os.rename(staging, final)
    fsync_dir(os.path.dirname(final))
