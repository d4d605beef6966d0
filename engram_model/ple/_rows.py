"""PLERows: a Qwen4-Exp PLE layer's table rows, gathered into a serving engine's own buffers in its conventions.

vLLM 0.33 and SGLang 0.5.23 keep the PLE table (320,001,536 rows: 51.2 GB FP8, 102.4 GB bf16) in host memory per
rank and gather its rows per step with a Triton kernel. ``PLERows`` gives them the same rows from any engram
table (a store, ``local_dir`` files, ``disk_dir`` on SSD behind a process or host cache, a head shard)::

    rows = PLERows(table, config, layer_id)          # table: the layer's EngramStore (or a head shard of it)
    rows.gather_into(ids, out)                       # out's dtype chooses the form
    rows.gather_into(ids, out, row_start=a, row_end=b)   # a rank's rows: ids outside [a, b) give zeros
    handle = rows.gather_into(ids, out, background=True); handle.wait()

Ids are what the engines' hashers give (``ple_ngram_ids``, ``compute_ngram_ids``, :class:`PLEHasher`): int64
(int32 taken too) global rows of the layer's one table, head offsets added, ``[T, 16]`` or any shape; ``out`` is
``[*ids.shape, width]``. Neither engine has a padding id: a padded token's row is hashed from its token (vLLM) or
read at id 0 (SGLang's idle ranks, vLLM's data-parallel slots) and thrown away. ``-1`` gives zeros, as any id
outside a rank's rows does in both kernels; an id that is in no head (below -1, in the padding rows after the
last head, which no hash gives and the table does not store, or past the table) is refused by name.

=========  =====================================================  ===============================================
form       out                                                    as
=========  =====================================================  ===============================================
raw        uint8 ``[..., row_bytes]``, or the table's own dtype   vLLM's ``_lookup_ple_embedding_from_pinned_kernel``
           ``[..., 160]``: float8_e4m3fn (FP8 tables) or bf16     (``Qwen4ExpPLEPinnedHostEmbedding._lookup``): the
           (bf16 tables)                                          stored bytes, zeros outside the rank's rows
bf16       bf16 ``[..., 160]`` (torch, ml_dtypes, or uint16 bits) SGLang's ``_gather_ple_embedding_from_pinned_kernel``
                                                                  (``Qwen4ExpPinnedHostEmbedding.gather``): an e4m3
                                                                  code as its bf16 value (exact), bf16 rows as they
                                                                  are; zeros outside the rank's rows
=========  =====================================================  ===============================================

Neither form applies the FP8 table's scale: both engines multiply by it after the all-reduce of the ranks' rows
(``bf16(e4m3) * bf16(weight_scale)``; :func:`engram_model.decode_rows` gives those values). Where the rows are in
this host's memory one kernel gathers them; elsewhere they are read with ``lookup_into`` first
(:mod:`engram_model._rows_gather` has the machinery, shared with the other model families).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, NamedTuple

import numpy as np

from engram_store.buffers import host_array
from engram_store.errors import InvalidArgument, InvalidType, describe, is_int

from .._rows_format import E4M3_TABLE
from .._rows_gather import RowGather, RowsAdapter, RowsHandle, Span, as_ids, check_table, check_threads, word_view
from .._rows_gather_kernels import checked_rows_from_span, first_bad, rows_from_span, rows_from_staging
from ._config import PLEConfig, PLEHashBuffers

#: bf16 bits of every e4m3 code (exact: an e4m3 value is a bf16 value; NaN codes give a quiet NaN of their sign).
E4M3_BF16 = (E4M3_TABLE.view(np.uint32) >> 16).astype(np.uint16)
E4M3_BF16.flags.writeable = False
#: A NumPy buffer's dtype, as host_array names it (its bits are the array itself).
_NUMPY_KINDS = {np.dtype(np.uint8): "uint8", np.dtype(np.uint16): "uint16"}
#: The ids' dtypes taken without a copy.
_ID_DTYPES = frozenset((np.dtype(np.int32), np.dtype(np.int64)))
#: How many of gather_into's buffers stay bound (an engine's decode step reuses one or two).
_BOUND_KEPT = 4
#: SGLang's VocabParallelEmbedding pads a vocabulary to this many rows (DEFAULT_VOCAB_PADDING_SIZE) before cutting
#: it over ranks; vLLM's PLE table pads to the config's make_ngram_vocab_size_divisible_by.
SGLANG_PADDING = 64


class _Call(NamedTuple):
    """A checked gather: what to read, and into what."""
    ids: np.ndarray            # int32/int64 [N], flat
    out: np.ndarray            # uint8 [N, row_bytes] (raw) or uint16 [N, head_dim] (e4m3 codes as bf16 bits)
    v0: int                    # the rank's rows [v0, v1), cut at the last head
    v1: int
    straight: np.ndarray | None  # raw: out as the store's rows [N, store_dim] where C-contiguous
    result: Any                # what the call returns: the caller's out
    shape: tuple = ()          # the ids' shape as the caller gave them (for a refusal's message)


class RankRows(NamedTuple):
    """A tensor-parallel rank's contiguous rows ``[row_start, row_end)`` of a layer's table, as the engines cut it,
    and the heads they lie in (open a head shard with ``EngramStore(..., heads=heads)``)."""
    row_start: int
    row_end: int
    heads: list[int]


def _rows_of(arr: np.ndarray) -> np.ndarray:
    """``arr [..., width]`` as ``[rows, width]``: a view, never a copy (refused where it would need one)."""
    flat = arr.view()
    try:
        flat.shape = (math.prod(arr.shape[:-1]), arr.shape[-1])  # math.prod: np.prod costs 5 us
    except AttributeError:
        raise InvalidArgument(f"out: expected a buffer whose leading axes {list(arr.shape[:-1])} can be viewed as one "
                              f"axis of rows (as a slice of a larger batch can), got strides {list(arr.strides)}") \
            from None
    return flat


def _kernel_rows(g: RowGather, span: Span, out: np.ndarray, words: np.ndarray | None = None) -> tuple:
    """``(source, delta, items, out)`` for the row kernels over ``span`` into ``out``: raw rows a word at a time
    where the span and ``out`` allow (``words``: ``out`` as words, where it was made once), else bytes."""
    if span.words is not None and out.itemsize == 1:
        words = words if words is not None else word_view(out)
        if words is not None:
            return span.words, span.word_delta, g.row_bytes // 8, words
    return span.bytes, span.delta, g.row_bytes, out


class _Direct(NamedTuple):
    """A bound buffer's one kernel call (see :meth:`BoundRows._direct_call`): the tables it reads while ``held``
    holds them, and the kernel's arguments over them."""
    held: Any                  # engram_store's HeldTables
    source: np.ndarray         # the span: uint64 words, or bytes
    delta: np.ndarray
    offsets: np.ndarray
    total: int
    items: int                 # a row's items in the span
    out: np.ndarray            # the buffer's rows as the kernel writes them [max_T * heads, items]
    gather: RowGather          # whose count of gathers from memory each call adds to


