"""The gather machinery every model family's engine rows share: one layer's table rows into a caller's buffers.

A family's adapter (:class:`engram_model.v41.V41Rows`, :class:`engram_model.ple.PLERows`) checks a call's
arguments and says how its slots are laid out (which id fills which slot, in which form:
:mod:`engram_model._rows_gather_kernels`); :class:`RowGather` does the rest:

* **where the rows are read from.** Where the table's rows are in this host's memory (arrays bound with
  ``bind_local``, ``local_dir`` files, a store's segment mapped here) one kernel gathers them in place, from one
  read-only span over every column's table (:func:`span_of`, rebuilt when the tables move). The span is read
  under the store's checks of a lookup's own read of it (:func:`read_in_place`: a store's table removed or
  written over since the master placed it is not read; the gather goes the staged way, which asks the master).
  Elsewhere (``disk_dir``, a remote segment) the rows are read with ``lookup_into`` into a reused uint8 staging
  buffer, or straight into the caller's buffer where it is the table's rows in order (:meth:`RowGather.staged`).
* **threads.** A gather of at least :data:`THREADED_MIN_ROWS` rows from memory is split over ``threads`` (the
  kernels release the GIL); a decode step's is not.
* **background.** ``submit`` runs a checked call on the adapter's own thread and returns a :class:`RowsHandle`.
* **ids.** :func:`as_ids` takes NumPy arrays and CPU tensors (DLPack) of int32 or int64, without a copy unless
  asked (a background call copies them: the caller may reuse its buffer at once).
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from engram_store import EngramStore, LookupHandle
from engram_store.buffers import host_array
from engram_store.errors import InvalidArgument, InvalidType, describe, is_int
from engram_store.pools import SharedPool, split

from . import _rows_gather_kernels as _k

#: A gather of at least this many rows from memory is split over the adapter's threads.
THREADED_MIN_ROWS = 16384
#: The gathers' threads, one pool per process (grown to the most any adapter asks for).
_POOL = SharedPool("engram-rows")
#: The ``lut`` argument of a raw gather, which reads none.
NO_LUT = np.zeros(256, dtype=np.uint16)
NO_LUT.flags.writeable = False


class RowsHandle(LookupHandle):
    """A gather running in the background: ``wait()`` blocks until the buffers are filled and returns ``out``, or
    raises what the gather raised."""

    def wait(self, timeout: float | None = None) -> Any:
        return self.result(timeout)


def as_ids(ids: Any, ndim: int | None, copy: bool, shape: str = "[T, cols]") -> np.ndarray:
    """The caller's ids as an int32 or int64 C-contiguous array (a copy where ``copy``)."""
    if isinstance(ids, np.ndarray):
        arr = ids
    elif hasattr(ids, "__dlpack__") or hasattr(ids, "__array_interface__"):
        arr = host_array(ids, "ids", writable=False).array
    else:
        raise InvalidType(f"ids: expected an int32 or int64 NumPy array or CPU tensor, got {type(ids).__name__}")
    if arr.dtype not in (np.int32, np.int64):
        raise InvalidType(f"ids: expected dtype int32 or int64, got {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise InvalidArgument(f"ids: expected {ndim} dimensions ({shape}), got shape {list(arr.shape)}")
    return np.array(arr, order="C", copy=True) if copy else np.ascontiguousarray(arr)


def check_threads(threads: Any) -> int:
    """``threads`` for large gathers (None: this host's CPUs, at most 16)."""
    if threads is None:
        return min(16, os.cpu_count() or 1)
    if not is_int(threads) or not 1 <= threads <= 256:
        raise InvalidArgument(f"threads: expected an integer in [1, 256] or None, got {describe(threads)}")
    return int(threads)


def check_table(table: Any, layer_id: int, row_format: str, dim: int, sizes: Sequence[int], build: str) -> list[int]:
    """The columns ``table`` holds of layer ``layer_id``, once it holds them in the layout a family's
    ``build`` (e.g. ``"ple_store_config(config, 2)"``) gives: ``row_format`` rows of ``dim`` items, column c of
    ``sizes[c]`` rows."""
    if not isinstance(table, EngramStore):
        raise InvalidType(f"table: expected the EngramStore of layer {layer_id} ({build}'s layout), got "
                          f"{type(table).__name__}")
    if layer_id not in table.get_layer_ids():
        raise InvalidArgument(f"table: holds layers {table.get_layer_ids()}, not layer {layer_id}")
    heads = table.get_heads(layer=layer_id)
    got = {"row_format": table.get_row_format(layer=layer_id), "embedding_dim": table.get_embedding_dim(layer=layer_id),
           "heads": heads, "table_vocab_sizes": table.get_table_vocab_sizes(layer=layer_id)}
    want = {"row_format": row_format, "embedding_dim": dim, "heads": [h for h in heads if h < len(sizes)],
            "table_vocab_sizes": [int(sizes[h]) if h < len(sizes) else None for h in heads]}
    for name, value in want.items():
        if got[name] != value:
            raise InvalidArgument(f"table: layer {layer_id} has {name}={describe(got[name])}, expected "
                                  f"{describe(value)} (build it with {build})")
    return heads


def read_in_place(table: EngramStore, layer_id: int, read: Callable[[list[np.ndarray]], bool]) -> bool:
    """``read(tables)`` over the layer's tables in this host's memory, under the checks a lookup's own read of them
    passes (``EngramStore.read_local``: a store's mapped segment is checked around the read; the tables are taken
    per call, since a layer populated again moves): what it returns, or False where the tables are not here or
    what it wrote must not be used."""
    return bool(table.read_local(read, layer=layer_id))


class Span(NamedTuple):
    """One read-only view spanning every column's table (the kernels index them as one array): ``bytes`` uint8, row
    g of column c at byte ``delta[c] + g * row_bytes``; ``words`` the same memory as uint64 and ``word_delta`` in
    words, where every table starts and ends on an 8-byte boundary and rows are whole words (None otherwise): rows
    copied a word at a time. Memory between the tables is never touched: every id is checked against the table
    first."""
    bytes: np.ndarray
    delta: np.ndarray
    words: np.ndarray | None
    word_delta: np.ndarray | None


def span_of(tables: list[np.ndarray], heads: list[int], offsets: np.ndarray, row_bytes: int) -> Span:
    """The :class:`Span` over ``tables`` (column ``heads[j]``'s, its rows starting at ``offsets[heads[j]]`` of the
    layer's one table)."""
    lo = min(t.ctypes.data for t in tables)
    hi = max(t.ctypes.data + t.nbytes for t in tables)
    span = np.frombuffer((ctypes.c_uint8 * (hi - lo)).from_address(lo), dtype=np.uint8)
    span.flags.writeable = False
    base = np.zeros(offsets.shape[0] - 1, dtype=np.int64)
    for h, t in zip(heads, tables):
        base[h] = t.ctypes.data - lo
    delta = base - offsets[:-1] * row_bytes  # a column's first byte, less its first row's place
    aligned = row_bytes % 8 == 0 and lo % 8 == 0 and (hi - lo) % 8 == 0 and all(
        t.ctypes.data % 8 == 0 and t.nbytes % 8 == 0 for t in tables)
    words = span.view(np.uint64) if aligned else None
    return Span(span, delta, words, (base // 8 - offsets[:-1] * (row_bytes // 8)) if aligned else None)


def word_view(out: np.ndarray) -> np.ndarray | None:
    """``out`` (uint8 ``[N, row_bytes]``, the last axis contiguous) as uint64 words, where its rows are whole words
    on 8-byte boundaries; else None."""
    if out.shape[1] % 8 or out.strides[1] != 1:
        return None
    words = out.view(np.uint64)
    return words if words.flags.aligned else None  # NumPy's flag: the address and the row stride are whole words


class RowGather:
    """One layer's table read for an adapter (see the module docstring): ``offsets`` int64 ``[cols + 1]`` (column
    c's rows of the layer's one table start at ``offsets[c]``; the last entry is the rows the columns hold),
    ``heads`` the columns ``table`` holds, ``threads`` for large gathers from memory; ``store_dtype`` the items of
    the table's rows as ``lookup_into`` fills them (uint8 bytes, or uint16 for bf16 rows)."""

    def __init__(self, table: EngramStore, layer_id: int, heads: list[int], offsets: np.ndarray, row_bytes: int,
                 threads: int, name: str, store_dtype: Any = np.uint8):
        self.table, self.layer_id, self.heads = table, int(layer_id), list(heads)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        self.offsets.flags.writeable = False
        self.cols = self.offsets.shape[0] - 1
        self.row_bytes, self.threads, self.store_dtype = int(row_bytes), int(threads), np.dtype(store_dtype)
        self.col_head = np.full(self.cols, -1, dtype=np.int64)
        self.col_head[self.heads] = np.arange(len(self.heads))
        self.col_head.flags.writeable = False
        self._staging = np.empty(0, dtype=np.uint8)
        self._staging_lock = threading.Lock()
        self._order: dict[tuple[int, int], bool] = {}  # (first, width) -> _in_order's answer
        self._lock = threading.Lock()
        self._background = SharedPool(name)  # one thread, made on first use
        self._span_of: list | None = None  # the tables the span was built over (kept referenced)
        self._span: Span | None = None
        self._held: tuple[Any, Span] | None = None  # held(): the tables this process holds, while they hold
        self.memory_gathers = 0  # calls gathered from this host's memory in one kernel
        self.staged_gathers = 0  # calls read with lookup_into, then laid out

    def gather(self, from_span: Callable[[Span, Any], None], staged: Callable[[Any], None], call: Any) -> None:
        """``from_span(span, call)`` where the rows are in this host's memory (read in place: tables this process
        holds as they are, a store's checked), else ``staged(call)``."""
        if not self.in_memory(from_span, call):
            staged(call)
            self.staged_gathers += 1

    def in_memory(self, from_span: Callable[[Span, Any], None], call: Any) -> bool:
        """``from_span(span, call)`` where the rows are in this host's memory: over tables this process holds as
        they are (:meth:`held`), over a store's under the checks of :func:`read_in_place`; False where they are not
        here, or what it wrote must not be used."""
        held = self.held()
        if held is not None:
            from_span(held[1], call)
            self.memory_gathers += 1
            return True

        def read(tables: list[np.ndarray]) -> bool:
            if tables is not self._span_of and not all(t.flags.c_contiguous for t in tables):
                return False
            from_span(self._span_over(tables), call)
            return True

        if read_in_place(self.table, self.layer_id, read):
            self.memory_gathers += 1
            return True
        return False

    def held(self) -> tuple[Any, Span] | None:
        """Where the layer's tables are this process's own memory that a read needs no check of
        (``EngramStore.held_tables``: bound arrays, a ``local_dir``'s files), the tables held and their span, kept
        while they hold: a gather reads them with its kernel alone, none of read_local's calls between (each one a
        cold miss or two at a decode step's cadence); else None (a store's mapped segments: every read goes
        through read_local, which checks it)."""
        held = self._held
        if held is not None and held[0].holds():
            return held
        tables = self.table.held_tables(layer=self.layer_id)
        # (every table a source holds is C-contiguous today, a reshape of a flat view: the test is for one that is not)
        if tables is None or not all(t.flags.c_contiguous for t in tables.tables):
            self._held = None
            return None
        held = self._held = (tables, self._span_over(tables.tables))
        return held

    def held_span(self, slots: int) -> tuple[Any, Span] | None:
        """:meth:`held` for a bound buffer's one kernel call a step, where gathers of up to ``slots`` slots run in
        one part; else None."""
        return self.held() if self.one_part(slots) else None

    def one_part(self, n: int) -> bool:
        """Whether a gather of ``n`` slots from memory runs as one call on the calling thread (a decode step)."""
        return self.threads == 1 or n < THREADED_MIN_ROWS

    def _span_over(self, tables: list[np.ndarray]) -> Span:
        with self._lock:
            if self._span_of is not tables:  # the tables moved (or first call): one span over them
                self._span = span_of(tables, self.heads, self.offsets, self.row_bytes)
                self._span_of = tables
            return self._span

    def split_range(self, n: int, work: Callable[[int, int], Any]) -> None:
        """Run ``work(lo, hi)`` over ``range(n)``, split over the threads when the gather is large."""
        if self.one_part(n):  # a decode step: no part for a pool
            work(0, n)
        else:
            split(work, n, self.threads, _POOL)

    def staged(self, ids: np.ndarray, v0: int, v1: int, lay_out: Callable[[np.ndarray, np.ndarray], None],
               straight: np.ndarray | None = None, *, first: int = 0, width: int | None = None,
               n: int | None = None) -> None:
        """Read the rows of the ``n`` slots of flat ``ids`` (slot ``t * width + j``: ``ids[t * cols + first + j]``;
        by default ``ids[i]``) inside ``[v0, v1)`` with the table's ``lookup_into``, then ``lay_out(staged uint8
        [S, row_bytes], src int64 [n])``. ``straight`` (the caller's buffer as the store's dtype, C-contiguous
        ``[n, store_dim]``): read into it directly where every slot's row is its own column's and the table's
        heads are the slots' columns in order, and zero the slots outside the window."""
        width = self.cols if width is None else width
        n = ids.shape[0] if n is None else n
        H, rb = len(self.heads), self.row_bytes
        store_ids, src = _k.plan_window(ids, self.offsets, first, width, n, v0, v1, self.col_head, H)
        M = store_ids.shape[0]
        wanted = store_ids.reshape(1, M, H)
        if straight is not None and M * H == n and H == width and self._in_order(first, width):
            self.table.lookup_into(wanted, straight.reshape(1, M, H, -1), layer=self.layer_id)
            _k.zero_slots(src, straight)
            return
        with self._staging_lock:
            if self._staging.size < M * H * rb:
                self._staging = np.empty(M * H * rb, dtype=np.uint8)
            rows = self._staging[:M * H * rb].reshape(M * H, rb)
            self.table.lookup_into(wanted, rows.view(self.store_dtype).reshape(1, M, H, -1), layer=self.layer_id)
            lay_out(rows, src)

    def _in_order(self, first: int, width: int) -> bool:
        """Whether columns ``first .. first + width`` are the table's heads in order (a window read straight into
        the caller's buffer); asked once a window."""
        found = self._order.get((first, width))
        if found is None:
            found = self._order[(first, width)] = first + width <= self.cols and bool(
                (self.col_head[first:first + width] == np.arange(len(self.heads))).all())
        return found

    def submit(self, run: Callable[[], Any], ids: Any) -> RowsHandle:
        """``run()`` on this gather's own background thread."""
        future: Future = self._background.get(1).submit(run)
        return RowsHandle(future, ids)

    def close(self) -> None:
        """Wait for background gathers and stop their thread."""
        self._background.close()


class RowsAdapter:
    """What a family's adapter (``V41Rows``, ``PLERows``) shares: its :class:`RowGather` (``_gather``), the gathers'
    counts, and its lifetime."""

    _gather: RowGather

    @property
    def memory_gathers(self) -> int:
        """Calls gathered from this host's memory in one kernel."""
        return self._gather.memory_gathers

    @property
    def staged_gathers(self) -> int:
        """Calls read with ``lookup_into``, then laid out."""
        return self._gather.staged_gathers

    def close(self) -> None:
        """Wait for background gathers and stop their thread (the table stays open: it is the caller's)."""
        self._gather.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def warm_kernels() -> None:
    """Compile the gathers' kernels for the dtypes engines pass (int32 and int64 ids; raw, coded, scaled and split
    outputs; the memory and the staged paths), on tiny inputs."""
    offsets = np.array([0, 3, 7], dtype=np.int64)
    lut2 = np.zeros((256, 256), dtype=np.uint16)
    lut2.flags.writeable = False
    for row_bytes, coded in ((4, True), (8, False), (9, False)):
        table = np.zeros((7, row_bytes), dtype=np.uint8)
        span = span_of([table[:3], table[3:]], [0, 1], offsets, row_bytes)
        for dtype in (np.int32, np.int64):
            ids = np.array([0, 4, -1, 6], dtype=dtype)
            _k.first_bad(ids, 7)
            _k.first_bad_window(ids.reshape(2, 2), 7, 0, 2)
            raw = np.empty((4, row_bytes), np.uint8)
            store_ids, src = _k.plan_window(ids, offsets, 0, 2, 4, 0, 7, np.arange(2, dtype=np.int64), 2)
            staged = np.zeros((store_ids.size, row_bytes), np.uint8)
            args = (span.delta, offsets, ids, 0, 2, 0, 7, 0, 4)
            _k.rows_from_span(span.bytes, *args, row_bytes, NO_LUT, raw)
            _k.rows_from_staging(staged, src, NO_LUT, raw)
            checked = (span.delta, offsets, ids, 7, 0, 7)  # (a decode step's one call: ids checked, then rows)
            _k.checked_rows_from_span(span.bytes, *checked, row_bytes, NO_LUT, raw)
            if coded:  # PLE's e4m3 codes as bf16 (its lut is read-only too)
                coded_out = np.empty((4, row_bytes), np.uint16)
                _k.rows_from_span(span.bytes, *args, row_bytes, NO_LUT, coded_out)
                _k.checked_rows_from_span(span.bytes, *checked, row_bytes, NO_LUT, coded_out)
                _k.rows_from_staging(staged, src, NO_LUT, coded_out)
            if row_bytes == 9:  # V4.1's rows: codes and block scales, decoded or split
                scaled, codes, scales = (np.empty((4, 8), np.uint16), np.empty((4, 8), np.uint8),
                                         np.empty((4, 1), np.uint8))
                _k.scaled_from_span(span.bytes, *args, row_bytes, lut2, scaled)
                _k.scaled_from_staging(staged, src, lut2, scaled)
                _k.split_from_span(span.bytes, *args, row_bytes, codes, scales)
                _k.split_from_staging(staged, src, codes, scales)
            if span.words is not None:  # rows copied a word at a time
                _k.rows_from_span(span.words, span.word_delta, *args[1:], row_bytes // 8, NO_LUT,
                                  raw.view(np.uint64))
                _k.checked_rows_from_span(span.words, span.word_delta, *checked[1:], row_bytes // 8, NO_LUT,
                                          raw.view(np.uint64))
            _k.zero_slots(src, raw)
            _k.zero_slots(src, raw.view(np.uint16) if row_bytes % 2 == 0 else raw)
