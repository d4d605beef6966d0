"""The one rule for reading this host's mapped segment memory: every read of it passes :func:`read_mapped`.

A mapping shows whatever the segment holds now, not the object the reader was told about: once that object is
removed and its space given to another put, the mapping shows the other object's bytes, and nothing in them says
so. Two things prove what a mapping holds:

* time: the master keeps a removed object's space unused for its reuse delay, so an answer of the master younger
  than half that delay still names what is there, for a read that ends before that (``fresh_until``): one that
  outlasts it (a thread descheduled on a loaded host) is checked after it, as below;
* the segment's generation table (``kernels.check_table``, a seqlock in shared memory): checked before the read,
  every named object is still the one its put wrote; the table's sequence unchanged after it (or checked again),
  no put claimed a range meanwhile (a put claims its range before its first byte lands).

Whatever proves the bytes, they must be there: a durable segment's memory is a regular file, which no seal keeps
from shrinking, and one cut short while its segment was down kills a read past its end with SIGBUS. So every read,
fresh or not, first checks that each mapped file still holds the bytes it needs (one ``fstat``; sealed memory never
shrinks).

Past ``fresh``, a read whose table cannot tell (none published, overflowed, retired) or names an object that is
gone raises :class:`StalePlacement` and its result is not used: the caller asks the master again, or reads through
the segment, which checks each remote read the same way. The store's lookups (``Placements``), ``V41Rows`` and
``V41Engram`` (through ``EngramStore.read_local``) and this client's own local-direct copies all read mapped memory
through here, so one rule decides whether mapped bytes may be used.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple, Sequence, TypeVar

import numpy as np

from .. import kernels as _kernels
from ..errors import StalePlacement

T = TypeVar("T")

class MappedCheck(NamedTuple):
    """What proves a read of one mapped segment: its generation table (None: it publishes none), the check pairs
    naming the objects the read takes from it (``kernels.check_pairs_for``), and the bytes of the mapping the read
    needs (``end``) with ``shrunk(end)``, whether the mapped file now holds fewer (None: memory that never shrinks)."""
    table: np.ndarray | None
    pairs: np.ndarray
    end: int = 0
    shrunk: Callable[[int], bool] | None = None


#: The checks of a read, one per mapped segment it reads.
Checks = Sequence[MappedCheck]


def read_mapped(read: Callable[[], T], checks: Checks, fresh_until: float, what: str) -> T:
    """``read()``, whose result may be used: as it is where it ends before ``fresh_until`` (``time.monotonic()``
    half the reuse delay after the master's answer was asked for; 0: not fresh), else between a check of every
    table in ``checks`` and a recheck (see the module docstring). A fresh read that outlasts its proof is checked
    after it: an object still named in its table then was never written over (a put claims its range, and a remove
    drops its name, before anything else lands there). Raises StalePlacement, naming ``what`` (the layer or object
    read), where a check fails; the caller must then drop what ``read`` wrote. An error ``read`` raised stands only
    where the recheck holds (an error about bytes another put wrote is no error of these tables). A mapped file
    shorter than the read needs raises StalePlacement before anything is read."""
    for check in checks:
        if check.shrunk is not None and check.shrunk(check.end):
            raise StalePlacement(f"{what}: the file of a segment mapped on this host is shorter than the {check.end} "
                                 "bytes the read needs (cut short while its segment was down); read through the "
                                 "segment")
    if time.monotonic() < fresh_until:
        try:
            return read()
        finally:
            if time.monotonic() >= fresh_until:
                for check in checks:
                    _check(check.table, check.pairs, what)
    seqs = [_check(check.table, check.pairs, what) for check in checks]
    try:
        return read()
    finally:
        for check, seq in zip(checks, seqs):
            if check.table[_kernels.generation_table.SEQ] != seq:  # a put claimed a range meanwhile: still there?
                _check(check.table, check.pairs, what)


def _check(table: np.ndarray | None, pairs: np.ndarray, what: str) -> int:
    """The table's sequence once every object ``pairs`` names holds there; StalePlacement otherwise."""
    if table is None or not pairs.size:
        raise StalePlacement(f"{what}: the master's answer is too old to prove what a table mapped on this host "
                             "holds, and nothing here can (its segment publishes no generation table, or the "
                             "master named no put)")
    bad, seq = _kernels.check_table(table, pairs)
    if bad == _kernels.TABLE_UNKNOWN:
        raise StalePlacement(f"{what}: the master's answer is too old to prove what a table mapped on this host "
                             "holds, and its segment's generation table cannot tell (too many objects)")
    if bad >= 0:
        raise StalePlacement(f"{what}: a table mapped on this host (offset {-int(pairs[2 * bad, 0]) - 1}, put "
                             f"{int(pairs[2 * bad, 1])}) has been removed, or written over by another put, since "
                             "the master said where it is")
    return seq


def object_checks(table: np.ndarray | None, offset: int, size: int, generation: int,
                  shrunk: Callable[[int], bool] | None = None) -> Checks:
    """The checks of one object mapped here (its place, size and the put that wrote it; ``shrunk``: its mapped
    file's probe), as :func:`read_mapped` takes them (a generation of 0, unknown, names nothing: such an object is
    proven by time alone)."""
    return (MappedCheck(table, _kernels.check_pairs_for(np.array([offset], np.int64), np.array([size], np.int64),
                                                        np.array([generation], np.int64)), offset + size, shrunk),)
