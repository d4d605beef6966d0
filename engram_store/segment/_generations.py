"""Which put wrote which bytes of a segment, so that a read naming an object that was overwritten gets nothing.

Every write carries a ticket naming its put and the range it may write (see :mod:`._fence`); before the first byte
of a put lands, the segment records the put as the latest writer of that range (:meth:`Generations.claim`), ending
any older entry the range meets. A reader names the objects it expects (place, size, put: see
``engram_store.kernels.check_generations``); the segment checks them before it gathers and again after, so a write
that lands while it gathers is caught too (``version`` changes with every claim). Entries start from the
catalogue at registration (a durable segment's objects outlive it), and objects this segment never learnt of are
not refused: nothing is known to have replaced them. A remove that the segment hears of (the remover tells it at
once, naming each object's put) marks the object's entry removed (:meth:`Generations.drop`), so reads naming it
are refused from then on too.

Entries live in sorted arrays the kernel searches; a claim (once per put and segment) builds new arrays and swaps
them in whole, so readers never lock. Readers on this host that map the segment's bytes read them without asking
the segment: it publishes the same entries in a small table of shared memory, behind a seqlock (see
``engram_store.kernels._generations_table``), which it hands to them with its memory: a memfd sealed against
shrinking, with no name another user could open (see ``._memory``). A durable segment's table is a file beside its
own (``<file>.gen``, its owner's, as the data file is), kept for the next run, which takes it over in place: a reader
still mapping it from before the restart then sees the new run's claims and drops, as it sees the new run's bytes.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading

import numpy as np

from .. import kernels as _kernels
from ..errors import InvalidArgument, StalePlacement, StoreError
from ..kernels import generation_table
from ..durable import DurableDir, HeldDir
from ..pages import reserve
from .._shared_dirs import open_own
from ._memory import anonymous_memory

#: Entries the shared table holds: one per 4 KiB of segment, at least 4,096 and at most 2**20 (24 MiB). A
#: segment holding more objects marks the table overflowed; readers on its host then ask the master.
TABLE_BYTES_PER_ENTRY = 4 << 10
TABLE_MIN, TABLE_MAX = 1 << 12, 1 << 20
SEQ, COUNT, CAPACITY, OVERFLOW, RETIRED = (generation_table.SEQ, generation_table.COUNT, generation_table.CAPACITY,
                                           generation_table.OVERFLOW, generation_table.RETIRED)
HEADER_WORDS, table_words = generation_table.HEADER_WORDS, generation_table.table_words

log = logging.getLogger(__name__)


class Generations:
    """The latest writer of every range this segment knows; thread-safe, readers lock-free. They are published in
    a shared table for readers on this host (``table_fd``): a memfd named ``table_name``, or, for a durable segment,
    the file ``table_path`` beside its data file, kept for its next run, which takes it over in place (a reader that
    still maps it, cut off from the master, then sees what the new run writes over its objects)."""

    def __init__(self, table_name: str | None = None, segment_bytes: int = 0, table_path: str | None = None,
                 directory: HeldDir | None = None) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[int, int]] = {}  # base -> (size, put id), not overlapping
        self.version = 0
        empty = np.zeros(0, dtype=np.int64)
        self.arrays: tuple[np.ndarray, np.ndarray, np.ndarray] = (empty, empty, empty)
        self.table_fd = -1
        self._map: mmap.mmap | None = None
        self._table: np.ndarray | None = None
        if table_name is None and table_path is None:
            return
        capacity = min(TABLE_MAX, max(TABLE_MIN, segment_bytes // TABLE_BYTES_PER_ENTRY))
        nbytes = table_words(capacity) * 8
        try:
            # every page reserved now: none left to fault in (SIGBUS)
            fd = _open_table(table_path, nbytes, table_name or "", directory) if table_path is not None \
                else anonymous_memory(nbytes, table_name or "", "generation table")[0]
            try:
                self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError:
                os.close(fd)
                raise
        except (OSError, StoreError) as exc:
            log.warning("no generation table (%s): readers on this host check their placements with the master "
                        "only", getattr(exc, "strerror", None) or exc)
            return
        self.table_fd = fd
        self._table = table = np.frombuffer(self._map, dtype=np.int64)
        # A table a run of this segment left (a durable one restarted on its file) is taken over in place: a reader
        # on this host that still maps it sees what this run publishes. Its entries are not ours.
        seq = int(table[SEQ]) + 2 & ~1
        table[SEQ] = seq + 1
        table[HEADER_WORDS:] = 0
        table[COUNT], table[OVERFLOW], table[RETIRED], table[CAPACITY] = 0, 0, 0, capacity
        table[SEQ] = seq + 2

    @property
    def table(self) -> np.ndarray | None:
        """The shared table (int64 words), None without one."""
        return self._table

    def close(self) -> None:
        """Unmap and let go of the shared table; a durable segment's file stays for its next run. Readers that
        mapped it keep their mapping, as they keep the segment's memory, which no one writes again either."""
        with self._lock:
            self._table = None
            if self._map is not None:
                try:
                    self._map.close()
                except BufferError:
                    pass  # a reader in this process still holds a view of it: unmapped when that goes
                self._map = None
            if self.table_fd >= 0:
                os.close(self.table_fd)
                self.table_fd = -1

    def claim(self, offset: int, size: int, generation: int) -> None:
        """Put ``generation`` is about to write ``[offset, offset + size)``: it is that range's latest writer."""
        if size <= 0 or generation <= 0 or self._entries.get(offset) == (size, generation):
            return  # the common case: a later write of the same put
        with self._lock:
            if self._entries.get(offset) == (size, -generation):
                return  # a late write of a put whose object was removed: it stays removed
            end = offset + size
            for base, (n, _) in list(self._entries.items()):
                if base < end and offset < base + n:
                    del self._entries[base]
            self._entries[offset] = (size, generation)
            self._publish()

    def drop(self, objects: list[tuple[int, int]]) -> int:
        """Objects removed from here, as ``(offset, generation)``: each that is still that put's object is marked
        removed (its entry keeps its range, with the generation negated), so a read naming it is refused at once,
        as one naming an object written over is; the range's next put replaces the mark. An object this segment
        never learnt of, or that another put has written over, is left as it is. Returns how many were marked."""
        with self._lock:
            marked = 0
            for offset, generation in objects:
                entry = self._entries.get(offset)
                if generation > 0 and entry is not None and entry[1] == generation:
                    self._entries[offset] = (entry[0], -generation)
                    marked += 1
            if marked:
                self._publish()
            return marked

    def holds(self, generation: int, offset: int, size: int) -> bool:
        """Whether put ``generation`` is still the latest writer of ``[offset, offset + size)``."""
        return self._entries.get(offset) == (size, generation)

    def disowns(self, entry) -> bool:
        """Whether the object a master asks about (``[key, offset, size, checksum, generation]``) was removed here,
        or another put has written over it since: its bytes may still match, but it is not that put's object. One
        never learnt of, or named without its put (an older master), is not disowned: its checksum decides."""
        try:
            offset, size, generation = int(entry[1]), int(entry[2]), int(entry[4])
        except (IndexError, TypeError, ValueError):
            return False
        if generation <= 0 or size <= 0 or offset < 0:
            return False
        checks = _kernels.check_pairs_for(np.array([offset], dtype=np.int64), np.array([size], dtype=np.int64),
                                          np.array([generation], dtype=np.int64))
        return _kernels.check_generations(checks, *self.arrays)[1] >= 0

    def seed(self, objects: list) -> None:
        """Learn objects a catalogue names (``[key, offset, size, replica_num, checksum, generation]``), where no
        write this segment saw says otherwise."""
        with self._lock:
            changed = False
            for entry in objects:
                if len(entry) < 6 or not entry[5]:
                    continue
                offset, size, generation = int(entry[1]), int(entry[2]), int(entry[5])
                if size <= 0 or any(b < offset + size and offset < b + n for b, (n, _) in self._entries.items()):
                    continue
                self._entries[offset] = (size, generation)
                changed = True
            if changed:
                self._publish()

    def _publish(self) -> None:
        bases = np.array(sorted(self._entries), dtype=np.int64)
        sizes = np.array([self._entries[b][0] for b in bases.tolist()], dtype=np.int64)
        gens = np.array([self._entries[b][1] for b in bases.tolist()], dtype=np.int64)
        self.arrays = (bases, sizes, gens)
        self.version += 1
        table = self._table
        if table is not None:  # the seqlock: odd while the arrays change (stores are not reordered on x86/arm TSO
            n, cap = bases.size, int(table[CAPACITY])  # for plain memory; see the kernel for the reader's side)
            table[SEQ] += 1
            if n > cap:
                table[OVERFLOW], table[COUNT] = 1, 0
            else:
                h = HEADER_WORDS
                table[h:h + n], table[h + cap:h + cap + n], table[h + 2 * cap:h + 2 * cap + n] = bases, sizes, gens
                table[COUNT], table[OVERFLOW] = n, 0
            table[SEQ] += 1

    def split(self, pairs: np.ndarray, where: str) -> tuple[np.ndarray, int]:
        """The ranges of a read (``pairs`` without its leading checks) and the version they were checked at; raises
        StalePlacement when a named object was overwritten."""
        version, (bases, sizes, gens) = self.version, self.arrays
        rows, bad = _kernels.check_generations(pairs, bases, sizes, gens)
        if rows % 2:
            raise InvalidArgument(f"read_ranges: {rows} leading check pairs, expected an even number (two per "
                                  f"object: (-(offset + 1), put), (-(size + 1), put)) ({where})")
        if bad >= 0:
            raise self._stale(pairs, bad, where)
        return pairs[rows:], version

    def recheck(self, pairs: np.ndarray, version: int, where: str) -> None:
        """After the gather: raise StalePlacement if a put claimed a named object's bytes meanwhile."""
        if self.version == version:
            return
        _, bad = _kernels.check_generations(pairs, *self.arrays)
        if bad >= 0:
            raise self._stale(pairs, bad, where)

    @staticmethod
    def _stale(pairs: np.ndarray, bad: int, where: str) -> StalePlacement:
        base, put = -int(pairs[2 * bad, 0]) - 1, int(pairs[2 * bad, 1])
        size = -int(pairs[2 * bad + 1, 0]) - 1
        return StalePlacement(f"read_ranges: the object of {size} bytes at offset {base} written by put {put} is no "
                              f"longer there: it was removed, or another put has written over it since ({where}); "
                              "ask the master where it is now")


