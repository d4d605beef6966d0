"""Which put wrote which bytes of a segment, so that a read naming an object that was overwritten gets nothing.

Every write carries a ticket naming its put and the range it may write (see :mod:`._fence`); before the first byte
of a put lands, the segment records the put as the latest writer of that range (:meth:`Generations.claim`), ending
any older entry the range meets. A reader names the objects it expects (place, size, put: see
``engram_store.kernels.check_generations``); the segment checks them before it gathers and again after, so a write
that lands while it gathers is caught too (``version`` changes with every claim). Entries start from the
catalogue at registration (a durable segment's objects outlive it), and objects this segment never learnt of are
not refused: nothing is known to have replaced them.

Entries live in sorted arrays the kernel searches; a claim (once per put and segment) builds new arrays and swaps
them in whole, so readers never lock.
"""

from __future__ import annotations

import threading

import numpy as np

from .. import kernels as _kernels
from .._errors import InvalidArgument, StalePlacement


class Generations:
    """The latest writer of every range this segment knows; thread-safe, readers lock-free."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[int, int]] = {}  # base -> (size, put id), not overlapping
        self.version = 0
        empty = np.zeros(0, dtype=np.int64)
        self.arrays: tuple[np.ndarray, np.ndarray, np.ndarray] = (empty, empty, empty)

    def claim(self, offset: int, size: int, generation: int) -> None:
        """Put ``generation`` is about to write ``[offset, offset + size)``: it is that range's latest writer."""
        if size <= 0 or generation <= 0 or self._entries.get(offset) == (size, generation):
            return  # the common case: a later write of the same put
        with self._lock:
            end = offset + size
            for base, (n, _) in list(self._entries.items()):
                if base < end and offset < base + n:
                    del self._entries[base]
            self._entries[offset] = (size, generation)
            self._publish()

    def holds(self, generation: int, offset: int, size: int) -> bool:
        """Whether put ``generation`` is still the latest writer of ``[offset, offset + size)``."""
        return self._entries.get(offset) == (size, generation)

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
                              f"longer there: another put has written over it since ({where}); ask the master "
                              "where it is now")
