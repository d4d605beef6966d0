"""The segments of this host that a client uses directly: their memory mapped read-only for local-direct reads (with
their generation tables), and held open for same-host writes. Each is asked for once, on first use, and kept until
the segment is declared dead or the client closes; one lock guards them.

The memory comes only as descriptors the segment itself hands over on its Unix socket (``wire.handover``: the
socket's directory, its name and the peer's credentials must agree), never by opening a path a peer names, so no
registration can lead this client to map or write a file of its choosing. A descriptor is mapped only when nothing
can shrink it under the mapping: sealed memory (a memfd), or else a file of the segment's user that no one else may
write, from a segment run by this user or root.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import mmap
import os
import stat
import threading
import time
from typing import Callable

import numpy as np

from .. import kernels as _kernels
from ..errors import (NO_FILES, EngramError, ProtocolError, ResourceExhausted, SegmentUnavailable, UnsafeFile,
                       too_many_open_files)
from ..wire import handover
from ._objects import Replica

_RETIRED = _kernels.generation_table.RETIRED

log = logging.getLogger("engram_store.client")

#: How long a hand-over (connect, ask, receive) may take.
HANDOVER_TIMEOUT_S = 2.0
#: After a segment's socket did not answer (it is gone, stopped or busy), its memory is asked for again this late.
RETRY_S = 5.0
#: What a segment's socket does when its process is gone or stopped: not a refusal of this client.
_GONE = (ConnectionError, FileNotFoundError, TimeoutError)
_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x2)


class LocalSegments:
    """This host's segments, as one client uses them (see the module docstring)."""

    def __init__(self, host_id: str):
        self.host_id = host_id
        self._views: dict[str, np.ndarray | None] = {}  # segment id -> its memory, mapped read-only (None: not here)
        self._tables: dict[str, np.ndarray | None] = {}  # segment id -> its generation table, mapped read-only
        self._write_fds: dict[str, int | None] = {}  # segment id -> its memory, open for same-host puts
        self._retired_fds: list[int] = []  # of dead segments: another thread may still be writing with one
        self._retry_at: dict[str, float] = {}  # segment id -> when to ask again, after its socket did not answer
        self._mmaps: list[mmap.mmap] = []
        #: segment id -> its memory's mapping, where that is a file that can still shrink (a durable segment's: no
        #: seal keeps a regular file's size; cut short while its segment is down, a read past its end is SIGBUS)
        self._files: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def adopt(self, segment_id: str, memory: np.ndarray, table: np.ndarray | None) -> None:
        """A segment this client runs itself: its memory and table are read in place."""
        with self._lock:
            self._views[segment_id] = memory
            self._tables[segment_id] = _kernels.readonly(table) if table is not None else None

    def view(self, replica: Replica) -> np.ndarray | None:
        """The whole segment holding ``replica`` as a read-only uint8 array, if it is mapped on this host.

        A mapping outlives a killed segment process (the memory stays while it is mapped), so reads through it keep
        returning the intact bytes until the master declares the segment dead and ``locate`` stops naming it.
        """
        view = self._views.get(replica.segment_id, False)
        if view is not False:
            return view
        if self._retry_at.get(replica.segment_id, 0.0) > time.monotonic():
            return None
        with self._lock:
            if replica.segment_id in self._views:
                return self._views[replica.segment_id]
            view = table = None
            if replica.host_id == self.host_id and replica.shm_path:
                try:
                    view, table = self._receive(replica.segment_id, replica.shm_path, replica.segment_size)
                except _GONE as exc:  # not now: reads go to the segment (and fail over), and ask again later
                    log.debug("segment %s does not answer on %s (%s); reading remotely", replica.segment_id,
                              replica.shm_path, exc)
                    self._retry_at[replica.segment_id] = time.monotonic() + RETRY_S
                    return None
                except (OSError, EngramError) as exc:
                    _out_of_files(exc, f"mapping segment {replica.segment_id} ({replica.shm_path})")
                    log.debug("segment %s not mappable here (%s); reading remotely", replica.segment_id, exc)
            self._views[replica.segment_id] = view
            self._tables[replica.segment_id] = table
            return view

    def table(self, replica: Replica) -> np.ndarray | None:
        """The generation table of a segment mapped on this host (int64, read-only), which says which put wrote
        each of its objects (see ``engram_store.kernels.generation_table``); None where the segment publishes
        none, or it is not mapped here."""
        table = self._tables.get(replica.segment_id, False)
        if table is not False and (table is None or not table[_RETIRED]):
            return table
        if table is not False:
            # Retired: its segment (a durable one restarted) made a new table in its place, which tells what this
            # one no longer does. Ask the segment for its memory and table again.
            with self._lock:
                if self._tables.get(replica.segment_id, False) is table:
                    self._views.pop(replica.segment_id, None)
                    self._tables.pop(replica.segment_id, None)
                    self._files.pop(replica.segment_id, None)
        self.view(replica)
        table = self._tables.get(replica.segment_id)
        return None if table is not None and table[_RETIRED] else table

    def _receive(self, segment_id: str, path: str, size: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The memory and generation table the segment at ``path`` hands over, mapped read-only. Holds the lock."""
        handed = handover.fetch(path, segment_id, "read", HANDOVER_TIMEOUT_S)
        try:
            if "memory" not in handed.fds or handed.size != size:
                raise ProtocolError(f"segment {segment_id} handed over {sorted(handed.fds)} of {handed.size} bytes, "
                                    f"expected its memory of {size} bytes")
            view, mm = self._map(handed.fds["memory"], size, np.uint8, handed.uid, segment_id)
            if not _sealed(handed.fds["memory"]):
                self._files[segment_id] = mm
            table = None
            if "table" in handed.fds:
                try:
                    table = self._map(handed.fds["table"], None, np.int64, handed.uid, segment_id)[0]
                except (OSError, EngramError) as exc:
                    log.debug("segment %s: generation table not mapped (%s)", segment_id, exc)
            problem = _kernels.generation_table.header_problem(table) if table is not None else ""
            if problem:  # a capacity past the mapping would lead every check past it: not used at all
                log.warning("%s", ProtocolError(f"segment {segment_id} handed over a generation table of "
                                                f"{table.nbytes} bytes that is refused: {problem}; tables mapped "
                                                "from it are read through the segment when the master's answer "
                                                "is too old to prove them"))
                table = None
            return view, table
        finally:
            handed.close()

    def _map(self, fd: int, size: int | None, dtype: type, owner: int,
             segment_id: str) -> tuple[np.ndarray, mmap.mmap]:
        """The handed-over file ``fd`` mapped read-only, if it is ``size`` bytes (a table: at least 64, whole words)
        and no one but this user or root can shrink it under the mapping (see the module docstring), and its
        mapping. Holds the lock."""
        st = os.fstat(fd)
        actual = st.st_size
        if not stat.S_ISREG(st.st_mode) or ((actual != size) if size is not None else (actual < 64 or actual % 8)):
            raise ProtocolError(f"segment {segment_id} handed over a file of {actual} bytes (mode {st.st_mode:o}), "
                                f"expected {size if size is not None else 'a generation table'}")
        if not _sealed(fd) and (owner not in (os.geteuid(), 0) or st.st_uid != owner or st.st_mode & 0o022):
            raise UnsafeFile(f"segment {segment_id}: its memory is a file of uid {st.st_uid} (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}) that is not sealed, from a segment of uid {owner}: "
                             "someone other than this user or root could shrink it under the mapping")
        mm = mmap.mmap(fd, actual, mmap.MAP_SHARED, mmap.PROT_READ)
        self._mmaps.append(mm)
        return np.frombuffer(mm, dtype=dtype), mm

    def shrunk_probe(self, segment_id: str) -> Callable[[int], bool] | None:
        """``shrunk`` of segment ``segment_id``'s mapped file (its check in ``client.read_mapped``), or None where
        its memory cannot shrink (sealed memory, or none mapped)."""
        return functools.partial(self.shrunk, segment_id) if segment_id in self._files else None

    def shrunk(self, segment_id: str, need: int) -> bool:
        """Whether the mapped memory of segment ``segment_id`` is a file now shorter than ``need`` bytes (one
        ``fstat``; sealed memory never is): then nothing from ``need`` on may be read in place. A durable segment's
        file is this user's own, but one cut short while its segment was down (damage at rest, a restart on a
        truncated copy) would kill a read past its end with SIGBUS."""
        mm = self._files.get(segment_id)
        if mm is None:
            return False
        try:
            return mm.size() < need
        except (ValueError, OSError):  # closed meanwhile: nothing proves it whole
            return True

    def write_fd(self, replica: dict, nbytes: int) -> int | None:
        """A write descriptor of the memory of a freshly placed replica's segment (``put_start``'s form), if it is on
        this host, hands its memory over for writes, and the replica's ``nbytes`` lie within it; asked for once
        per segment and kept open. SegmentUnavailable where its socket does not answer (the segment is gone or
        stopped: its requests would only time out)."""
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
                        fd = self._receive_writable(segment_id, replica["shm_path"], replica["size"])
                    except _GONE as exc:
                        raise SegmentUnavailable(f"segment {segment_id} does not answer on its hand-over socket "
                                                 f"{replica['shm_path']} ({exc}): it is gone or stopped") from None
                    except (OSError, EngramError) as exc:
                        _out_of_files(exc, f"opening segment {segment_id} ({replica['shm_path']}) to write")
                        log.debug("segment %s not writable here (%s); writing remotely", segment_id, exc)
                    self._write_fds[segment_id] = fd
        if fd is None or not 0 <= replica["offset"] <= replica["size"] - nbytes:
            return None
        return fd

    @staticmethod
    def _receive_writable(segment_id: str, path: str, size: int) -> int:
        handed = handover.fetch(path, segment_id, "write", HANDOVER_TIMEOUT_S)
        try:
            fd = handed.fds.get("memory", -1)
            st = os.fstat(fd) if fd >= 0 else None
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != size or handed.size != size \
                    or fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
                raise ProtocolError(f"segment {segment_id} handed over {sorted(handed.fds)}, not its memory of "
                                    f"{size} bytes open for writing")
            return handed.fds.pop("memory")
        finally:
            handed.close()

    def forget(self, segment_id: str, keep_mapping: bool = False) -> None:
        """Stop using a segment (declared dead); ``keep_mapping`` for one this client runs itself."""
        with self._lock:
            if not keep_mapping:
                self._views.pop(segment_id, None)
                self._tables.pop(segment_id, None)
                self._files.pop(segment_id, None)
            self._retry_at.pop(segment_id, None)
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
            self._files.clear()
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


def _sealed(fd: int) -> bool:
    """Whether the file ``fd`` is sealed against shrinking (a memfd's F_SEAL_SHRINK)."""
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEAL_SHRINK)
    except (AttributeError, OSError):
        return False


def _out_of_files(exc: Exception, what: str) -> None:
    """Raise the named error where ``exc`` is this process out of file descriptors: not a reason to forget a
    segment's memory (the next call, with a descriptor free, maps it) nor a fault of the segment's."""
    if isinstance(exc, ResourceExhausted):
        raise exc
    if isinstance(exc, OSError) and exc.errno in NO_FILES:
        raise too_many_open_files(what) from exc
