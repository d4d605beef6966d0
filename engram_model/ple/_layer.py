"""PLELayer: one Qwen4-Exp PLE (per-layer embedding) layer's forward in NumPy, its table in an EngramStore.

Follows transformers 5.23.0 ``Qwen4ExpTextPLELayer.forward`` (``modeling_qwen4_exp.py``). Before decoder layer
``layer_id - 1``, on the ``hc_count``-stream hidden states ``h [N, hc * H]`` (H = hidden_size)::

    e      = the token's heads' rows, concatenated                     # [N, ple_embed_dim]
    key    = norm_key(e @ key_proj.T)                                  # [N, hc * H], each H-group normed
    value  = e @ value_proj.T                                          # [N, H], shared by the streams
    query  = norm_query(h)                                             # [N, hc * H]
    d_s    = <key_s, query_s> / sqrt(H)                                # per stream s
    g_s    = sigmoid(sign(d_s) * sqrt(max(|d_s|, 1e-6)))
    gated  = g_s * value                                               # [N, hc, H] -> [N, hc * H]
    out    = gated + silu(conv1d(norm_conv(gated)))                    # depthwise, dilation ngram_size, causal
    norm(x) per H-group = x * rsqrt(mean(x^2) + eps) * (1 + w)         # Gemma style: the stored w is an offset

The convolution's taps for token t are t, t - d, t - 2d, ... (d = ngram_size, ``ple_conv_kernel_size`` taps; the
weight's last tap is t); positions before a sequence's start read the request's state, the last ``(kernel - 1) *
d`` normed rows (zeros for a new request). The decoder adds ``out`` to ``h``. ``forward`` returns ``out``.

With ``dtype="bfloat16"`` (a bf16 model, as released) every value is rounded to bf16 where the reference's ops
round theirs (products, sums and norms computed in float32 in between), so the output is within bf16 rounding of
transformers'; ``dtype="float32"`` rounds nothing (a float32 model). Sums run in float32, in NumPy's order.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping

import numpy as np

from engram_store import EngramStore
from engram_store.errors import InvalidArgument, InvalidType, describe, is_int

from .._ngram import int_vector
from .._rows_format import decode_rows, round_bf16
from .._table_load import as_checkpoint, table_options
from ._checkpoint import _buffers, load_ple_weights, open_ple_table
from ._config import PLEConfig, PLEHashBuffers, ple_store_config

#: The gate's floor on |d| before the square root (the reference's clamp_min).
GATE_CLAMP = 1e-6
DTYPES = ("bfloat16", "float32")


class PLEConvState:
    """Per-request (or per-slot) state of the short convolution: ``rows`` float32 ``[S, (kernel - 1) * ngram_size,
    hc * H]``, the last normed rows oldest first (zeros before a request's first token). ``copy()`` snapshots it;
    ``reset(slots)`` starts those slots afresh."""

    __slots__ = ("rows",)

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    @property
    def batch_size(self) -> int:
        return self.rows.shape[0]

    def copy(self) -> "PLEConvState":
        return PLEConvState(self.rows.copy())

    def reset(self, slots: Any = None) -> None:
        if slots is None:
            self.rows.fill(0.0)
            return
        idx = int_vector(slots, "slots", "[R]")
        if idx.size and (idx.min() < 0 or idx.max() >= self.batch_size):
            raise InvalidArgument(f"slots: expected slots in [0, {self.batch_size}), got {describe(slots)}")
        self.rows[idx] = 0.0

    def __repr__(self) -> str:
        return f"PLEConvState(batch_size={self.batch_size}, rows={self.rows.shape[1]})"


def _weight(weights: Mapping[str, Any], name: str, shape: tuple[int, ...]) -> np.ndarray:
    value = weights.get(name)
    if not isinstance(value, np.ndarray) or value.dtype.kind != "f":
        raise InvalidType(f"weights[{name!r}]: expected a float NumPy array {list(shape)}, got {describe(value)}")
    if value.shape != shape:
        raise InvalidArgument(f"weights[{name!r}]: expected shape {list(shape)}, got {list(value.shape)}")
    if not np.isfinite(value).all():
        raise InvalidArgument(f"weights[{name!r}]: holds NaN or infinity")
    return np.ascontiguousarray(value, dtype=np.float32)


class PLELayer:
    """One PLE layer (see the module docstring). ``weights`` as :func:`engram_model.ple.load_ple_weights` gives
    them (``key_proj``, ``value_proj``, ``norm_key``, ``norm_query``, ``norm_conv``, ``conv1d [hc * H, kernel]``,
    ``table_scale``); ``table`` (optional) the layer's EngramStore in the layout of :func:`ple_store_config`, read
    by :meth:`rows`; ``buffers`` the checkpoint's hash layout where it differs from the config's."""

    def __init__(self, config: PLEConfig, layer_id: int, weights: Mapping[str, Any], table: EngramStore | None = None,
                 *, buffers: PLEHashBuffers | None = None, dtype: str = "bfloat16"):
        if not isinstance(config, PLEConfig):
            raise InvalidType(f"config: expected a PLEConfig, got {type(config).__name__}")
        if dtype not in DTYPES:
            raise InvalidArgument(f"dtype: expected one of {list(DTYPES)}, got {describe(dtype)}")
        config.ple_index(layer_id)
        self.config, self.layer_id, self.dtype = config, int(layer_id), dtype
        C, H, E = config.hc_count * config.hidden_size, config.hidden_size, config.ple_embed_dim
        self.key_proj = _weight(weights, "key_proj", (C, E))
        self.value_proj = _weight(weights, "value_proj", (H, E))
        self.norm_key, self.norm_query, self.norm_conv = (1.0 + _weight(weights, n, (C,)) for n in
                                                          ("norm_key", "norm_query", "norm_conv"))
        self.conv1d = _weight(weights, "conv1d", (C, config.ple_conv_kernel_size))
        self.table_scale = weights.get("table_scale")
        self.buffers = buffers or config.hash_buffers(layer_id)
        if table is not None:
            self._check_table(table)
        self.table = table
        self._owns_table = False  # from_checkpoint opened the table: close() closes it

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, config: PLEConfig, layer_id: int, store: Any = None, *,
                        disk_dir: str | os.PathLike | None = None, local_dir: str | os.PathLike | None = None,
                        row_cache_bytes: int = 0, cache_scope: str = "process", replica_num: int = 1,
                        progress: bool | None = None, dtype: str = "bfloat16") -> "PLELayer":
        """PLE layer ``layer_id`` of a Qwen4-Exp safetensors checkpoint: its weights, its hash buffers (the
        checkpoint's, as the engines take them: ``layer.buffers``) and its table.

        The table is in ``store`` (an :class:`EngramStore` already holding it, or a ``DistributedStore``), under
        ``disk_dir`` (files on local SSD) or under ``local_dir`` (files in memory, shared by the host's
        processes): exactly one. For all but an EngramStore the table is opened here with ``row_cache_bytes`` and
        ``cache_scope`` and closed with the layer (:meth:`close`), and streamed in from the checkpoint first where it
        is not there yet (:func:`engram_model.ple.open_ple_table`; ``replica_num``, ``progress`` go there). The
        weights are read and checked before anything is written.
        """
        if not isinstance(config, PLEConfig):
            raise InvalidType(f"config: expected a PLEConfig, got {type(config).__name__}")
        table_options(layer_id, store, disk_dir, local_dir, row_cache_bytes, cache_scope)  # one place, or refused
        ckpt = as_checkpoint(path)
        buffers = _buffers(ckpt, config, layer_id, None)
        weights = load_ple_weights(ckpt, config, layer_id)
        owned = not isinstance(store, EngramStore)
        table = open_ple_table(ckpt, config, layer_id, store, disk_dir=disk_dir, local_dir=local_dir,
                               replica_num=replica_num, progress=progress, row_cache_bytes=row_cache_bytes,
                               cache_scope=cache_scope, buffers=buffers) if owned else store
        try:
            layer = cls(config, layer_id, weights, table, buffers=buffers, dtype=dtype)
        except BaseException:
            if owned:
                table.close()
            raise
        layer._owns_table = owned
        return layer

    def close(self) -> None:
        """Close the table where :meth:`from_checkpoint` opened it (it stays where it is); safe to call twice."""
        if self._owns_table and self.table is not None:
            self.table.close()

    def __enter__(self) -> "PLELayer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_table(self, table: Any) -> None:
        if not isinstance(table, EngramStore):
            raise InvalidType(f"table: expected an EngramStore holding layer {self.layer_id}, got "
                              f"{type(table).__name__}")
        want = ple_store_config(self.config, self.layer_id, self.buffers)
        got = (table.get_row_format(layer=self.layer_id), table.get_embedding_dim(layer=self.layer_id),
               table.get_table_vocab_sizes(layer=self.layer_id))
        if got != (want.row_format, want.embedding_dim, want.table_vocab_sizes):
            raise InvalidArgument(f"table: layer {self.layer_id} holds {got[0]} rows of {got[1]} in heads of "
                                  f"{got[2][:3]}..., expected {want.row_format} x {want.embedding_dim} in heads of "
                                  f"{want.table_vocab_sizes[:3]}... (ple_store_config)")

    def _r(self, x: np.ndarray) -> np.ndarray:
        """``x`` as the model's dtype holds it: rounded to bf16, or as it is."""
        return round_bf16(x) if self.dtype == "bfloat16" else x.astype(np.float32, copy=False)

    def begin(self, batch_size: int) -> PLEConvState:
        """A fresh convolution state (zeros) for ``batch_size`` sequences or slots."""
        if not is_int(batch_size) or batch_size < 1:
            raise InvalidArgument(f"batch_size: expected an integer >= 1, got {describe(batch_size)}")
        c = self.config
        return PLEConvState(np.zeros((int(batch_size), c.conv_state_len, c.hc_count * c.hidden_size), np.float32))

    # ---- rows ---------------------------------------------------------------------------------

    def rows(self, row_ids: Any) -> np.ndarray:
        """The table's rows of ``row_ids`` (``[..., heads]`` global rows of the layer's table, as the hasher gives
        them for this layer) decoded to float32 ``[..., heads, head_dim]`` (bf16 values)."""
        if self.table is None:
            raise InvalidArgument(f"table: this PLELayer has no table; build it with table= (layer {self.layer_id}'s "
                                  "EngramStore) or pass embeddings to forward()")
        ids = np.asarray(row_ids)
        heads = self.config.heads
        if ids.dtype.kind not in "iu" or ids.ndim < 1 or ids.shape[-1] != heads:
            raise InvalidArgument(f"row_ids: expected integer ids [..., {heads}], got {ids.dtype} {ids.shape}")
        local = (ids.reshape(-1, 1, heads).astype(np.int64) - np.asarray(self.buffers.offsets, np.int64))
        raw = self.table.lookup(local)                                         # (N, 1, heads, store_dim)
        return decode_rows(raw, self.config.row_format, self.table_scale).reshape(*ids.shape, -1)

    # ---- forward ------------------------------------------------------------------------------

    def forward(self, hidden_states: Any, embeddings: Any, state: PLEConvState | None = None) -> np.ndarray:
        """Whole sequences: ``hidden_states [B, T, hc * H]`` and their rows ``embeddings`` (``[B, T,
        ple_embed_dim]`` or ``[B, T, heads, head_dim]``) -> the layer's output ``[B, T, hc * H]`` (float32).
        ``state`` (a :meth:`begin` state of B sequences): the convolution reads its rows before the first
        token and moves on; None: every sequence starts fresh."""
        h, e = self._inputs(hidden_states, embeddings, 3)
        B, T, C = h.shape
        if state is None:
            state = self.begin(B)
        elif not isinstance(state, PLEConvState) or state.rows.shape != (B, self.config.conv_state_len, C):
            raise InvalidArgument(f"state: expected the PLEConvState of begin({B}), got {describe(state)}")
        gated, normed = self._gated(h.reshape(B * T, C), e.reshape(B * T, -1))
        conv = self._conv(state.rows, normed.reshape(B, T, C))                  # (B, T, C), the state moved on
        return self._r(gated.reshape(B, T, C) + conv)

    __call__ = forward

    def forward_ragged(self, hidden_states: Any, embeddings: Any, state: PLEConvState, slots: Any,
                       query_start_loc: Any) -> np.ndarray:
        """One continuous-batching step: ``hidden_states [T, hc * H]`` and ``embeddings [T, ...]`` of R requests
        flattened (request r's are rows ``query_start_loc[r] : query_start_loc[r + 1]``), each continuing from its
        slot ``slots[r]`` of ``state``, which moves on -> ``[T, hc * H]``. Snapshot with ``state.copy()`` to take
        back a draft."""
        h, e = self._inputs(hidden_states, embeddings, 2)
        T, C = h.shape
        starts = int_vector(query_start_loc, "query_start_loc", "[R + 1]")
        where = int_vector(slots, "slots", "[R]")
        if not isinstance(state, PLEConvState) or state.rows.shape[1:] != (self.config.conv_state_len, C):
            raise InvalidType(f"state: expected a PLEConvState of begin(), got {describe(state)}")
        if starts.shape[0] != where.shape[0] + 1 or starts[0] != 0 or starts[-1] != T \
                or (np.diff(starts) < 0).any():
            raise InvalidArgument(f"query_start_loc: expected R + 1 = {where.shape[0] + 1} non-decreasing offsets "
                                  f"from 0 to T = {T}, got {describe(starts.tolist())}")
        if where.size and (where.min() < 0 or where.max() >= state.batch_size or np.unique(where).size < where.size):
            raise InvalidArgument(f"slots: expected distinct slots in [0, {state.batch_size}), got "
                                  f"{describe(where.tolist())}")
        gated, normed = self._gated(h, e.reshape(T, -1))
        out = np.empty_like(gated)
        for r, slot in enumerate(where.tolist()):
            lo, hi = int(starts[r]), int(starts[r + 1])
            if hi > lo:
                rows = state.rows[slot:slot + 1]
                out[lo:hi] = self._conv(rows, normed[None, lo:hi])[0]        # rows moved on in place
        return self._r(gated + out)

    def _inputs(self, hidden_states: Any, embeddings: Any, ndim: int) -> tuple[np.ndarray, np.ndarray]:
        c = self.config
        C, E = c.hc_count * c.hidden_size, c.ple_embed_dim
        h = np.asarray(hidden_states)
        if h.dtype.kind != "f" or h.ndim != ndim or h.shape[-1] != C or 0 in h.shape:
            lead = "[B, T" if ndim == 3 else "[T"
            raise InvalidArgument(f"hidden_states: expected float {lead}, hc_count * hidden_size = {C}], got "
                                  f"{h.dtype} {h.shape}")
        e = np.asarray(embeddings)
        lead = h.shape[:-1]
        if e.dtype.kind != "f" or e.shape not in (lead + (E,), lead + (c.heads, c.head_dim)):
            shapes = f"{list(lead) + [E]} or {list(lead) + [c.heads, c.head_dim]}"
            raise InvalidArgument(f"embeddings: expected float {shapes} (the rows of hidden_states' tokens), got "
                                  f"{e.dtype} {e.shape}")
        return self._r(h.astype(np.float32)), self._r(e.astype(np.float32))

    def _norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """Grouped RMSNorm over each hidden_size channels of ``x [N, hc * H]``, times ``1 + w``."""
        N, C = x.shape
        g = x.reshape(N, -1, self.config.hidden_size)                           # (N, hc, H)
        ms = np.mean(np.square(g), axis=-1, keepdims=True, dtype=np.float32)
        normed = (g * (1.0 / np.sqrt(ms + np.float32(self.config.rms_norm_eps)))).reshape(N, C)   # x * rsqrt
        return self._r(normed * weight)

    def _gated(self, h: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``gated [N, hc * H]`` and its normed rows (the convolution's input) for hidden ``h`` and rows ``e``."""
        r, c = self._r, self.config
        N, H, hc = h.shape[0], c.hidden_size, c.hc_count
        key = self._norm(r(e @ self.key_proj.T), self.norm_key).reshape(N, hc, H)
        value = r(e @ self.value_proj.T)                                        # (N, H)
        query = self._norm(h, self.norm_query).reshape(N, hc, H)
        d = r(r(np.sum(r(key * query), axis=-1, dtype=np.float32)) / np.float32(math.sqrt(H)))   # (N, hc)
        g = r(np.sqrt(r(np.maximum(np.abs(d), np.float32(GATE_CLAMP))))) * np.sign(d)
        sig = r(1.0 / (1.0 + np.exp(-g, dtype=np.float32)))
        gated = r(sig[..., None] * value[:, None, :]).reshape(N, hc * H)        # (N, hc * H)
        return gated, self._norm(gated, self.norm_conv)

    def _conv(self, state: np.ndarray, normed: np.ndarray) -> np.ndarray:
        """``silu(conv1d)`` of ``normed [B, T, C]`` after ``state [B, L, C]`` (the last L normed rows), which moves
        on in place: tap k of token t reads t - (kernel - 1 - k) * ngram_size."""
        B, T, C = normed.shape
        L, K, d = state.shape[1], self.config.ple_conv_kernel_size, self.config.ngram_size
        x = np.concatenate([state, normed], axis=1)                             # (B, L + T, C)
        acc = np.zeros((B, T, C), dtype=np.float32)
        for k in range(K):
            at = L - (K - 1 - k) * d
            acc += x[:, at:at + T] * self.conv1d[:, k]
        state[:] = x[:, T:]
        conv = self._r(acc)
        return self._r(conv / (1.0 + np.exp(-conv, dtype=np.float32)))

    def __repr__(self) -> str:
        c = self.config
        return (f"PLELayer(layer_id={self.layer_id}, heads={c.heads}, head_dim={c.head_dim}, hc_count={c.hc_count}, "
                f"hidden_size={c.hidden_size}, dtype={self.dtype!r})")