def _open_table(path: str, nbytes: int, name: str, directory: HeldDir | None) -> int:
    """The table file at ``path`` (in ``directory``, held open; opened for the call where None): this user's own,
    never through a link (UnsafeFile otherwise), ``nbytes`` long and its pages reserved, opened read-write: the one
    already there when it has that size (its inode kept, so readers that map it follow this run), else a new one
    (one of another size is retired and unlinked first: truncating it under its readers would kill them with
    SIGBUS). Where no file can be made (a full disk), shared memory named ``name`` serves this run, and nothing is
    left at ``path``."""
    try:
        if directory is not None:
            return _table_file(directory, os.path.basename(path), nbytes)
        with DurableDir(os.path.dirname(os.path.abspath(path)), "generation table") as held:
            return _table_file(held, os.path.basename(path), nbytes)
    except (OSError, StoreError) as exc:
        fd = anonymous_memory(nbytes, name, "generation table")[0]
        log.warning("generation table %s not made (%s): this run's table is shared memory, not kept for the next "
                    "run", path, getattr(exc, "strerror", None) or exc)
        return fd


def _table_file(directory: HeldDir, name: str, nbytes: int) -> int:
    def open_table() -> int:  # nothing removed if refused
        return open_own(name, os.O_RDWR, "generation table", 0o644, dir_fd=directory.fd, create=True)[0]

    fd = open_table()
    try:
        size = os.fstat(fd).st_size
        if size not in (0, nbytes):
            if size >= HEADER_WORDS * 8:
                old = mmap.mmap(fd, HEADER_WORDS * 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                _retire(np.frombuffer(old, dtype=np.int64))
                old.close()
            directory.unlink(name)
            os.close(fd)
            fd = -1
            fd = open_table()
        reserve(fd, nbytes, directory.join(name), "generation table")
        return fd
    except BaseException:
        if fd >= 0:  # ours (a name another user took after the retired one went is never removed here)
            os.close(fd)
            directory.unlink(name)
        raise


def _retire(table: np.ndarray | None) -> None:
    """Mark a table this segment no longer keeps, so that readers that still map it stop trusting it."""
    if table is not None:
        table[SEQ] += 1
        table[RETIRED] = 1
        table[SEQ] += 1
