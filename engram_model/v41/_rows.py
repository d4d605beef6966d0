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
CPU tensor (DLPack), ``-1`` for padding (vLLM's ``DEAD_ID``). The forms:

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
No float32 array is made on either path. :mod:`engram_model._rows_gather` has the machinery, shared with the other
model families; its kernels' raw, scaled and split forms are the packed, bf16 and split forms here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from engram_store import EngramStore
from engram_store.buffers import host_array
from engram_store.errors import InvalidArgument, InvalidType, describe, is_int

from .._rows_gather import (NO_LUT, RowGather, RowsAdapter, RowsHandle, Span, as_ids, check_table,
                             check_threads)
from .._rows_gather_kernels import (first_bad, first_bad_window, rows_from_span, rows_from_staging,
                                    scaled_from_span, scaled_from_staging, split_from_span, split_from_staging)
from ._config import FP8_BLOCK, V41Config
from ._fp8 import ENGINE_BF16_TABLE

class _Call(NamedTuple):
    """A checked gather: what to read, and into what. Slot ``t * width + j`` holds the row of ``ids[t * cols +
    first + j]`` (see :mod:`engram_model._rows_gather_kernels`)."""
    form: str                  # "bf16", "packed" or "split"
    ids: np.ndarray            # int32/int64, flat: [T * cols] or the split form's [N]
    out: np.ndarray            # the slots' rows: uint8 [n, row_bytes], uint16 [n, head_dim], or codes [N, head_dim]
    scales: np.ndarray | None  # split: uint8 [N, head_dim // 32]
    first: int                 # head_start
    width: int                 # part (cols for the split form)
    v0: int                    # the shard's rows [v0, v1): ids outside give zeros
    v1: int
    back: np.ndarray | None    # the caller's 3-D out where its slots are no one axis: out is a buffer copied into it
    result: Any                # what the call returns: the caller's out


def _slots(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """A ``[T, part, width]`` buffer as ``[T * part, width]`` slots: a view, or where its strides allow none a
    buffer to gather into and copy back (the second item: the buffer to copy into)."""
    flat = arr.view()
    try:
        flat.shape = (arr.shape[0] * arr.shape[1], arr.shape[2])
    except AttributeError:
        return np.empty((arr.shape[0] * arr.shape[1], arr.shape[2]), arr.dtype), arr
    return flat, None


class V41Rows(RowsAdapter):
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
        self.threads = check_threads(threads)
        primes = [p for order in config.primes(self.layer_id) for p in order]
        self.heads = check_table(table, self.layer_id, "bytes", config.row_bytes, primes,
                                 f"v41_store_config(config, {self.layer_id})")
        self.table = table
        offsets = np.append(config.offsets(self.layer_id), config.num_embeddings(self.layer_id))
        self._gather = RowGather(table, self.layer_id, self.heads, offsets, config.row_bytes, self.threads,
                                 f"v41-rows-l{self.layer_id}")
        self.offsets, self.col_head = self._gather.offsets, self._gather.col_head
        self._covered: set[tuple[int, int]] = set()  # (head_start, part) windows whose columns the table holds

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
            return self._run(call)
        return self._gather.submit(lambda: self._run(call), ids)

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
        ids_arr = as_ids(ids, 2, copy_ids)
        T, part = arr.shape[0], arr.shape[1]
        if ids_arr.shape != (T, cfg.cols) or part == 0:
            raise InvalidArgument(f"ids: expected [T, cols] = [{T}, {cfg.cols}] (T from out {list(arr.shape)}, "
                                  f"part >= 1), got {list(ids_arr.shape)}")
        v0, v1 = self._check_columns(int(head_start), part)
        self._check_ids(ids_arr, int(head_start), part)
        slots, back = _slots(arr)
        return _Call(form, ids_arr.reshape(-1), slots, None, int(head_start), part, v0, v1, back, out)

    def _check_split(self, ids: Any, codes: Any, scales_out: Any, head_start: Any, copy_ids: bool) -> _Call:
        cfg = self.config
        if head_start != 0:
            raise InvalidArgument(f"head_start: the split form reads flat ids of the whole table; expected 0, got "
                                  f"{describe(head_start)}")
        c_view, s_view = host_array(codes, "out"), host_array(scales_out, "scales_out")
        c, s = c_view.array, s_view.array
        ids_arr = as_ids(ids, None, copy_ids).reshape(-1)
        N = ids_arr.shape[0]
        if c.dtype != np.uint8 or c.shape != (N, cfg.head_dim) or c.strides[1] != 1:
            raise InvalidArgument(f"out: expected the codes of the split form, uint8 or float8_e4m3fn [N, head_dim] "
                                  f"= [{N}, {cfg.head_dim}] (N = ids.size) with rows contiguous, got {c_view.dtype} "
                                  f"{list(c.shape)}")
        nblk = cfg.head_dim // FP8_BLOCK
        if s.dtype != np.uint8 or s.shape != (N, nblk) or s.strides[1] != 1:
            raise InvalidArgument(f"scales_out: expected uint8 (e8m0 bytes) [N, head_dim // 32] = [{N}, {nblk}] with "
                                  f"rows contiguous, got {s_view.dtype} {list(s.shape)}")
        if N == 0:
            raise InvalidArgument("ids: expected at least one id, got none")
        v0, v1 = self._check_columns(0, cfg.cols)
        bad = first_bad(ids_arr, v1)
        if bad >= 0:
            raise InvalidArgument(self._bad_id(f"ids.flat[{int(bad)}]", int(ids_arr[bad])))
        return _Call("split", ids_arr, c, s, 0, cfg.cols, v0, v1, None, codes)

    def _check_columns(self, head_start: int, part: int) -> tuple[int, int]:
        """The window's rows ``[v0, v1)``, once the table holds its columns."""
        cols = self.config.cols
        if (head_start, part) not in self._covered:
            need = range(head_start, min(head_start + part, cols))
            missing = [c for c in need if self.col_head[c] < 0]
            if missing:
                raise InvalidArgument(f"head_start, out: columns {need.start}..{need.stop - 1} of layer "
                                      f"{self.layer_id} are read, but this table holds columns {self.heads} (missing "
                                      f"{missing}); open the table with heads= covering the shard")
            self._covered.add((head_start, part))
        return int(self.offsets[head_start]), int(self.offsets[min(head_start + part, cols)])

    def _check_ids(self, ids: np.ndarray, head_start: int, part: int) -> None:
        """Refuse an id of the window's columns that is no row of the table."""
        bad = first_bad_window(ids, self.offsets[-1], head_start, part)
        if bad >= 0:
            t, c = divmod(int(bad), self.config.cols)
            raise InvalidArgument(self._bad_id(f"ids[{t}, {c}]", int(ids[t, c])))

    def _bad_id(self, where: str, value: int) -> str:
        total = int(self.offsets[-1])
        return (f"{where} = {value} is no row of layer {self.layer_id}'s table (expected -1 for padding or "
                f"0 <= id < {total}: rows of the layer's one table, column offsets added, as the engines' hashers "
                "and V41Hasher give them)")

    # ---- the gather -------------------------------------------------------------------------------

    def _run(self, call: _Call) -> Any:
        self._gather.gather(self._from_span, self._staged, call)
        if call.back is not None:
            call.back[...] = call.out.reshape(call.back.shape)
        return call.result

    def _from_span(self, span: Span, call: _Call) -> None:
        """The call's rows from this host's memory, in one kernel of the call's form."""
        g, out, args = self._gather, call.out, (call.ids, call.first, call.width, call.v0, call.v1)
        if call.form == "split":
            g.split_range(out.shape[0], lambda a, b: split_from_span(
                span.bytes, span.delta, g.offsets, *args, a, b, g.row_bytes, out, call.scales))
        elif call.form == "bf16":
            g.split_range(out.shape[0], lambda a, b: scaled_from_span(
                span.bytes, span.delta, g.offsets, *args, a, b, g.row_bytes, ENGINE_BF16_TABLE, out))
        else:  # byte copies (words measured no faster on 264-byte rows)
            g.split_range(out.shape[0], lambda a, b: rows_from_span(
                span.bytes, span.delta, g.offsets, *args, a, b, g.row_bytes, NO_LUT, out))

    def _staged(self, call: _Call) -> None:
        """The call's rows read with the table's lookup_into (remote segments, disk), then laid out."""
        out = call.out
        if call.form == "split":
            lay_out = lambda staged, src: split_from_staging(staged, src, out, call.scales)  # noqa: E731
        elif call.form == "bf16":
            lay_out = lambda staged, src: scaled_from_staging(staged, src, ENGINE_BF16_TABLE, out)  # noqa: E731
        else:
            lay_out = lambda staged, src: rows_from_staging(staged, src, NO_LUT, out)  # noqa: E731
        straight = out if call.form == "packed" and out.flags.c_contiguous else None
        self._gather.staged(call.ids, call.v0, call.v1, lay_out, straight, first=call.first, width=call.width,
                            n=out.shape[0])

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
        return BoundRows(self, call, view.array, out)

    def __repr__(self) -> str:
        return (f"V41Rows(layer_id={self.layer_id}, columns={self.heads[0]}..{self.heads[-1]}, "
                f"row_bytes={self.config.row_bytes}, table={self.table!r})")


class BoundRows:
    """:meth:`V41Rows.bind`'s gathers into one checked buffer (``array``: its host view; ``out``: the caller's). A
    decode step's call is the ids' checks, the store's check of its tables and one kernel: the views of ``out``
    for each step's tokens are made once."""

    def __init__(self, rows: V41Rows, probe: _Call, array: np.ndarray, out: Any):
        self.rows, self.form, self.array, self.out = rows, probe.form, array, out
        self.head_start, self.part, self.v0, self.v1 = probe.first, probe.width, probe.v0, probe.v1
        self._views: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}  # T -> out[:T]'s slots (and copy-back)
        self._held: tuple[Any, Span] | None = None  # RowGather.held_span: a step's rows in one kernel call
        self._kernel, self._lut = (scaled_from_span, ENGINE_BF16_TABLE) if self.form == "bf16" \
            else (rows_from_span, NO_LUT)

    def __call__(self, ids: Any) -> Any:
        """Fill ``out[:T]`` with the rows of ``ids [T, cols]`` (refused as ``gather_into`` refuses them, writing
        nothing); returns ``out``."""
        rows, cols = self.rows, self.rows.config.cols
        arr = ids if (type(ids) is np.ndarray and ids.ndim == 2 and ids.dtype in (np.int32, np.int64)
                      and ids.flags.c_contiguous) else as_ids(ids, 2, False)
        T = arr.shape[0]
        if arr.shape[1] != cols or not 0 < T <= self.array.shape[0]:
            raise InvalidArgument(f"ids: expected [T, cols] with 1 <= T <= {self.array.shape[0]} (the bound buffer's "
                                  f"tokens) and cols = {cols}, got {list(arr.shape)}")
        rows._check_ids(arr, self.head_start, self.part)
        slots, back = self._views.get(T) or self._view(T)
        held = self._held
        if held is not None and held[0].holds():  # tables this process holds: the kernel, nothing between
            g, span = rows._gather, held[1]
            self._kernel(span.bytes, span.delta, g.offsets, arr.reshape(-1), self.head_start, self.part, self.v0,
                         self.v1, 0, slots.shape[0], g.row_bytes, self._lut, slots)
            g.memory_gathers += 1
            if back is not None:
                back[...] = slots.reshape(back.shape)
            return self.out
        rows._run(_Call(self.form, arr.reshape(-1), slots, None, self.head_start, self.part, self.v0, self.v1, back,
                        self.out))
        self._held = rows._gather.held_span(self.array.shape[0] * self.part)
        return self.out

    def _view(self, T: int) -> tuple[np.ndarray, np.ndarray | None]:
        views = self._views[T] = _slots(self.array[:T])
        return views