class BoundRows:
    """:meth:`PLERows.bind`'s gathers into one checked buffer (``target``: its rows as the kernels write them,
    ``[max_T * heads, width]``; ``out``: the caller's). A decode step's call is the ids' checks, the store's check
    of its tables and one kernel: the views of ``out`` for each step's tokens are made once."""

    def __init__(self, rows: "PLERows", target: np.ndarray, straight: np.ndarray | None, v0: int, v1: int, out: Any,
                 max_tokens: int):
        self.rows, self.target, self.straight, self.v0, self.v1, self.out = rows, target, straight, v0, v1, out
        self.max_tokens, self.heads = max_tokens, rows.config.heads
        self.words = word_view(target) if target.itemsize == 1 else None  # raw rows a word at a time
        self._views: dict[int, tuple] = {}  # T -> the views of its rows: (target, straight, words)
        self._direct: _Direct | None = None

    def __call__(self, ids: Any) -> Any:
        """Fill ``out[:T]`` with the rows of ``ids [T, heads]`` (refused as ``gather_into`` refuses them, writing
        nothing); returns ``out``."""
        arr = ids if (type(ids) is np.ndarray and ids.dtype in _ID_DTYPES and ids.ndim == 2
                      and ids.flags.c_contiguous) else as_ids(ids, 2, False, "[T, heads]")
        T = arr.shape[0]
        if arr.shape[1] != self.heads or not 0 < T <= self.max_tokens:
            raise InvalidArgument(f"ids: expected [T, heads] with 1 <= T <= {self.max_tokens} (the bound buffer's "
                                  f"tokens) and heads = {self.heads}, got {list(arr.shape)}")
        direct = self._direct
        if direct is not None and direct.held.holds():  # one kernel call, nothing between
            bad = checked_rows_from_span(direct.source, direct.delta, direct.offsets, arr.reshape(-1), direct.total,
                                         self.v0, self.v1, direct.items, E4M3_BF16, direct.out[:T * self.heads])
            direct.gather.memory_gathers += 1
            if bad >= 0:
                raise InvalidArgument(self.rows._bad_id(arr, int(bad)))
            return self.out
        views = self._views.get(T) or self._view(T)
        self.rows._checked_run(_Call(arr.reshape(-1), views[0], self.v0, self.v1, views[1], views, arr.shape),
                               views[2], self._from_span)
        self._direct = self._direct_call()
        return self.out

    def _direct_call(self) -> "_Direct | None":
        """A step's one kernel call where :meth:`RowGather.held_span` allows it; else None (every call takes the
        checked path: ``PLERows._checked_run``)."""
        g = self.rows._gather
        found = g.held_span(self.max_tokens * self.heads)
        if found is None:
            return None
        held, span = found
        source, delta, items, out = _kernel_rows(g, span, self.target, self.words)
        return _Direct(held, source, delta, g.offsets, self.rows.total, items, out, g)

    def _view(self, T: int) -> tuple:
        n = T * self.heads
        views = self._views[T] = (self.target[:n], None if self.straight is None else self.straight[:n],
                                  None if self.words is None else self.words[:n])
        return views

    def _from_span(self, span: Span, call: _Call) -> None:
        """PLERows._from_span with the word view made at bind (``call.result``: the step's views)."""
        self.rows._from_span(span, call, call.result[2])


