"""The files of a durable segment (``--file PATH``): its bytes (``PATH``), its catalogue (``PATH.manifest``), its
generation table (``PATH.gen``) and its owner lock (``PATH.lock``), all in one directory held open.

A segment owns its file: before it reads or writes any of them it takes the exclusive owner lock, which names the
holder (pid, host, start time, and once it serves, its id and address). A second segment started on the same file
refuses to start, naming the first; two segments on one file would register under one segment id and each hand
out the other's space (a reader got a blob's bytes as rows). The directory is checked once and held
(``engram_store.durable``): every file is opened, replaced and removed relative to it, the catalogue through a
private temporary, so no name another user takes beside the file is ever written.
"""

from __future__ import annotations

import os

from ..durable import DurableDir

#: What to do about a directory the segment's files may not be kept in.
HINT = "choose another --file"


class SegmentFiles:
    """The directory and owner lock of the durable segment file ``path`` (see the module); ``name`` is the file's
    name in ``dir``. :meth:`close` lets go of both (after the files are closed)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.name = os.path.basename(self.path)
        self.dir = DurableDir(os.path.dirname(self.path), "segment file", HINT)
        try:
            self.owner = self.dir.lock(self.name, "segment file")
            self.dir.remove_stale(self.name + ".manifest")
        except BaseException:
            self.dir.close()
            raise

    def join(self, suffix: str = "") -> tuple[str, str]:
        """``(name in the directory, full path)`` of the file ``PATH<suffix>``."""
        return self.name + suffix, self.path + suffix

    def serving(self, segment_id: str, address: str) -> None:
        """Name what this segment serves in its lock file (best effort: a full disk may keep the line as it was)."""
        try:
            self.owner.describe(serving=f"segment {segment_id} at {address}")
        except OSError:
            pass

    def close(self) -> None:
        self.owner.release()
        self.dir.close()
