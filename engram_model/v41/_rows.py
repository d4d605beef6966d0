"""V41Rows: a V4.1 Engram layer's table rows, gathered into a serving engine's own buffers in its conventions.

SGLang and vLLM keep the two layers' tables (about 200 GB of 264-byte FP8 rows) in host memory and gather rows per
step. ``V41Rows`` gives them the same rows from any engram table (a store, ``local_dir`` files, ``disk_dir`` on SSD
behind a process or host-wide cache), with the engines' id convention and buffers::

    rows = V41Rows(table, config, layer_id)        # table: the layer's EngramStore (or a head shard of it)
    rows.gather_into(ids, out)                     # out's dtype and shape choose the form, as vLLM's lookup does
    rows.gather_into(ids, codes, scales_out=scales)
    handle = rows.gather_into(ids, out, background=True); handle.wait()

Ids are what the engines' hashers give: rows of the layer's one table (per-column offsets added, as
:class:`V41Hasher`, vLLM's ``NgramHashState`` and SGLang's ``compute_engram_hash_ids``), int32 or int64, NumPy or a
CPU tensor (DLPack), ``-1`` for padding (vLLM's ``DEAD_ID``). The forms (:mod:`._rows_kernels` has the details):

=========  ========================  ===================================================  ==========================
form       ids                       out                                                  as
=========  ========================  ===================================================  ==========================
bf16       ``[T, cols]``             ``[T, part, head_dim]`` bf16 (torch, ml_dtypes, or   vLLM 0.33's
                                     uint16 bits)                                         ``ParallelEngramEmbedding
                                                                                          .lookup``
packed     ``[T, cols]``             uint8 ``[T, part, row_bytes]``                       vLLM's packed lookup
split      ``[N]`` (any shape)       ``codes [N, head_dim]`` uint8 / float8_e4m3fn and    SGLang 0.5.23's
                                     ``scales_out [N, head_dim // 32]`` uint8             ``EngramRowStager._gather``
=========  ========================  ===================================================  ==========================

``part`` is ``cols`` for a whole layer, or a head shard's ``part_n_hash_cols`` with ``head_start=`` (vLLM's tensor
parallel shards): slots past the last column, ``-1`` and ids outside the shard's rows give zeros. An id that is in
no row of the layer's table (nor -1) is refused: the engines would read zeros or fault; engram names it.

Where the table's rows are in this host's memory (:meth:`EngramStore.local_tables`: ``local_dir``, a store's
segment mapped here, arrays bound with ``bind_local``) one kernel gathers them into ``out`` and, for bf16, decodes
them on the way. Elsewhere (a remote segment, ``disk_dir``) the rows are read with ``lookup_into`` into a reused
uint8 staging buffer (straight into ``out`` for the packed form where it can) and rearranged or decoded from there.
No float32 array is made on either path.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import Future
from typing import Any, NamedTuple

import numpy as np

from engram_store import EngramStore, LookupHandle
from engram_store.errors import InvalidArgument, InvalidType, describe, is_int
from engram_store.buffers import host_array
from engram_store.pools import SharedPool, split

from . import _rows_kernels as _k
from ._config import V41Config
from ._fp8 import ENGINE_BF16_TABLE

#: A gather of at least this many rows from memory is split over ``threads`` threads (the kernels release the GIL).
THREADED_MIN_ROWS = 16384
_ID_DTYPES = frozenset((np.dtype(np.int32), np.dtype(np.int64)))  # dtypes: a set look-up, not two conversions


class RowsHandle(LookupHandle):
    """A :meth:`V41Rows.gather_into` running in the background: ``wait()`` blocks until the buffers are filled and
    returns ``out``, or raises what the gather raised."""

    def wait(self, timeout: float | None = None) -> Any:
        return self.result(timeout)


class _Call(NamedTuple):
    """A checked gather: what to read, and into what."""
    form: str                  # "bf16", "packed" or "split"
    ids: np.ndarray            # int32/int64 [T, cols] or [N]
    out: np.ndarray            # uint16 / uint8 [T, part, width], or codes uint8 [N, head_dim]
    scales: np.ndarray | None  # split: uint8 [N, head_dim // 32]
    head_start: int
    result: Any                # what the call returns: the caller's out


class V41Rows:
    """Rows of layer ``layer_id``'s table for a serving engine (see the module docstring).

    ``table``: an :class:`EngramStore` holding the layer with :func:`v41_store_config`'s layout, or a head shard of
    it (``EngramStore(..., heads=...)``: a tensor-parallel rank's columns). ``threads``: threads for large gathers
    from memory (default: this host's CPUs, at most 16).
    """

    def __init__(self, table: EngramStore, config: V41Config, layer_id: int, *, threads: int | None = None):
        if not isinstance(config, V41Config):
            raise InvalidType(f"config: expected a V41Config, got {type(config).__name__}")
        self.config = config
        self.layer_id = int(config.layer_ids[config.layer_index(layer_id)])
        if threads is None:
            threads = min(16, os.cpu_count() or 1)
        if not is_int(threads) or not 1 <= threads <= 256:
            raise InvalidArgument(f"threads: expected an integer in [1, 256] or None, got {describe(threads)}")
        self.threads = int(threads)
        self.heads = _check_table(table, config, self.layer_id)
        self.table = table
        cols = config.cols
        self.row_bytes = config.row_bytes  # (a property that builds a RowFormat: read once)
        self.offsets = np.append(config.offsets(self.layer_id), config.num_embeddings(self.layer_id)).astype(np.int64)
        self.col_head = np.full(cols, -1, dtype=np.int64)
        self.col_head[self.heads] = np.arange(len(self.heads))
        self._staging = np.empty(0, dtype=np.uint8)
        self._staging_lock = threading.Lock()
        self._lock = threading.Lock()
        self._background = SharedPool(f"v41-rows-l{self.layer_id}")  # one thread, made on first use
        self._span_of: list | None = None  # the local_tables() list the span was built over (kept referenced)
        self._span: tuple[np.ndarray, np.ndarray] | None = None
        self._covered: set[tuple[int, int]] = set()  # (head_start, part) windows whose columns the table holds
        self.memory_gathers = 0  # calls gathered from this host's memory in one kernel
        self.staged_gathers = 0  # calls read with lookup_into, then rearranged or decoded

    # ---- the call ---------------------------------------------------------------------------------

    def gather_into(self, ids: Any, out: Any, *, scales_out: Any = None, head_start: int = 0,
                    background: bool = False) -> Any:
        """Fill ``out`` (and ``scales_out``, for the split form) with the rows of ``ids``; returns ``out``, or with
        ``background=True`` a :class:`RowsHandle` at once (the arguments are checked before it returns; ``ids``
        are copied, ``out`` is written in the background: do not read it before ``wait()``).

        A refused call raises naming the argument, what was expected and what came, and writes nothing. A read
        that fails (a segment or disk fault) raises the store's error and may leave ``out`` partly written.
        """
        call = self._check(ids, out, scales_out, head_start, copy_ids=bool(background))
        if not background:
            self._run(call)
            return call.result
        future: Future = self._background.get(1).submit(self._run, call)
        return RowsHandle(future, ids)

    def _check(self, ids: Any, out: Any, scales_out: Any, head_start: Any, copy_ids: bool) -> _Call:
        cfg = self.config
        if scales_out is not None:
            return self._check_split(ids, out, scales_out, head_start, copy_ids)
        view = host_array(out, "out")
        arr, kind = view.array, view.dtype
        form = {"uint8": "packed", "bfloat16": "bf16", "uint16": "bf16"}.get(kind)
        width = cfg.row_bytes if form == "packed" else cfg.head_dim
        if form is None or arr.ndim != 3 or arr.shape[2] != width or arr.strides[2] != arr.itemsize:
            raise InvalidArgument(
                f"out: expected a bf16 [T, part, {cfg.head_dim}] buffer (torch.bfloat16, ml_dtypes.bfloat16 or uint16 "
                f"bits), a uint8 [T, part, {cfg.row_bytes}] buffer (packed rows), or codes with scales_out= (split "
                f"rows), with the last axis contiguous; got {kind} {list(arr.shape)}")
        if not is_int(head_start) or not 0 <= head_start < cfg.cols:
            raise InvalidArgument(f"head_start: expected a column index in [0, {cfg.cols}), got "
                                  f"{describe(head_start)}")
        ids_arr = _as_ids(ids, 2, copy_ids)
        T, part = arr.shape[0], arr.shape[1]
        if ids_arr.shape != (T, cfg.cols) or part == 0:
            raise InvalidArgument(f"ids: expected [T, cols] = [{T}, {cfg.cols}] (T from out {list(arr.shape)}, "
                                  f"part >= 1), got {list(ids_arr.shape)}")
        self._check_columns(int(head_start), part)
        bad = _k.first_bad_window(ids_arr, self.offsets, int(head_start), part)
        if bad >= 0:
            t, c = divmod(int(bad), cfg.cols)
            raise InvalidArgument(self._bad_id(f"ids[{t}, {c}]", int(ids_arr[t, c])))
        return _Call(form, ids_arr, arr, None, int(head_start), out)

    def _check_split(self, ids: Any, codes: Any, scales_out: Any, head_start: Any, copy_ids: bool) -> _Call:
        cfg = self.config
        if head_start != 0:
            raise InvalidArgument(f"head_start: the split form reads flat ids of the whole table; expected 0, got "
                                  f"{describe(head_start)}")
        c_view, s_view = host_array(codes, "out"), host_array(scales_out, "scales_out")
        c, s = c_view.array, s_view.array
        ids_arr = _as_ids(ids, None, copy_ids).reshape(-1)
        N = ids_arr.shape[0]
        if c.dtype != np.uint8 or c.shape != (N, cfg.head_dim) or c.strides[1] != 1:
            raise InvalidArgument(f"out: expected the codes of the split form, uint8 or float8_e4m3fn [N, head_dim] "
                                  f"= [{N}, {cfg.head_dim}] (N = ids.size) with rows contiguous, got {c_view.dtype} "
                                  f"{list(c.shape)}")
        nblk = cfg.head_dim // _k.BLOCK
        if s.dtype != np.uint8 or s.shape != (N, nblk) or s.strides[1] != 1:
            raise InvalidArgument(f"scales_out: expected uint8 (e8m0 bytes) [N, head_dim // 32] = [{N}, {nblk}] with "
                                  f"rows contiguous, got {s_view.dtype} {list(s.shape)}")
        if N == 0:
            raise InvalidArgument("ids: expected at least one id, got none")
        self._check_columns(0, cfg.cols)
        bad = _k.first_bad_flat(ids_arr, self.offsets)
        if bad >= 0:
            raise InvalidArgument(self._bad_id(f"ids.flat[{int(bad)}]", int(ids_arr[bad])))
        return _Call("split", ids_arr, c, s, 0, codes)

    def _check_columns(self, head_start: int, part: int) -> None:
        if (head_start, part) in self._covered:
            return
        need = range(head_start, min(head_start + part, self.config.cols))
        missing = [c for c in need if self.col_head[c] < 0]
        if missing:
            raise InvalidArgument(f"head_start, out: columns {need.start}..{need.stop - 1} of layer {self.layer_id} "
                                  f"are read, but this table holds columns {self.heads} (missing {missing}); open "
                                  f"the table with heads= covering the shard")
        self._covered.add((head_start, part))

    def _bad_id(self, where: str, value: int) -> str:
        total = int(self.offsets[-1])
        return (f"{where} = {value} is no row of layer {self.layer_id}'s table (expected -1 for padding or "
                f"0 <= id < {total}: rows of the layer's one table, column offsets added, as the engines' hashers "
                "and V41Hasher give them)")

    # ---- the gather -------------------------------------------------------------------------------

    def _run(self, call: _Call, straight: bool | None = None) -> Any:
        # Per call: a layer populated again moves. The tables are read under the checks of a lookup's own read of
        # them (read_local); a table of a store written over meanwhile is read the staged way, which asks again.
        # ``straight``: what _straight says of the call but for its rows (known once for a bound buffer).
        if self.table.read_local(lambda tables: self._from_mapped(call, tables), layer=self.layer_id):
            self.memory_gathers += 1
        else:
            self._staged(call, straight)
            self.staged_gathers += 1
        return call.result

    def _from_mapped(self, call: _Call, tables: list[np.ndarray]) -> bool:
        # (redundant today: local_tables gives C-contiguous views of flat tables; kept for a source that would not)
        if tables is not self._span_of and not all(t.flags.c_contiguous for t in tables):
            return False
        self._from_memory(call, tables)
        return True

    def _from_memory(self, call: _Call, tables: list[np.ndarray]) -> None:
        with self._lock:
            if self._span_of is not tables:  # the tables moved (or first call): one span over them
                self._span = _span(tables, self.heads, self.config.cols)
                self._span_of = tables
            span, base = self._span
        if call.form == "split":
            self._split_range(call.ids.shape[0], lambda a, b: _k.split_from_span(
                span, base, self.offsets, call.ids, a, b, call.out, call.scales))
            return
        T, part = call.out.shape[0], call.out.shape[1]
        self._split_range(T, lambda a, b: _k.window_from_span(
            span, base, self.offsets, call.ids, call.head_start, a, b, self.row_bytes, ENGINE_BF16_TABLE,
            call.out), rows_per_item=part)

    def _split_range(self, n: int, work, rows_per_item: int = 1) -> None:
        """Run ``work(lo, hi)`` over ``range(n)``, split over the threads when the gather is large."""
        if self.threads == 1 or n * rows_per_item < THREADED_MIN_ROWS:  # a decode step: no part for a pool
            work(0, n)
        else:
            split(work, n, self.threads, _POOL)

    def _staged(self, call: _Call, straight: bool | None = None) -> None:
        """Read the rows with the table's lookup_into (remote segments, disk), then lay them out."""
        H, rb = len(self.heads), self.row_bytes
        if call.form == "split":
            store_ids, src = _k.plan_flat(call.ids, self.offsets, self.col_head, H)
        else:
            store_ids, src = _k.plan_window(call.ids, self.offsets, call.head_start, call.out.shape[1],
                                            self.col_head, H)
        M = store_ids.shape[0]
        wanted = store_ids.reshape(1, M, H)
        if straight is None:
            straight = call.form == "packed" and self._straight(call)
        if call.form == "packed" and straight and M == call.out.shape[0]:
            self.table.lookup_into(wanted, call.out.reshape(1, M, H, rb), layer=self.layer_id)
            _k.zero_slots(src, call.out)
            return
        with self._staging_lock:
            if self._staging.size < M * H * rb:
                self._staging = np.empty(M * H * rb, dtype=np.uint8)
            staged = self._staging[:M * H * rb].reshape(M * H, rb)
            self.table.lookup_into(wanted, staged.reshape(1, M, H, rb), layer=self.layer_id)
            if call.form == "split":
                _k.split_from_staging(staged, src, call.out, call.scales)
            else:
                _k.window_from_staging(staged, src, ENGINE_BF16_TABLE, call.out)

    def _straight(self, call: _Call) -> bool:
        """Whether a packed read can land in ``out`` itself: out is C-contiguous, its slots are the table's heads
        in order; and then, if every row stays in its slot (no id of another column: the plan reads T rows)."""
        part = call.out.shape[1]
        if part != len(self.heads) or call.head_start + part > self.config.cols:
            return False
        in_order = self.col_head[call.head_start:call.head_start + part] == np.arange(part)
        return bool(in_order.all()) and call.out.flags.c_contiguous

    # ---- a decode step's entry point -------------------------------------------------------------

    def bind(self, out: Any, *, head_start: int = 0) -> "BoundRows":
        """``out`` (a bf16 or packed ``[max_T, part, width]`` buffer: an engine's pinned staging) checked once, for
        gathers of up to ``max_T`` tokens at a decode step's cadence: ``bound(ids)`` fills ``out[:T]`` with the
        rows of ``ids [T, cols]`` as ``gather_into`` would, checking only the ids (a few microseconds less per
        call: the buffer's checks and views are not redone)."""
        cfg = self.config
        probe = np.full((1, cfg.cols), -1, dtype=np.int64)
        view = host_array(out, "out")
        if view.array.ndim != 3 or view.array.shape[0] < 1:
            raise InvalidArgument(f"out: expected a [max_T, part, width] buffer, got {list(view.array.shape)}")
        call = self._check(probe, view.array[:1], None, head_start, copy_ids=False)
        bound = BoundRows(self, call.form, view.array, int(head_start), out)
        bound.straight = call.form == "packed" and self._straight(call._replace(out=view.array))
        return bound

    # ---- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for background gathers and stop their thread (the table stays open: it is the caller's)."""
        self._background.close()

    def __enter__(self) -> "V41Rows":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"V41Rows(layer_id={self.layer_id}, columns={self.heads[0]}..{self.heads[-1]}, "
                f"row_bytes={self.config.row_bytes}, table={self.table!r})")


class BoundRows:
    """:meth:`V41Rows.bind`'s gathers into one checked buffer (``array``: its host view; ``out``: the caller's)."""

    def __init__(self, rows: V41Rows, form: str, array: np.ndarray, head_start: int, out: Any):
        self.rows, self.form, self.array, self.head_start, self.out = rows, form, array, head_start, out
        self.part, self.max_t, self.cols = array.shape[1], array.shape[0], rows.config.cols
        self.straight: bool | None = None  # _straight of every call but for its rows (a view of a C-contiguous
        # buffer along its first axis is C-contiguous)

    def __call__(self, ids: Any) -> Any:
        """Fill ``out[:T]`` with the rows of ``ids [T, cols]`` (refused as ``gather_into`` refuses them, writing
        nothing); returns ``out``."""
        rows, cols = self.rows, self.cols
        arr = ids if (isinstance(ids, np.ndarray) and ids.ndim == 2 and ids.dtype in _ID_DTYPES
                      and ids.flags.c_contiguous) else _as_ids(ids, 2, False)
        T = arr.shape[0]
        if arr.shape[1] != cols or not 0 < T <= self.max_t:
            raise InvalidArgument(f"ids: expected [T, cols] with 1 <= T <= {self.max_t} (the bound buffer's "
                                  f"tokens) and cols = {cols}, got {list(arr.shape)}")
        bad = _k.first_bad_window(arr, rows.offsets, self.head_start, self.part)
        if bad >= 0:
            t, c = divmod(int(bad), cols)
            raise InvalidArgument(rows._bad_id(f"ids[{t}, {c}]", int(arr[t, c])))
        view = self.array if T == self.max_t else self.array[:T]
        return rows._run(_Call(self.form, arr, view, None, self.head_start, self.out), self.straight)


def _check_table(table: Any, config: V41Config, layer_id: int) -> list[int]:
    """The columns ``table`` holds, once it holds them with V4.1's layout."""
    if not isinstance(table, EngramStore):
        raise InvalidType(f"table: expected the EngramStore of layer {layer_id} (v41_store_config's layout), got "
                          f"{type(table).__name__}")
    if layer_id not in table.get_layer_ids():
        raise InvalidArgument(f"table: holds layers {table.get_layer_ids()}, not layer {layer_id}")
    heads = table.get_heads(layer=layer_id)
    primes = [p for order in config.primes(layer_id) for p in order]
    got = {"row_format": table.get_row_format(layer=layer_id), "embedding_dim": table.get_embedding_dim(layer=layer_id),
           "heads": heads, "table_vocab_sizes": table.get_table_vocab_sizes(layer=layer_id)}
    want = {"row_format": "bytes", "embedding_dim": config.row_bytes,
            "heads": [h for h in heads if h < config.cols],
            "table_vocab_sizes": [primes[h] if h < config.cols else None for h in heads]}
    for name, value in want.items():
        if got[name] != value:
            raise InvalidArgument(f"table: layer {layer_id} has {name}={describe(got[name])}, expected "
                                  f"{describe(value)} (build it with v41_store_config(config, layer_id))")
    return heads


def _as_ids(ids: Any, ndim: int | None, copy: bool) -> np.ndarray:
    """The caller's ids as an int32 or int64 array (C-contiguous; a copy where ``copy``)."""
    if isinstance(ids, np.ndarray):
        arr = ids
    elif hasattr(ids, "__dlpack__") or hasattr(ids, "__array_interface__"):
        arr = host_array(ids, "ids", writable=False).array
    else:
        raise InvalidType(f"ids: expected an int32 or int64 NumPy array or CPU tensor, got {type(ids).__name__}")
    if arr.dtype not in (np.int32, np.int64):
        raise InvalidType(f"ids: expected dtype int32 or int64, got {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise InvalidArgument(f"ids: expected {ndim} dimensions ([T, cols]), got shape {list(arr.shape)}")
    return np.array(arr, order="C", copy=True) if copy else np.ascontiguousarray(arr)


def _span(tables: list[np.ndarray], heads: list[int], cols: int) -> tuple[np.ndarray, np.ndarray]:
    """One read-only uint8 view spanning every table (the kernels index them as one array), and each column's
    first byte in it. Memory between the tables is never touched: every id is checked against the table first."""
    lo = min(t.ctypes.data for t in tables)
    hi = max(t.ctypes.data + t.nbytes for t in tables)
    span = np.frombuffer((ctypes.c_uint8 * (hi - lo)).from_address(lo), dtype=np.uint8)
    span.flags.writeable = False
    base = np.zeros(cols, dtype=np.int64)
    for h, t in zip(heads, tables):
        base[h] = t.ctypes.data - lo
    return span, base


#: The split gathers' threads, one pool per process.
_POOL = SharedPool("v41-rows")


def warm_kernels() -> None:
    """Compile every kernel of the gathers for the dtypes engines pass (int32 and int64 ids, each form, the
    memory and the staged paths), on tiny inputs."""
    offsets = np.array([0, 3, 7], dtype=np.int64)
    span = np.zeros(7 * 66, dtype=np.uint8)
    span.flags.writeable = False
    base = np.array([0, 3 * 66], dtype=np.int64)
    col_head = np.arange(2, dtype=np.int64)
    for dtype in (np.int32, np.int64):
        ids = np.array([[0, 4], [-1, 6]], dtype=dtype)
        _k.first_bad_window(ids, offsets, 0, 2)
        _k.first_bad_flat(ids.reshape(-1), offsets)
        for out in (np.empty((2, 2, 66), np.uint8), np.empty((2, 2, 64), np.uint16)):
            _k.window_from_span(span, base, offsets, ids, 0, 0, 2, 66, ENGINE_BF16_TABLE, out)
        codes, scales = np.empty((4, 64), np.uint8), np.empty((4, 2), np.uint8)
        _k.split_from_span(span, base, offsets, ids.reshape(-1), 0, 4, codes, scales)
        store_ids, src = _k.plan_window(ids, offsets, 0, 2, col_head, 2)
        staged = np.zeros((store_ids.size, 66), np.uint8)
        for out in (np.empty((2, 2, 66), np.uint8), np.empty((2, 2, 64), np.uint16)):
            _k.window_from_staging(staged, src, ENGINE_BF16_TABLE, out)
        _k.zero_slots(src, np.empty((2, 2, 66), np.uint8))
        store_ids, src = _k.plan_flat(ids.reshape(-1), offsets, col_head, 2)
        _k.split_from_staging(np.zeros((store_ids.size, 66), np.uint8), src, codes, scales)
