"""Where a layer's rows come from: the interface every row source implements, and the in-memory gather they share.

An :class:`~engram_store.EngramStore` holds one :class:`Source`; the facade validates arguments and hands the
source what is left: populate checked tables, read checked ids into checked output bytes, remove, verify. The
sources, one module each:

* ``_source_memory``: in-process arrays (``bind_local``) and files under ``local_dir`` mapped read-only;
* ``_source_store``: this project's ``DistributedStore`` (segments mapped on this host or read over the network);
* ``_source_mooncake``: a real ``mooncake.store.MooncakeDistributedStore``;
* ``_source_disk``: page-aligned files on local SSD (``disk_dir``), read behind a hot-row cache.

A new place for tables is a new subclass in a module of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from .. import kernels as _kernels
from ..errors import InvalidArgument, NotConnected, StoreError, TableClosed
from ..progress import Progress
from ..pools import SharedPool, split
from ._layout import Layer

#: A local gather of at least this many rows is split over the store's ``threads``.
THREADED_MIN_ROWS = 16384
#: Tables larger than this (all heads together) show a progress bar while they are written.
PROGRESS_MIN_BYTES = 256 << 20

class Job(NamedTuple):
    """A read job: rows of one layer for validated ids, into an output's bytes."""
    source: Any        # the Source that owns the layer
    layer: Layer
    ids: np.ndarray    # int64 [M, H]: the lookup's row_ids, checked against the layer's table sizes (unless
                       # ``row_ids`` is set)
    out: np.ndarray    # the output's flat uint8 bytes, [M, H, row_bytes] as laid out
    # The lookup's row_ids ([B, L, H], of which ``ids`` is the [M, H] view) while their range is still to be checked
    # (a Source that checks ids as it reads them, ``checks_ids``, checks them before anything else reads them),
    # else None.
    row_ids: np.ndarray | None = None


