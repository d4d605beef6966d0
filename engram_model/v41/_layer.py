"""V41Engram: one DeepSeek-V4.1 Engram layer, its FP8 table in an EngramStore, in NumPy and Numba.

Follows ``Engram`` of DeepSeek's V4.1 ``inference/model.py``. Before decoder layer ``layer_id``, on the
``hc_mult``-stream residual ``h [B, L, hc, hidden]``::

    E    = decoded table rows [B, L, cols, head_dim]                  # bf16 values
    kv   = bf16(E.flatten(-2) @ wkv.T)                                # [B, L, (hc + 1) * hidden]
    key  = kv[..., :hc * hidden].view(hc, hidden)                     # one key per stream
    val  = kv[..., hc * hidden:]                                      # one value shared by all streams
    rstd = rsqrt(mean(h^2) + eps) * rsqrt(mean(key^2) + eps)          # per token and stream
    dot  = sum(h * (q_weight * k_weight) * key) * rstd / sqrt(hidden)
    g    = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)), 0 where token_mask is False
    out  = bf16(h + g * val)

No short convolution, biases or norm weights (q_weight and k_weight stand in for them). ``forward`` returns
``out`` (the residual already added), float32 holding bf16 values.

The table is one EngramStore layer of ``row_format="bytes"`` rows (``config.row_bytes`` each), one head per column
(column c's table holds rows ``offset[c] .. offset[c] + prime[c]`` of the layer's table, so the store's ids are
``row - offset[c]``). Where every column is in this host's memory (:meth:`EngramStore.local_tables`) rows are
gathered and decoded in one kernel, with no copy of the packed rows; otherwise they are read with ``lookup_into``
into a reused buffer and decoded there.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from engram_store import EngramStore, LookupHandle
from engram_store.errors import InvalidArgument, InvalidType, describe
from engram_store.buffers import host_array

from . import _kernels
from ._checkpoint import SafetensorsCheckpoint, load_v41_weights, open_v41_table
from ._config import V41Config, v41_store_config
from ._fp8 import DECODE_TABLE, bad_row_message
from ._hasher import V41Hasher

log = logging.getLogger(__name__)

_NO_MASK = np.ones(1, dtype=np.bool_)


class V41Prefetch(LookupHandle):
    """Rows of one layer being gathered and decoded in the background; pass it to ``forward(prefetched=...)``.
    ``result()`` is the decoded rows, float32 ``[B, L, cols, head_dim]``, or raises what the read raised."""

    def __init__(self, layer_id: int, shape: tuple[int, int], future: Future, row_ids: Any = None):
        super().__init__(future, row_ids)
        self.layer_id = layer_id
        self.shape = shape  # the (B, L) of the token ids the rows belong to

    def __repr__(self) -> str:
        return f"V41Prefetch(layer_id={self.layer_id}, shape={self.shape}, done={self.done()})"


def _weight(name: str, value: Any, shape: tuple[int, ...]) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise InvalidType(f"{name}: expected a float32 NumPy array {list(shape)}, got {type(value).__name__}")
    if value.dtype.kind != "f":
        raise InvalidType(f"{name}: expected a floating-point dtype (float32), got {value.dtype}")
    if value.shape != shape:
        raise InvalidArgument(f"{name}: expected shape {list(shape)}, got {list(value.shape)}")
    if not np.isfinite(value).all():
        raise InvalidArgument(f"{name}: holds NaN or infinity")
    return np.ascontiguousarray(value, dtype=np.float32)


class V41Engram:
    """One V4.1 Engram layer (see the module docstring): weights in NumPy, the FP8 table in ``store``.

    ``wkv`` is float32 ``[(hc_mult + 1) * hidden_size, cols * head_dim]`` (dequantised), ``q_weight`` and
    ``k_weight`` float32 ``[hc_mult, hidden_size]``. ``store`` is an :class:`EngramStore` holding this layer with
    the layout of :func:`v41_store_config`. ``hasher`` (a :class:`V41Hasher` of the same config) hashes token ids
    given to :meth:`forward` and :meth:`prefetch`; without one, pass ``row_ids`` from a hasher you run once per
    step for all layers.
    """

    def __init__(self, config: V41Config, layer_id: int, wkv: np.ndarray, q_weight: np.ndarray,
                 k_weight: np.ndarray, store: EngramStore, hasher: V41Hasher | None = None):
        if not isinstance(config, V41Config):
            raise InvalidType(f"config: expected a V41Config, got {type(config).__name__}")
        self.config = config
        self.layer_index = config.layer_index(layer_id)
        self.layer_id = int(layer_id)
        hc, hidden, K = config.hc_mult, config.hidden_size, config.cols * config.head_dim
        self.wkv = _weight("wkv", wkv, ((hc + 1) * hidden, K))
        q = _weight("q_weight", q_weight, (hc, hidden))
        k = _weight("k_weight", k_weight, (hc, hidden))
        self.gate_weight = q * k  # float32 products: the reference only ever uses them multiplied
        self._check_store(store)
        self.store = store
        if hasher is not None and not isinstance(hasher, V41Hasher):
            raise InvalidType(f"hasher: expected a V41Hasher or None, got {type(hasher).__name__}")
        if hasher is not None and hasher.config != config:
            raise InvalidArgument(f"hasher: built for {hasher.config}, this layer's config is {config}")
        self.hasher = hasher
        self.offsets = config.offsets(layer_id)
        self.primes = np.array([p for heads in config.primes(layer_id) for p in heads], dtype=np.int64)
        self._staging: np.ndarray | None = None  # packed rows read over the network, reused across calls
        self._staging_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._owns_store = False  # from_checkpoint built the EngramStore: close() closes it
        self.fused_reads = 0  # gathers decoded in place from this host's memory
        self.staged_reads = 0  # gathers read with lookup_into, then decoded

    def _check_store(self, store: Any) -> None:
        if not isinstance(store, EngramStore):
            raise InvalidType(f"store: expected an EngramStore holding layer {self.layer_id} (see v41_store_config), "
                              f"got {type(store).__name__}")
        if self.layer_id not in store.get_layer_ids():
            raise InvalidArgument(f"store: holds layers {store.get_layer_ids()}, not layer {self.layer_id}")
        want = v41_store_config(self.config, self.layer_id)
        cols = self.config.cols
        got = {"row_format": store.get_row_format(layer=self.layer_id),
               "embedding_dim": store.get_embedding_dim(layer=self.layer_id),
               "heads": store.get_heads(layer=self.layer_id),
               "table_vocab_sizes": store.get_table_vocab_sizes(layer=self.layer_id)}
        expected = {"row_format": "bytes", "embedding_dim": self.config.row_bytes, "heads": list(range(cols)),
                    "table_vocab_sizes": want.table_vocab_sizes}
        for name, value in expected.items():
            if got[name] != value:
                raise InvalidArgument(f"store: layer {self.layer_id} has {name}={describe(got[name])}, expected "
                                      f"{describe(value)} (build it with v41_store_config(config, layer_id))")

    # ---- rows ---------------------------------------------------------------------------------

    def _row_ids(self, row_ids: Any) -> np.ndarray:
        """This layer's ``[B, L, cols]`` rows from ``[B, L, cols]`` or a hasher's ``[B, L, n_layers, cols]``."""
        if not isinstance(row_ids, np.ndarray) and hasattr(row_ids, "__dlpack__"):  # a CPU tensor (torch, ...)
            row_ids = host_array(row_ids, "row_ids", writable=False).array
        if not isinstance(row_ids, np.ndarray) or row_ids.dtype.kind not in "iu":
            raise InvalidType(f"row_ids: expected an integer NumPy array or CPU tensor [B, L, cols] or "
                              f"[B, L, n_layers, cols], got {getattr(row_ids, 'dtype', type(row_ids).__name__)}")
        cols, n_layers = self.config.cols, len(self.config.layer_ids)
        if row_ids.ndim == 4 and row_ids.shape[2:] == (n_layers, cols):
            row_ids = row_ids[:, :, self.layer_index]
        if row_ids.ndim != 3 or row_ids.shape[2] != cols or 0 in row_ids.shape:
            raise InvalidArgument(f"row_ids: expected shape [B, L, {cols}] or [B, L, {n_layers}, {cols}] with "
                                  f"B, L >= 1, got {row_ids.shape}")
        return np.ascontiguousarray(row_ids, dtype=np.int64)

    def _hash(self, input_ids: Any, token_mask: Any, position_ids: Any) -> np.ndarray:
        if self.hasher is None:
            raise InvalidArgument("input_ids: this V41Engram has no hasher; pass row_ids= (from a V41Hasher run "
                                  "once per step for every layer) or build it with hasher=")
        return self.hasher(input_ids, token_mask, position_ids)[:, :, self.layer_index]

    def rows(self, row_ids: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Decoded rows float32 ``[B, L, cols, head_dim]`` (bf16 values) for ``row_ids`` (rows of the layer's
        table, a NumPy array or CPU tensor); rows holding a NaN code or scale byte 255 are refused, naming the row.
        For an engine's own buffers (bf16, packed, split; -1 padding) use :class:`V41Rows`."""
        ids = self._row_ids(row_ids)
        B, L, cols = ids.shape
        shape = (B, L, cols, self.config.head_dim)
        if out is None:
            out = np.empty(shape, dtype=np.float32)
        elif not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == shape
                  and out.flags.c_contiguous and out.flags.writeable):
            raise InvalidArgument(f"out: expected a writable C-contiguous float32 array of shape {shape}")
        # Per call: a layer populated again moves; read under the checks of a lookup's own read (read_local).
        if self.store.read_local(lambda tables: all(t.flags.c_contiguous for t in tables)
                                 and self._gather_fused(tables, ids, out), layer=self.layer_id):
            self.fused_reads += 1
            return out
        store_ids = ids - self.offsets                                      # (B, L, cols), each column from 0
        bad = (store_ids < 0) | (store_ids >= self.primes)
        if bad.any():
            self._bad_id(ids, int(np.flatnonzero(bad.ravel())[0]))
        self._read_staged(store_ids, out)
        self.staged_reads += 1
        return out

    def _gather_fused(self, tables: list[np.ndarray], ids: np.ndarray, out: np.ndarray) -> bool:
        """Gather and decode from the tables in this host's memory, in one kernel (True: done)."""
        cols, head_dim = self.config.cols, self.config.head_dim
        views = []
        for t in tables:  # one array type for every column, so the kernel indexes them as one tuple
            if t.flags.writeable:
                t = t.view()
                t.flags.writeable = False
            views.append(t)
        flat_ids = ids.reshape(-1, cols)                                     # (B * L, cols)
        status, index = _kernels.gather_decode(tuple(views), flat_ids, self.offsets, DECODE_TABLE, head_dim,
                                               out.reshape(-1, cols, head_dim))
        if status == 1:
            self._bad_id(ids, int(index))
        if status == 2:
            n, c = divmod(int(index), cols)
            row = int(flat_ids[n, c] - self.offsets[c])
            raise InvalidArgument(bad_row_message(f"layer {self.layer_id}, column {c}, table row {row}",
                                                  tables[c][row].reshape(1, -1), 0, ()))
        return True

    def _read_staged(self, store_ids: np.ndarray, out: np.ndarray) -> None:
        """Read packed rows with lookup_into into the reused staging buffer, then decode them into ``out``."""
        n_rows = store_ids.size
        row_bytes = self.config.row_bytes
        acquired = self._staging_lock.acquire(blocking=False)
        try:
            if acquired:  # the shared buffer, grown as needed
                if self._staging is None or self._staging.size < n_rows * row_bytes:
                    self._staging = np.empty(n_rows * row_bytes, dtype=np.uint8)
                flat = self._staging[:n_rows * row_bytes]
            else:  # a concurrent read holds it (a prefetch running beside a forward): a buffer of our own
                flat = np.empty(n_rows * row_bytes, dtype=np.uint8)
            packed = flat.reshape(store_ids.shape + (row_bytes,))
            self.store.lookup_into(store_ids, packed, layer=self.layer_id)
            bad = _kernels.decode_rows(packed.reshape(n_rows, row_bytes), DECODE_TABLE, self.config.head_dim,
                                       out.reshape(n_rows, self.config.head_dim))
            if bad >= 0:
                n, c = divmod(int(bad), self.config.cols)
                row = int(store_ids.reshape(-1, self.config.cols)[n, c])
                raise InvalidArgument(bad_row_message(f"layer {self.layer_id}, column {c}, table row {row}",
                                                      packed.reshape(n_rows, row_bytes)[bad:bad + 1], 0, ()))
        finally:
            if acquired:
                self._staging_lock.release()

    def _bad_id(self, ids: np.ndarray, flat: int) -> None:
        b, rest = divmod(flat, ids.shape[1] * ids.shape[2])
        l, c = divmod(rest, ids.shape[2])
        lo, hi = int(self.offsets[c]), int(self.offsets[c] + self.primes[c])
        raise InvalidArgument(f"row_ids[{b}, {l}, {c}] = {int(ids[b, l, c])} is outside column {c} of layer "
                              f"{self.layer_id}'s table (expected {lo} <= id < {hi}); row ids come from a "
                              "V41Hasher of this config")

    def prefetch(self, input_ids: Any = None, *, row_ids: Any = None, token_mask: Any = None,
                 position_ids: Any = None) -> V41Prefetch:
        """Hash now (or take ``row_ids``) and gather and decode the rows in a background thread."""
        ids = self._row_ids(row_ids) if row_ids is not None else self._row_ids(
            self._hash(input_ids, token_mask, position_ids))
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"v41-engram-l{self.layer_id}")
            future = self._executor.submit(self.rows, ids)
        return V41Prefetch(self.layer_id, ids.shape[:2], future)

    # ---- forward ------------------------------------------------------------------------------

    def forward(self, hidden_states: np.ndarray, input_ids: Any = None, *, row_ids: Any = None,
                token_mask: Any = None, position_ids: Any = None, prefetched: V41Prefetch | None = None) -> np.ndarray:
        """``hidden_states`` float32 ``[B, L, hc_mult, hidden_size]`` -> the same shape, bf16 values (float32).

        Rows come from ``prefetched`` (a :meth:`prefetch` handle), else ``row_ids`` (``[B, L, cols]`` or a
        hasher's ``[B, L, n_layers, cols]``), else ``input_ids`` hashed by this layer's hasher (with
        ``token_mask`` and ``position_ids``). ``token_mask`` (bool ``[B, L]``) also shuts the gate where False.
        """
        h = self._check_hidden(hidden_states)
        B, L, hc, hidden = h.shape
        mask = None
        if token_mask is not None:
            mask = np.asarray(token_mask)
            if mask.dtype != np.bool_ or mask.shape != (B, L):
                raise InvalidArgument(f"token_mask: expected a bool array of shape {(B, L)}, got "
                                      f"{mask.dtype} {mask.shape}")
        if prefetched is not None:
            if not isinstance(prefetched, V41Prefetch):
                raise InvalidType(f"prefetched: expected the V41Prefetch of prefetch(), "
                                  f"got {type(prefetched).__name__}")
            if prefetched.layer_id != self.layer_id or prefetched.shape != (B, L):
                raise InvalidArgument(f"prefetched: rows of layer {prefetched.layer_id} for {prefetched.shape} "
                                      f"tokens, this call is layer {self.layer_id} with {(B, L)}")
            E = prefetched.result()
        else:
            ids = self._row_ids(row_ids) if row_ids is not None else (
                None if input_ids is None else self._hash(input_ids, mask, position_ids))
            if ids is None:
                raise InvalidArgument("input_ids: expected [B, L] token ids (or pass row_ids= or prefetched=), "
                                      "got None")
            if ids.shape[:2] != (B, L):
                raise InvalidArgument(f"{'row_ids' if row_ids is not None else 'input_ids'}: expected B, L = "
                                      f"{(B, L)} (those of hidden_states), got {ids.shape[:2]}")
            E = self.rows(ids)
        kv = E.reshape(B * L, -1) @ self.wkv.T                                  # (B*L, (hc + 1) * hidden)
        _kernels.round_bf16_inplace(kv)
        out = np.empty_like(h)
        _kernels.gate_output(h.reshape(B * L, hc, hidden), kv, self.gate_weight, self.config.rms_norm_eps,
                             _NO_MASK if mask is None else mask.reshape(-1), mask is not None,
                             out.reshape(B * L, hc, hidden))
        return out

    __call__ = forward

    def _check_hidden(self, hidden_states: Any) -> np.ndarray:
        hc, hidden = self.config.hc_mult, self.config.hidden_size
        if not isinstance(hidden_states, np.ndarray):
            raise InvalidType(f"hidden_states: expected a float32 NumPy array [B, L, {hc}, {hidden}], "
                              f"got {type(hidden_states).__name__}")
        if hidden_states.dtype.kind != "f":
            raise InvalidType(f"hidden_states: expected a floating-point dtype (float32), got {hidden_states.dtype}")
        if hidden_states.ndim != 4 or hidden_states.shape[2:] != (hc, hidden) or 0 in hidden_states.shape[:2]:
            raise InvalidArgument(f"hidden_states: expected shape [B, L, hc_mult={hc}, hidden_size={hidden}] "
                                  f"with B, L >= 1, got {hidden_states.shape}")
        return np.ascontiguousarray(hidden_states, dtype=np.float32)

    # ---- checkpoints --------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, config: V41Config, layer_id: int, store: Any = None,
                        hasher: V41Hasher | None = None, *, disk_dir: str | os.PathLike | None = None,
                        local_dir: str | os.PathLike | None = None, row_cache_bytes: int = 0,
                        cache_scope: str = "process", replica_num: int = 1,
                        progress: bool | None = None) -> "V41Engram":
        """Layer ``layer_id`` of a V4.1 safetensors checkpoint (a file, or a directory of shards with or without
        ``model.safetensors.index.json``).

        The table is in ``store`` (an :class:`EngramStore` already holding the layer's table, or a
        ``DistributedStore``), under ``disk_dir`` (files on local SSD) or under ``local_dir`` (files in memory,
        shared by the host's processes): exactly one. For all but an EngramStore the layer's EngramStore is built
        here with ``row_cache_bytes`` and ``cache_scope`` (as :class:`EngramStore` takes them: with
        ``cache_scope="host"`` one hot-row cache for every process of the host that opens the same ``disk_dir``)
        and closed with this layer, and a table not yet there is streamed in from the checkpoint first, column by
        column (:func:`engram_model.v41.load_v41_table`; ``replica_num``, ``progress`` go there). The weights are
        read and checked before anything is written.
        """
        if not isinstance(config, V41Config):
            raise InvalidType(f"config: expected a V41Config, got {type(config).__name__}")
        places = [p for p in (store, disk_dir, local_dir) if p is not None]
        if len(places) != 1:
            raise InvalidArgument(f"store, disk_dir, local_dir: expected exactly one place for the table of layer "
                                  f"{layer_id}, got store={type(store).__name__}, disk_dir={disk_dir!r} and "
                                  f"local_dir={local_dir!r}")
        ckpt = SafetensorsCheckpoint(path)
        weights = load_v41_weights(ckpt, config, layer_id)
        owned = not isinstance(store, EngramStore)
        if owned and store is not None and not hasattr(store, "batch_is_exist"):
            raise InvalidType(f"store: expected an EngramStore or a DistributedStore, got {type(store).__name__}")
        layer = open_v41_table(ckpt, config, layer_id, store, disk_dir=disk_dir, local_dir=local_dir,
                               replica_num=replica_num, progress=progress, row_cache_bytes=row_cache_bytes,
                               cache_scope=cache_scope) if owned else store
        try:
            engram = cls(config, layer_id, weights["wkv"], weights["q_weight"], weights["k_weight"], layer, hasher)
        except BaseException:
            if owned:
                layer.close()
            raise
        engram._owns_store = owned
        return engram

    # ---- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for background reads and stop their thread; the table stays in the store. Safe to call twice.

        An EngramStore built by :meth:`from_checkpoint` is closed too (its table stays in the store)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> "V41Engram":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"V41Engram(layer_id={self.layer_id}, cols={c.cols}, head_dim={c.head_dim}, hc_mult={c.hc_mult}, "
                f"hidden_size={c.hidden_size})")

