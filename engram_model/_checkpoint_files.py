"""Opening the files of a checkpoint (safetensors shards, their index, ``config.json``), which may be another local
user's.

Why a loader, root's included, reads only what the checkpoint's owner could have given it, hazard by hazard:

- **A link out of the checkpoint** (``shard -> /etc/shadow``, or a hard link): a file is read only when it belongs
  to the owner of the checkpoint's directory, or, where that directory is the loader's own user's or root's, to
  the loader's user (:meth:`CheckpointDir.open_file`; UnsafeFile otherwise, naming both owners). A Hugging Face cache's
  snapshot links into its ``blobs`` lead to files of the cache's owner, and keep working; another user's
  checkpoint cannot make a root loader read root's files.
- **A file that blocks**: a named pipe as a shard (or index, or config) would block its open, or its first read,
  for ever. Files are opened with ``O_NONBLOCK`` (an open that cannot wait), checked with ``fstat`` to be regular
  files (InvalidArgument naming what they are: a pipe, a directory, a device), and only then set back to
  blocking reads.
- **A path changed after the check**: the directory is opened once and held; its files are opened relative to it
  (``dir_fd``), so renaming the path (or a parent) meanwhile changes nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from typing import Any, Mapping

from engram_store.durable import HeldDir
from engram_store.errors import ConfigError, InvalidArgument, UnsafeFile, describe

__all__ = ["CheckpointDir", "open_checkpoint_file"]

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


class CheckpointDir(HeldDir):
    """A checkpoint's directory ``path``, opened and held (NotADirectoryError where ``path`` is not one,
    FileNotFoundError where it is not there); :meth:`open_file` opens a file in it as the module says."""

    def __init__(self, path: str | os.PathLike):
        self.path, self.what, self.hint = os.fspath(path), "checkpoint", "copy the checkpoint"
        self.fd = os.open(self.path or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.owner = os.fstat(self.fd).st_uid
        euid = os.geteuid()
        #: Whose files may be read through it: its owner's, and the loader's where the directory is theirs or root's.
        self.allowed = {self.owner, euid} if self.owner in (euid, 0) else {self.owner}

    def open_file(self, name: str, shown: str | None = None) -> int:
        """A regular file ``name`` of this directory (or below it), opened read-only, never blocking on the way,
        and read only when its owner is allowed (see the module); FileNotFoundError where it is not there.
        ``shown`` names it in errors (default: its path)."""
        shown = shown or os.path.join(self.path, name)
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                kind = next((what for test, what in _KINDS if test(st.st_mode)), "not a regular file")
                raise InvalidArgument(f"{shown}: is {kind}, not a checkpoint file; a checkpoint's index, shards and "
                                      "config must be regular files")
            if st.st_uid not in self.allowed:
                whose = " or ".join(f"uid {uid}" for uid in sorted(self.allowed))
                raise UnsafeFile(f"{shown}: belongs to uid {st.st_uid}, but the checkpoint's directory {self.path} "
                                 f"belongs to uid {self.owner}; a checkpoint's files (and what its links lead to) "
                                 f"are read only when they belong to {whose}, so another user's checkpoint cannot "
                                 "make this loader read files that user may not: copy the file, or load it as its "
                                 "owner")
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        return fd


def open_checkpoint_file(path: str | os.PathLike) -> int:
    """The checkpoint file ``path``, opened as :meth:`CheckpointDir.open_file` opens it in its directory."""
    where = os.fspath(path)
    with CheckpointDir(os.path.dirname(where)) as directory:
        return directory.open_file(os.path.basename(where), where)


def read_json(path_or_dict: Any, caller: str = "from_hf_config") -> Mapping[str, Any]:
    """A model's config.json as a dict: ``path_or_dict`` a dict (as it is), the file, or a checkpoint directory
    holding it; ``caller`` names the call in errors."""
    if isinstance(path_or_dict, Mapping):
        return path_or_dict
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise ConfigError(f"path_or_dict: expected a config.json path, a directory or a dict, "
                          f"got {type(path_or_dict).__name__}")
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(open_checkpoint_file(path), encoding="utf-8") as f:  # a regular file: never a pipe
            raw = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        where = (f"no config.json in the directory {os.fspath(path_or_dict)!r}" if path != os.fspath(path_or_dict)
                 else f"no such file {path!r}")
        raise ConfigError(f"{caller}: {where} (expected a config.json path, a checkpoint directory holding "
                          "one, or a dict)") from None
    except OSError as exc:
        raise ConfigError(f"{caller}: cannot read {path!r}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not JSON ({exc})") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config.json") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a JSON object, got {describe(raw)}")
    return raw