class Source:
    """The tables of one EngramStore's layers: where they live and how rows come out of them.

    The base class is an EngramStore with nowhere to read from (no store, no directory): getters work, and
    everything that needs tables says what to pass instead.
    """

    #: Sources with equal keys (not None) read their jobs together: one :meth:`read` for all of them.
    batch_key: Any = None
    #: How ``repr`` names where the tables are.
    where = "None"
    #: The directory of tables in files on this host (``local_dir=``, ``disk_dir=``), else None.
    local_dir: str | None = None
    disk_dir: str | None = None
    #: Whether :meth:`read` of one lookup's job checks the ids' range itself (``Job.row_ids``): a read that
    #: checks them as it builds its request saves a kernel call (~10 us at a model step's cadence, caches cold).
    checks_ids = False
    #: Whether :meth:`populate` takes ``fill(start_row, out)`` functions in place of tables (files on this host).
    streams = False

    def __init__(self, threads: int = 1):
        self.threads = threads

    def attach(self, lay: Layer) -> None:
        """Prepare a layer of the EngramStore (called once per layer when the EngramStore is built)."""

    def ready(self, lay: Layer, what: str) -> None:
        """Raise unless the layer has tables to read (``what`` names the call, for the message)."""
        raise NotConnected(f"{what}: layer {lay.layer_id} has no tables to read: this EngramStore was built without "
                           "a store (store=None); pass a DistributedStore or MooncakeDistributedStore, bind the "
                           "layer's tables with bind_local(), or use local_dir= or disk_dir=")

    def unsupported(self, lay: Layer, what: str) -> NotConnected:
        return NotConnected(f"{what}: this EngramStore for layer {lay.layer_id} was built without a store "
                            "(store=None); pass a DistributedStore or MooncakeDistributedStore, or local_dir= or "
                            "disk_dir= for tables in files on this host")

    def populate(self, lay: Layer, tables: list[np.ndarray], replica_num: int) -> None:
        """Write the layer's (this store's heads') tables, create-only and all-or-nothing."""
        raise self.unsupported(lay, "populate")

    def bind(self, lay: Layer, tables: list[np.ndarray], keep: list) -> None:
        raise InvalidArgument(f"bind_local: layer {lay.layer_id} of this EngramStore is read from {self.where}; "
                              "bind_local is for an EngramStore built with store=None and no local_dir")

    def remove(self, lay: Layer, force: bool) -> int:
        """Remove this store's heads of the layer; how many were removed."""
        raise self.unsupported(lay, "remove_from_store")

    def undo_populate(self, lay: Layer) -> int:
        """Remove what this store's last populate of the layer wrote, and nothing written since; heads removed."""
        raise InvalidArgument(f"undo_populate: layer {lay.layer_id} of this EngramStore is not kept in a store: "
                              "undo_populate takes back heads populated into a DistributedStore or a Mooncake store "
                              "(tables under local_dir or disk_dir are published whole; remove_from_store removes "
                              "them)")

    def verify(self, lay: Layer) -> list[int]:
        """Check this store's heads of the layer against their recorded checksums; the heads checked."""
        raise self.unsupported(lay, "verify")

    def read(self, jobs: list[Job]) -> None:
        """Fill each job's output with its rows and count the lookup (jobs of sources sharing this batch key)."""
        raise NotImplementedError

    def express(self, lay: Layer, row_ids: Any, out: Any) -> Any:
        """A lookup of one layer by the shortest path there is, or None where it takes the general one (the ids'
        or ``out``'s type or shape, or the source's state): then :meth:`read` reads it, with every check and error.
        ``out``: the caller's buffer, else None (a new array is returned)."""
        return None

    def inline(self, lay: Layer, rows: int) -> bool:
        """Whether a read of ``rows`` rows is cheaper in the caller's thread than handed to a background one."""
        return False

    def local_tables(self, lay: Layer) -> list[np.ndarray] | None:
        """Each head's table as a read-only ``[N_h, row_bytes]`` view of this host's memory, or None."""
        return None

    def held_tables(self, lay: Layer) -> "HeldTables | None":
        """The layer's tables where they are this process's own memory and reading them needs no check (see
        :class:`HeldTables`); None here (a store's mapped segments: every read of them is checked)."""
        return None

    def read_local(self, lay: Layer, read: Callable[[list[np.ndarray]], bool]) -> bool:
        """``read(tables)`` over :meth:`local_tables`, under the checks the source's own reads of them pass: what it
        returns, or False where it did not run or its result must not be used. Here (arrays bound in this process,
        files the source opened): nothing to check; a store's tables pass the generation checks (StoreSource)."""
        tables = self.local_tables(lay)
        return False if tables is None else read(tables)

    def stats(self, lay: Layer, reset: bool) -> dict[str, int]:
        """Counters the source keeps itself, added to the layer's :class:`LookupCounters`."""
        return {}

    def finish_stats(self, total: dict[str, Any], layers: list[Layer], reset: bool) -> dict[str, Any]:
        """``EngramStore.stats()`` of ``layers`` once their counters are summed: what is not a sum (a cache's own
        counters, hit rates) is added here."""
        return total

    def closing(self) -> None:
        """The EngramStore is closing (its background reads are done; :meth:`detach` of every layer follows): from
        now on, sources of tables on this host refuse reads and opens with TableClosed."""

    def detach(self, lay: Layer) -> None:
        """Let go of what the source holds for a layer (the EngramStore is closing)."""
        with lay.lock:
            lay.state = None

    def close(self) -> None:
        """Release what the source holds beyond its layers (after every layer was detached)."""


class HeldTables:
    """A layer's tables in this process's memory that a read needs no check of (arrays bound with ``bind_local``,
    a ``local_dir``'s mapped files), taken once: ``tables`` as :meth:`Source.local_tables` gives them, and
    :meth:`holds`, whether they are still the layer's (its EngramStore not closed, the layer not reopened). A read
    that begins while they hold may read them to its end while it keeps this object: it holds the state that holds
    the memory (a close meanwhile unmaps files only once nothing views them). What a decode step's gather calls
    instead of :meth:`Source.read_local`: one attribute test, not a chain of calls."""

    __slots__ = ("tables", "_lay", "_state", "_source")

    def __init__(self, tables: list[np.ndarray], lay: Layer, state: Any, source: Any):
        self.tables, self._lay, self._state, self._source = tables, lay, state, source

    def holds(self) -> bool:
        return self._lay.state is self._state and not self._source.closed


