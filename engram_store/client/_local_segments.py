"""The segment files of this host that a client uses directly: mapped read-only for local-direct reads (with their
generation tables), opened for same-host writes. Each is opened once, on first use, and kept until the segment is
declared dead or the client closes; one lock guards them.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading

import numpy as np

from .. import kernels as _kernels
from .._errors import NO_FILES, too_many_open_files
from ._objects import Replica

_RETIRED = _kernels.generation_table.RETIRED

log = logging.getLogger("engram_store.client")


class LocalSegments:
    """This host's segment files, as one client uses them (see the module docstring)."""

    def __init__(self, host_id: str):
        self.host_id = host_id
        self._views: dict[str, np.ndarray | None] = {}  # segment id -> its memory, mapped read-only (None: not here)
        self._tables: dict[str, np.ndarray | None] = {}  # segment id -> its generation table, mapped read-only
        self._write_fds: dict[str, int | None] = {}  # segment id -> its file, open for same-host puts
        self._retired_fds: list[int] = []  # of dead segments: another thread may still be writing with one
        self._mmaps: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def adopt(self, segment_id: str, memory: np.ndarray, table: np.ndarray | None) -> None:
        """A segment this client runs itself: its memory and table are read in place."""
        with self._lock:
            self._views[segment_id] = memory
            self._tables[segment_id] = _kernels.readonly(table) if table is not None else None

    def view(self, replica: Replica) -> np.ndarray | None:
        """The whole segment holding ``replica`` as a read-only uint8 array, if it is mapped on this host.

        A mapping outlives a killed segment process (its file stays until reaped), so reads through it keep
        returning the intact bytes until the master declares the segment dead and ``locate`` stops naming it.
        """
        view = self._views.get(replica.segment_id, False)
        if view is not False:
            return view
        with self._lock:
            if replica.segment_id in self._views:
                return self._views[replica.segment_id]
            view = None
            if replica.host_id == self.host_id and replica.shm_path:
                try:
                    view = self._map(replica.shm_path, replica.segment_size, np.uint8)
                except OSError as exc:
                    _out_of_files(exc, f"mapping segment {replica.segment_id} ({replica.shm_path})")
                    log.debug("segment %s not mappable here (%s); reading remotely", replica.segment_id, exc)
            self._views[replica.segment_id] = view
            return view

    def table(self, replica: Replica) -> np.ndarray | None:
        """The generation table of a segment mapped on this host (int64, read-only), which says which put wrote
        each of its objects (see ``engram_store.kernels.generation_table``); None where the segment publishes
        none, or it is not mapped here."""
        table = self._tables.get(replica.segment_id, False)
        if table is not False and (table is None or not table[_RETIRED]):
            return table
        if self.view(replica) is None:
            return None
        with self._lock:
            table = self._tables.get(replica.segment_id, False)
            if table is not False and (table is None or not table[_RETIRED]):
                return table
            # A table its segment retired (it made a new file in its place) tells nothing: map the file anew.
            table = None
            try:
                table = self._map(replica.shm_path + ".gen", None, np.int64)
            except OSError as exc:
                _out_of_files(exc, f"mapping the generation table of segment {replica.segment_id}")
                log.debug("segment %s publishes no generation table here (%s)", replica.segment_id, exc)
            self._tables[replica.segment_id] = table
            return table

    def _map(self, path: str, size: int | None, dtype: type) -> np.ndarray | None:
        """``path`` mapped read-only, if it is ``size`` bytes (a table: at least 64, whole words); None if not.
        Holds the lock."""
        fd = os.open(path, os.O_RDONLY)
        try:
            actual = os.fstat(fd).st_size
            if (actual != size) if size is not None else (actual < 64 or actual % 8):
                return None
            mm = mmap.mmap(fd, actual, mmap.MAP_SHARED, mmap.PROT_READ)
            self._mmaps.append(mm)
            return np.frombuffer(mm, dtype=dtype)
        finally:
            os.close(fd)

    def write_fd(self, replica: dict, nbytes: int) -> int | None:
        """A write descriptor of the segment file of a freshly placed replica (``put_start``'s form), if that file
        is on this host and the replica's ``nbytes`` lie within it; opened once per segment and kept open."""
        if replica.get("host_id") != self.host_id or not replica.get("shm_path"):
            return None
        segment_id = replica["segment_id"]
        fd = self._write_fds.get(segment_id, False)
        if fd is False:
            with self._lock:
                fd = self._write_fds.get(segment_id, False)
                if fd is False:
                    fd = None
                    try:
                        fd = os.open(replica["shm_path"], os.O_WRONLY | os.O_CLOEXEC)
                        if os.fstat(fd).st_size != replica["size"]:
                            os.close(fd)
                            fd = None
                    except OSError as exc:
                        _out_of_files(exc, f"opening segment {segment_id} ({replica['shm_path']}) to write")
                        log.debug("segment %s not writable here (%s); writing remotely", segment_id, exc)
                    self._write_fds[segment_id] = fd
        if fd is None or not 0 <= replica["offset"] <= replica["size"] - nbytes:
            return None
        return fd

    def forget(self, segment_id: str, keep_mapping: bool = False) -> None:
        """Stop using a segment (declared dead); ``keep_mapping`` for one this client runs itself."""
        with self._lock:
            if not keep_mapping:
                self._views.pop(segment_id, None)
                self._tables.pop(segment_id, None)
            fd = self._write_fds.pop(segment_id, None)
            if fd is not None:
                self._retired_fds.append(fd)  # another thread may be writing with it; closed with the client

    def forked(self) -> None:
        """In a forked child: the mappings and files are this process's copies (reads and ``pwrite`` through them
        are its own); only the lock may have been held by a thread the child does not have."""
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close every file and mapping (a mapping an array still views is unmapped by the GC later)."""
        with self._lock:
            self._views.clear()
            self._tables.clear()
            fds = [fd for fd in self._write_fds.values() if fd is not None] + self._retired_fds
            self._write_fds.clear()
            self._retired_fds = []
            mmaps, self._mmaps = self._mmaps, []
        for fd in fds:
            os.close(fd)
        for mm in mmaps:
            try:
                mm.close()
            except BufferError:
                pass  # an array still views it


def _out_of_files(exc: OSError, what: str) -> None:
    """Raise the named error where ``exc`` is this process out of file descriptors: not a reason to forget a
    segment's file (the next call, with a descriptor free, maps it) nor a fault of the segment's."""
    if exc.errno in NO_FILES:
        raise too_many_open_files(what) from exc