def ple_rank_rows(config: PLEConfig, layer_id: int, rank: int, ranks: int, *, padding: int | None = None,
                  buffers: PLEHashBuffers | None = None) -> RankRows:
    """The rows rank ``rank`` of ``ranks`` holds of layer ``layer_id``'s table in vLLM's (and SGLang's) vocabulary-
    parallel cut: the table's rows padded to a multiple of ``padding`` (None: the config's
    ``make_ngram_vocab_size_divisible_by``, vLLM's; SGLang pads to :data:`SGLANG_PADDING`), an equal share each,
    cut at the table's end (``shard_indices.org_vocab_start_index`` and ``org_vocab_end_index``)."""
    if not isinstance(config, PLEConfig):
        raise InvalidType(f"config: expected a PLEConfig, got {type(config).__name__}")
    buffers = buffers or config.hash_buffers(layer_id)
    pad = config.make_ngram_vocab_size_divisible_by if padding is None else padding
    if not is_int(ranks) or ranks < 1 or not is_int(rank) or not 0 <= rank < ranks:
        raise InvalidArgument(f"rank, ranks: expected 0 <= rank < ranks, got rank={describe(rank)}, "
                              f"ranks={describe(ranks)}")
    if not is_int(pad) or pad < 1:
        raise InvalidArgument(f"padding: expected an integer >= 1 or None, got {describe(pad)}")
    padded = -(-buffers.rows // pad) * pad
    if padded % ranks:
        raise InvalidArgument(f"ranks: the engines cut the {padded} padded rows of layer {buffers.layer_id} into "
                              f"equal shares; {ranks} does not divide them")
    share = padded // ranks
    start, end = min(rank * share, buffers.rows), min((rank + 1) * share, buffers.rows)
    bounds = np.append(buffers.offsets, sum(buffers.sizes))
    heads = [h for h in range(len(buffers.sizes)) if bounds[h] < end and bounds[h + 1] > start]
    return RankRows(int(start), int(end), heads)


class PLERows(RowsAdapter):
    """Rows of layer ``layer_id``'s PLE table for a serving engine (see the module docstring).

    ``table``: an :class:`EngramStore` holding the layer in :func:`ple_store_config`'s layout, or a head shard of
    it (``heads=``; then every call's rows must lie in its heads). ``buffers``: the checkpoint's hash layout where
    it differs from the config's (:func:`load_ple_hash_buffers`). ``threads``: threads for large gathers from
    memory (default: this host's CPUs, at most 16).
    """

    def __init__(self, table: Any, config: PLEConfig, layer_id: int, *, buffers: PLEHashBuffers | None = None,
                 threads: int | None = None):
        if not isinstance(config, PLEConfig):
            raise InvalidType(f"config: expected a PLEConfig, got {type(config).__name__}")
        config.ple_index(layer_id)
        self.config, self.layer_id = config, int(layer_id)
        buffers = buffers if buffers is not None else config.hash_buffers(self.layer_id)
        if not isinstance(buffers, PLEHashBuffers) or buffers.layer_id != self.layer_id \
                or len(buffers.sizes) != config.heads:
            raise InvalidArgument(f"buffers: expected the PLEHashBuffers of layer {self.layer_id} ({config.heads} "
                                  f"heads), got {describe(buffers)}")
        self.buffers, self.fmt = buffers, config.row_format
        self.heads = check_table(table, self.layer_id, self.fmt.store_row_format, self.fmt.store_dim, buffers.sizes,
                                 f"ple_store_config(config, {self.layer_id})")
        self.table = table
        self.total = sum(buffers.sizes)  # rows the heads hold; the padding rows after them are not stored
        offsets = np.append(np.asarray(buffers.offsets, np.int64), self.total)
        self._gather = RowGather(table, self.layer_id, self.heads, offsets, self.fmt.row_bytes,
                                 check_threads(threads), f"ple-rows-l{self.layer_id}", self.fmt.dtype)
        self._covered: set[tuple[int, int]] = set()  # row windows whose heads the table holds
        fmt, bf16 = self.fmt, self.fmt.codes == "bf16"
        # out's dtype -> (its last axis, whether the form is raw): bytes, the table's own dtype, or bf16 values
        self._forms = {"uint8": (fmt.row_bytes, True), "bfloat16": (fmt.values, bf16), "uint16": (fmt.values, bf16),
                       **({} if bf16 else {"float8_e4m3fn": (fmt.values, True)})}
        self._store_dtype = fmt.dtype
        self._bound: dict[tuple, BoundRows] = {}  # gather_into's buffers, bound (see _bound_for)
        self._bound_lock = threading.Lock()
        self._bound_by_id: dict[int, tuple] = {}  # the same, by the buffer object (a kept one holds it)
        self._whole: tuple[int, int] | None = None
        self._whole = self._window(0, None) if self.heads == list(range(config.heads)) else None

    # ---- the call ---------------------------------------------------------------------------------

    def gather_into(self, ids: Any, out: Any, *, row_start: int = 0, row_end: int | None = None,
                    background: bool = False) -> Any:
        """Fill ``out`` (``[*ids.shape, width]``, its dtype the form) with the rows of ``ids``; ids outside
        ``[row_start, row_end)`` (default: the whole table) give zeros. Returns ``out``, or with
        ``background=True`` a :class:`RowsHandle` at once (the arguments are checked before it returns; ``ids`` are
        copied, ``out`` is written in the background: do not read it before ``wait()``).

        A refused call raises naming the argument, what was expected and what came, and writes nothing. A read
        that fails (a segment or disk fault) raises the store's error and may leave ``out`` partly written.
        """
        if not background:
            seen = self._bound_by_id.get(id(out))  # (out, its shape and strides, the window, its BoundRows)
            if seen is not None and seen[0] is out and type(ids) is np.ndarray and ids.shape == out.shape[:2] \
                    and out.shape == seen[1] and out.strides == seen[2] and row_start == seen[3] \
                    and row_end == seen[4] and out.flags.writeable and ids.dtype in _ID_DTYPES:
                seen[5](ids)  # (the same buffer object again: the cheapest check, no look at its memory)
                return out
            bound = self._bound_for(ids, out, row_start, row_end)
            if bound is not None:
                bound(ids)
                self._keep(self._bound_by_id, id(out), (out, out.shape, out.strides, row_start, row_end, bound))
                return out
            call = self._check(ids, out, row_start, row_end, False, check_ids=False)
            self._checked_run(call, None, self._from_span)
            return call.result
        call = self._check(ids, out, row_start, row_end, True)
        return self._gather.submit(lambda: self._run(call), ids)

    def _bound_for(self, ids: Any, out: Any, row_start: Any, row_end: Any) -> "BoundRows | None":
        """A decode step's ``gather_into`` as a call of the buffer bound once (:meth:`bind`) over the same memory:
        where ``ids [T, heads]`` and ``out [T, heads, width]`` are NumPy arrays of a gather in one part, ``out``
        writable and C-contiguous (its checks, views and window are then not redone each step: measured, a third of
        a decode step's time). Else None: the general path, whose refusals say what is wrong. The last few buffers
        are kept, keyed by their memory, shape and dtype, so a fresh view of the same rows each step is found too
        (a kept view holds its memory: no other buffer can come at its address)."""
        if type(out) is not np.ndarray or type(ids) is not np.ndarray or out.ndim != 3 \
                or ids.shape != out.shape[:2] or ids.shape[1] != self.config.heads or not ids.shape[0] \
                or ids.dtype not in _ID_DTYPES or not out.flags.writeable or out.dtype not in _NUMPY_KINDS \
                or not out.flags.c_contiguous or type(row_start) is not int \
                or not (row_end is None or type(row_end) is int) \
                or not self._gather.one_part(out.shape[0] * out.shape[1]):
            return None  # (before the key: out.ctypes costs microseconds)
        key = (out.ctypes.data, out.shape, out.strides, out.dtype, row_start, row_end)
        bound = self._bound.get(key)
        if bound is None:
            try:
                bound = self.bind(out, row_start=row_start, row_end=row_end)
            except (InvalidArgument, InvalidType):
                return None  # the general path says why, in gather_into's terms
            self._keep(self._bound, key, bound)
        return bound

    def _keep(self, kept: dict, key: Any, value: Any) -> None:
        """``kept[key] = value``, letting the oldest go past _BOUND_KEPT entries."""
        with self._bound_lock:
            while len(kept) >= _BOUND_KEPT:
                kept.pop(next(iter(kept)))
            kept[key] = value

    def bind(self, out: Any, *, row_start: int = 0, row_end: int | None = None) -> "BoundRows":
        """``out`` (``[max_T, heads, width]`` of either form: an engine's staging buffer) and the rank's rows checked
        once, for gathers of up to ``max_T`` tokens at a decode step's cadence: ``bound(ids)`` fills ``out[:T]`` with
        the rows of ``ids [T, heads]`` as ``gather_into`` would, checking only the ids (the buffer's checks and views
        are not redone each step)."""
        heads = self.config.heads
        probe = np.full((1, heads), -1, dtype=np.int64)
        view = host_array(out, "out")
        if view.array.ndim != 3 or view.array.shape[0] < 1 or view.array.shape[1] != heads:
            raise InvalidArgument(f"out: expected a [max_T, {heads}, width] buffer, got {list(view.array.shape)}")
        call = self._check(probe, view.array[:1], row_start, row_end, False)  # the form, the window, refusals
        flat = _rows_of(view.array)
        target = flat.view(np.uint8) if call.out.itemsize == 1 else flat
        straight = target.view(self._store_dtype) if call.straight is not None and target.flags.c_contiguous \
            else None
        return BoundRows(self, target, straight, call.v0, call.v1, out, view.array.shape[0])

    def _check(self, ids: Any, out: Any, row_start: Any, row_end: Any, copy_ids: bool, check_ids: bool = True) -> _Call:
        """The call checked, its ids too unless ``check_ids=False`` (then :meth:`_checked_run` checks them)."""
        kind = _NUMPY_KINDS.get(out.dtype) if type(out) is np.ndarray and out.flags.writeable else None
        if kind is None:  # a tensor, an ml_dtypes array, a read-only or odd buffer: the general view
            view = host_array(out, "out")
            arr, kind = view.array, view.dtype
        else:  # a decode step's NumPy buffer: no more to look at (the general path costs a few microseconds)
            arr = out
        raw = self._form(kind, arr)
        ids_arr = as_ids(ids, None, copy_ids)
        if arr.shape != ids_arr.shape + (arr.shape[-1],):
            raise InvalidArgument(f"out: expected [*ids.shape, {arr.shape[-1]}] = "
                                  f"{list(ids_arr.shape) + [arr.shape[-1]]} (ids {list(ids_arr.shape)}), got "
                                  f"{list(arr.shape)}")
        flat = _rows_of(arr)
        v0, v1 = self._window(row_start, row_end)
        ids_flat = ids_arr.reshape(-1)
        bad = first_bad(ids_flat, self.total) if check_ids else -1
        if bad >= 0:
            raise InvalidArgument(self._bad_id(ids_arr, int(bad)))
        out2 = flat.view(np.uint8) if raw else flat
        straight = out2.view(self._store_dtype) if raw and out2.flags.c_contiguous else None
        return _Call(ids_flat, out2, v0, v1, straight, out, ids_arr.shape)

    def _form(self, kind: str, arr: np.ndarray) -> bool:
        """Whether ``out`` asks for the raw form (else bf16), once its dtype and last axis fit this table."""
        width, raw = self._forms.get(kind, (None, False))
        if width is None or arr.ndim < 1 or arr.shape[-1] != width or (arr.size and arr.strides[-1] != arr.itemsize):
            fmt = self.fmt
            own = "float8_e4m3fn" if fmt.codes == "e4m3" else "bfloat16"
            raise InvalidArgument(f"out: expected [..., {fmt.row_bytes}] uint8 or [..., {fmt.values}] {own} (the "
                                  f"table's raw rows: {fmt}), or [..., {fmt.values}] bfloat16 (torch, ml_dtypes or "
                                  f"uint16 bits: the rows' values), with the last axis contiguous; got {kind} "
                                  f"{list(arr.shape)}")
        return raw

    def _window(self, row_start: Any, row_end: Any) -> tuple[int, int]:
        if type(row_start) is int and row_start == 0 and row_end is None and self._whole is not None:
            return self._whole
        rows = self.buffers.rows
        end = rows if row_end is None else row_end
        if not is_int(row_start) or not is_int(end) or not 0 <= row_start <= end <= rows:
            raise InvalidArgument(f"row_start, row_end: expected 0 <= row_start <= row_end <= {rows} (the rank's "
                                  f"rows of layer {self.layer_id}'s table; row_end None: its end), got "
                                  f"row_start={describe(row_start)}, row_end={describe(row_end)}")
        v0, v1 = int(row_start), min(int(end), self.total)
        if (v0, v1) not in self._covered:
            bounds = self._gather.offsets
            need = [h for h in range(self.config.heads) if bounds[h] < v1 and bounds[h + 1] > v0]
            missing = [h for h in need if self._gather.col_head[h] < 0]
            if missing:
                raise InvalidArgument(f"row_start, row_end: rows {v0}..{v1 - 1} of layer {self.layer_id} lie in "
                                      f"heads {need}, but this table holds heads {self.heads} (missing {missing}); "
                                      "open the table with heads= covering the rank's rows (ple_rank_rows)")
            self._covered.add((v0, v1))
        return v0, v1

    def _bad_id(self, ids: np.ndarray, flat_index: int) -> str:
        where = ", ".join(str(int(i)) for i in np.unravel_index(flat_index, ids.shape))
        value = int(ids.reshape(-1)[flat_index])
        what = (" (a padding row after the last head: no hash gives one, and the table does not store them)"
                if self.total <= value < self.buffers.rows else "")
        return (f"ids[{where}] = {value} is no row of layer {self.layer_id}'s heads{what} (expected -1 or 0 <= id "
                f"< {self.total}: rows of the layer's one table, head offsets added, as the engines' hashers and "
                "PLEHasher give them)")

    # ---- the gather -------------------------------------------------------------------------------

    def _checked_run(self, call: _Call, words: np.ndarray | None, from_span: Callable[[Span, _Call], None]) -> None:
        """``call`` with its ids not yet checked: a gather from
        memory in one part checks them in its one kernel call (nothing written when one is refused); any other
        checks them first, then reads as :meth:`_run` with ``from_span``. ``words``: ``call.out`` a word at a
        time, where it was made once (a bound buffer's)."""
        if not call.ids.shape[0]:
            return
        g = self._gather
        if g.one_part(call.ids.shape[0]):
            found = [-1]

            def checked(span: Span, c: _Call) -> None:
                source, delta, items, out = _kernel_rows(g, span, c.out, words)
                found[0] = checked_rows_from_span(source, delta, g.offsets, c.ids, self.total, c.v0, c.v1, items,
                                                  E4M3_BF16, out)

            if g.in_memory(checked, call):
                if found[0] >= 0:
                    raise InvalidArgument(self._bad_id(call.ids.reshape(call.shape), int(found[0])))
                return
        bad = first_bad(call.ids, self.total)
        if bad >= 0:
            raise InvalidArgument(self._bad_id(call.ids.reshape(call.shape), int(bad)))
        g.gather(from_span, self._staged, call)

    def _run(self, call: _Call) -> Any:
        if call.ids.shape[0]:
            self._gather.gather(self._from_span, self._staged, call)
        return call.result

    def _staged(self, call: _Call) -> None:
        """The call's rows read with the table's lookup_into (remote segments, disk), then laid out."""
        self._gather.staged(call.ids, call.v0, call.v1, lambda staged, src: rows_from_staging(
            staged, src, E4M3_BF16, call.out), call.straight)

    def _from_span(self, span: Span, call: _Call, words: np.ndarray | None = None) -> None:
        """The call's rows from this host's memory: raw rows a word at a time where the span and ``out`` allow
        (``words``: ``out`` as words, made once)."""
        g = self._gather
        source, delta, items, out = _kernel_rows(g, span, call.out, words)
        g.split_range(call.ids.shape[0], lambda a, b: rows_from_span(
            source, delta, g.offsets, call.ids, 0, g.cols, call.v0, call.v1, a, b, items, E4M3_BF16, out))

    def __repr__(self) -> str:
        return (f"PLERows(layer_id={self.layer_id}, heads={self.heads[0]}..{self.heads[-1]}, rows={self.fmt}, "
                f"table={self.table!r})")