def closed_error(lay: Layer, what: str) -> TableClosed:
    """What a read (``what``) of a layer of a closed EngramStore raises."""
    return TableClosed(f"{what}: layer {lay.layer_id}: this EngramStore is closed; open a new one to read it")


def state_of(lay: Layer, what: str) -> Any:
    """The layer's state, taken once for a whole read (a read holds what it reads until it ends, however the
    EngramStore is closed meanwhile); TableClosed where it is gone (closed, or removed, since the read was
    planned)."""
    state = lay.state
    if state is None:
        raise TableClosed(f"{what}: layer {lay.layer_id} was closed (the EngramStore closed, or the layer removed) "
                          "while this read was planned")
    return state


@dataclass
class InMemory:
    """Tables of a layer readable in this host's memory: kernel row sources over them, and each head's view."""

    sources: list                               # kernels.RowSource per group of tables close together
    tables: dict = field(default_factory=dict)  # head index j -> flat read-only uint8 view of its table
    keep: list = field(default_factory=list)    # what must stay alive while the sources are used
    _views: list | None = field(default=None, repr=False)  # views(): built once

    @classmethod
    def of(cls, lay: Layer, tables: Sequence[tuple[int, np.ndarray]], keep: list = ()) -> "InMemory":
        """From ``(head index, flat uint8 table)`` pairs of ``lay``."""
        from ._local_dir import sources_for

        return cls(sources_for(list(tables), lay.num_heads, lay.row_bytes) if tables else [],
                   {j: _kernels.readonly(t) for j, t in tables}, list(keep) + [t for _, t in tables])

    @property
    def heads(self) -> int:
        return sum(int(source.heads.size) for source in self.sources)

    def views(self, lay: Layer) -> list[np.ndarray] | None:
        """Each head's ``[N_h, row_bytes]`` view, the same list on every call (kernels that read the tables in
        place may key what they derive from them on its identity); None unless every head is here."""
        if len(self.tables) != lay.num_heads:
            return None
        if self._views is None:
            self._views = [self.tables[j].reshape(n, lay.row_bytes) for j, n in enumerate(lay.sizes)]
        return self._views


def gather(lay: Layer, memory: InMemory, ids: np.ndarray, flat: np.ndarray, threads: int = 1) -> None:
    """Gather the rows of every head in ``memory`` from this host's memory into ``flat``; a gather of at least
    THREADED_MIN_ROWS rows is split over ``threads`` threads (the kernel releases the GIL)."""
    M = ids.shape[0]
    threads = threads if M * lay.num_heads >= THREADED_MIN_ROWS else 1
    for source in memory.sources:
        if flat.ctypes.data % (1 << source.shift):  # a caller's buffer aligned to fewer bytes
            source = _kernels.narrower(source, _kernels.word_shift(flat.ctypes.data))
        if threads == 1:  # a decode step: no part for a pool
            bad = _kernels.gather_rows(source, ids, flat)
        else:
            bad = max(split(lambda lo, hi: _kernels.gather_rows(source, ids, flat, lo, hi), M, threads,
                            _GATHER_POOL))
        if bad >= 0:
            raise StoreError(f"layer {lay.layer_id}: a row lies outside its mapped tables; the stored layer "
                             "does not match this configuration")


def progress(lay: Layer, tables: Sequence[Any]) -> Progress:
    """The progress bar of a populate: shown for layers above PROGRESS_MIN_BYTES (where stderr is a terminal)."""
    total = sum(n * lay.row_bytes for n in lay.sizes[:len(tables)])
    return Progress(total, f"populate layer {lay.layer_id}", enabled=None if total > PROGRESS_MIN_BYTES else False)


_GATHER_POOL = SharedPool("engram-gather")
