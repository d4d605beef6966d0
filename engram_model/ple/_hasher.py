"""PLEHasher: token ids -> rows of every PLE layer's table, as transformers' ``Qwen4ExpTextNGramEmbedding`` hashes.

Raw token ids, no compression map. At position t, with the ``ngram_size - 1`` tokens of context before the first
position (EOS for a fresh sequence)::

    tok[0] = ids[t]                                 # never replaced, EOS or not
    blocked = False
    for s in 1 .. ngram_size - 1:                   # walking back
        tok[s] = EOS if blocked else ids[t - s]     # the first EOS met is kept, everything older reads EOS
        blocked |= ids[t - s] == EOS
    r = tok[0] * m[0]
    for n in 2 .. ngram_size:                       # int64, wrapping (products of in-vocabulary ids stay < 2**63)
        r ^= tok[n - 1] * m[n - 1]
        row[(n - 2) * heads_per_ngram + j] = r mod size[j'] + offset[j']    # j' that head; mod non-negative

A chunk carries ``ngram_size - 1`` tokens of context: the reference keeps them in its cache and recomputes the
EOS rule over context and chunk, so chunks of any sizes give the rows of one whole-sequence call. Multipliers,
head sizes and offsets come from the config, or from the checkpoint's buffers where it has them
(:func:`engram_model.ple.load_ple_hash_buffers`), as both engines take them.

Serving: :meth:`PLEHasher.begin` gives a :class:`PLEHashState` holding per sequence (or slot) the last
``ngram_size - 1`` tokens, oldest first (EOS at the start); :meth:`PLEHasher.step` hashes a ``[B, T]`` chunk after
it; :meth:`PLEHasher.step_ragged` one continuous-batching step (requests flattened, ``query_start_loc``, a slot per
request, ``commit=False`` for a speculative draft), :meth:`PLEHasher.commit` the accepted tokens, and
``state.reset(slots)`` starts new requests with EOS; :meth:`PLEHasher.hash_ragged` hashes a step after each request's
context as vLLM passes it (no state). One kernel call (:func:`engram_model.ple._kernels.hash_ragged`)
does every form; :func:`hash_numpy` and :func:`hash_ragged_numpy` are its vectorised NumPy twins.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from engram_store.errors import InvalidArgument, InvalidType, describe, is_int

from .._ngram import int_vector, ragged_arguments, ragged_refused, rows_numpy
from .._tokenizer import as_int_ids
from . import _kernels
from ._config import PLEConfig, PLEHashBuffers


class PLEHashState:
    """Per-sequence (or per-slot) context of a batch: ``history`` int64 ``[B, ngram_size - 1]``, the last tokens
    oldest first, EOS where a sequence has had none. ``copy()`` snapshots it; ``reset(rows)`` starts those rows
    (slots) afresh."""

    __slots__ = ("history", "eos")

    def __init__(self, history: np.ndarray, eos: int):
        self.history = history
        self.eos = int(eos)

    @property
    def batch_size(self) -> int:
        return self.history.shape[0]

    def copy(self) -> "PLEHashState":
        return PLEHashState(self.history.copy(), self.eos)

    def reset(self, rows: Any = None) -> None:
        """Give ``rows`` (indices into the batch, or slots; all when None) an EOS context: they start new
        sequences."""
        if rows is None:
            self.history.fill(self.eos)
            return
        idx = as_int_ids(rows, "rows").ravel()
        if idx.size and (idx.min() < 0 or idx.max() >= self.batch_size):
            raise InvalidArgument(f"rows: expected batch rows in [0, {self.batch_size}), got {describe(rows)}")
        self.history[idx] = self.eos

    def __repr__(self) -> str:
        return f"PLEHashState(batch_size={self.batch_size}, context={self.history.shape[1]})"


class PLEHasher:
    """The PLE n-gram hash of every layer in ``config.ple_layer_ids``: int64 ids ``[B, T, len(ple_layer_ids),
    heads]``, global rows of each layer's one table (offsets added). ``buffers`` maps a layer id to the
    :class:`PLEHashBuffers` to use instead of the config's (a checkpoint's); thread-safe, a state belongs to one
    caller at a time."""

    def __init__(self, config: PLEConfig, buffers: Mapping[int, PLEHashBuffers] | None = None):
        if not isinstance(config, PLEConfig):
            raise InvalidType(f"config: expected a PLEConfig, got {type(config).__name__}")
        buffers = dict(buffers or {})
        unknown = sorted(set(buffers) - set(config.ple_layer_ids))
        if unknown:
            raise InvalidArgument(f"buffers: layers {unknown} are not in ple_layer_ids {list(config.ple_layer_ids)}")
        layers = [buffers.get(lid) or config.hash_buffers(lid) for lid in config.ple_layer_ids]
        for lid, buf in zip(config.ple_layer_ids, layers):
            if not isinstance(buf, PLEHashBuffers) or buf.layer_id != lid:
                raise InvalidType(f"buffers[{lid}]: expected the PLEHashBuffers of layer {lid}, got {describe(buf)}")
            if len(buf.multipliers) != config.ngram_size or len(buf.sizes) != config.heads:
                raise InvalidArgument(f"buffers[{lid}]: expected {config.ngram_size} multipliers and {config.heads} "
                                      f"heads, got {len(buf.multipliers)} and {len(buf.sizes)}")
        self.config = config
        self.buffers = {lid: buf for lid, buf in zip(config.ple_layer_ids, layers)}
        self.eos = config.eos_token_id
        self.multipliers = np.array([b.multipliers for b in layers], dtype=np.int64)   # (nl, ngram_size)
        self.sizes = np.array([b.sizes for b in layers], dtype=np.int64)               # (nl, heads)
        self.offsets = np.array([b.offsets for b in layers], dtype=np.int64)           # (nl, heads)
        self._inv_sizes = 1.0 / self.sizes
        for arr in (self.multipliers, self.sizes, self.offsets, self._inv_sizes):
            arr.flags.writeable = False

    @property
    def context(self) -> int:
        """Earlier tokens an n-gram reaches back to: ``ngram_size - 1``."""
        return self.config.context

    def begin(self, batch_size: int) -> PLEHashState:
        """A fresh state for ``batch_size`` sequences (an EOS context each); for :meth:`step_ragged`,
        ``batch_size`` slots (the most requests in flight at once)."""
        if not is_int(batch_size) or batch_size < 1:
            raise InvalidArgument(f"batch_size: expected an integer >= 1, got {describe(batch_size)}")
        return PLEHashState(np.full((int(batch_size), self.context), self.eos, dtype=np.int64), self.eos)

    def __call__(self, input_ids: Any, context: Any = None) -> np.ndarray:
        """Rows of ``input_ids [B, T]`` after ``context [B, ngram_size - 1]`` (the tokens before them, oldest
        first; EOS when None): int64 ``[B, T, len(ple_layer_ids), heads]``."""
        ids = self._ids(input_ids, "input_ids")
        history = self._context(context, ids.shape[0])
        return self._run(ids, history, "input_ids")

    hash = __call__

    def step(self, state: PLEHashState, tokens: Any) -> np.ndarray:
        """Rows of ``tokens [B, T]``, the next T tokens of the state's B sequences; moves the state on."""
        self._check_state(state)
        ids = self._ids(tokens, "tokens")
        if state.batch_size != ids.shape[0]:
            raise InvalidArgument(f"state: holds {state.batch_size} sequences, tokens have B = {ids.shape[0]}")
        return self._run(ids, state.history, "tokens")

    def step_ragged(self, state: PLEHashState, tokens: Any, slots: Any, query_start_loc: Any, *,
                    commit: bool = True) -> np.ndarray:
        """Rows of one engine step of R requests: int64 ``[T, len(ple_layer_ids), heads]``.

        ``tokens`` int ``[T]``, request r's are ``tokens[query_start_loc[r] : query_start_loc[r + 1]]`` (none is
        allowed: its slot stays as it was), the next ones after the context in ``state`` slot ``slots[r]`` (``[R]``,
        distinct). ``query_start_loc`` int ``[R + 1]`` runs from 0 to T, non-decreasing. ``commit=False`` hashes a
        speculative draft and leaves the state as it was; :meth:`commit` then moves it by the accepted tokens.
        Nothing is changed when a call is refused.
        """
        return self._ragged(state, tokens, slots, query_start_loc, True, bool(commit))

    def commit(self, state: PLEHashState, tokens: Any, slots: Any, query_start_loc: Any) -> None:
        """Move ``state`` by the accepted tokens of a step hashed with ``commit=False`` (arguments as for
        :meth:`step_ragged`: each request's accepted prefix, none for a fully rejected draft); hashes nothing."""
        self._ragged(state, tokens, slots, query_start_loc, False, True)

    def hash_ragged(self, tokens: Any, query_start_loc: Any, context: Any) -> np.ndarray:
        """Rows of one engine step as vLLM hashes it (``Qwen4ExpNGramEmbedding.compute_ngram_ids``), without a
        state: ``tokens [T]`` of R requests (``query_start_loc [R + 1]``, from 0 to T), request r's after its own
        ``context[r]`` (``[R, ngram_size - 1]``, the tokens before them, oldest first, EOS where it has none: vLLM's
        ``ngram_context``, rebuilt every step from the accepted tokens) -> int64 ``[T, len(ple_layer_ids), heads]``."""
        starts = int_vector(query_start_loc, "query_start_loc", "[R + 1]")
        R = max(starts.shape[0] - 1, 0)
        state = PLEHashState(self._context(context, R), self.eos)
        return self._ragged(state, tokens, np.arange(R, dtype=np.int64), starts, True, False)

    # ---- checks and the kernel call -------------------------------------------------------------

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, PLEHashState):
            raise InvalidType(f"state: expected the PLEHashState of begin(), got {type(state).__name__}")
        if state.history.shape[1] != self.context or state.history.dtype != np.int64 \
                or not state.history.flags.c_contiguous:
            raise InvalidArgument(f"state: expected a C-contiguous int64 history of context {self.context}, got "
                                  f"{state.history.dtype} {state.history.shape}")

    def _ids(self, value: Any, name: str) -> np.ndarray:
        if isinstance(value, np.ndarray) and value.dtype == np.int64 and value.ndim == 2 \
                and value.flags.c_contiguous:
            return value  # the decode fast path: nothing to convert
        ids = as_int_ids(value, name)
        if ids.ndim != 2:
            raise InvalidArgument(f"{name}: expected token ids of shape [B, T], got shape {ids.shape}")
        return np.ascontiguousarray(ids)

    def _context(self, context: Any, B: int) -> np.ndarray:
        if context is None:
            return np.full((B, self.context), self.eos, dtype=np.int64)
        ctx = as_int_ids(context, "context")
        if ctx.shape != (B, self.context):
            raise InvalidArgument(f"context: expected shape [B, ngram_size - 1] = {[B, self.context]} (the tokens "
                                  f"before input_ids, oldest first), got {list(ctx.shape)}")
        bad = np.flatnonzero((ctx < 0) | (ctx >= self.config.vocab_size))
        if bad.size:
            b, k = divmod(int(bad[0]), self.context)
            raise InvalidArgument(f"context: token id {int(ctx[b, k])} at [{b}, {k}] is outside the vocabulary "
                                  f"[0, {self.config.vocab_size})")
        return np.array(ctx, dtype=np.int64, order="C")

    def _run(self, ids: np.ndarray, history: np.ndarray, name: str) -> np.ndarray:
        """Rows of ``ids [B, T]``, each row a request of T tokens in slot b of ``history`` (moved on)."""
        B, T = ids.shape
        out = np.empty((B, T, len(self.config.ple_layer_ids), self.config.heads), dtype=np.int64)
        if ids.size == 0:
            return out
        starts = np.arange(0, B * T + 1, T, dtype=np.int64)
        kind, at = _kernels.hash_ragged(ids.reshape(-1), starts, np.arange(B, dtype=np.int64), self.config.vocab_size,
                                        self.eos, history, self.multipliers, self.sizes, self._inv_sizes,
                                        self.offsets, self.config.heads_per_ngram, True, True,
                                        out.reshape(B * T, *out.shape[2:]))
        if kind:
            b, t = divmod(int(at), T)
            raise InvalidArgument(f"{name}: token id {int(ids[b, t])} at [{b}, {t}] is outside the vocabulary "
                                  f"[0, {self.config.vocab_size})")
        return out

    def _ragged(self, state: PLEHashState, tokens: Any, slots: Any, query_start_loc: Any, emit: bool,
                commit: bool) -> np.ndarray | None:
        self._check_state(state)
        ids, starts, where = ragged_arguments(tokens, slots, query_start_loc)
        T = ids.shape[0]
        out = np.empty((T if emit else 0, len(self.config.ple_layer_ids), self.config.heads), dtype=np.int64)
        kind, at = _kernels.hash_ragged(ids, starts, where, self.config.vocab_size, self.eos, state.history,
                                        self.multipliers, self.sizes, self._inv_sizes, self.offsets,
                                        self.config.heads_per_ngram, emit, commit, out)
        if kind:
            ragged_refused(int(kind), int(at), ids, starts, where, state.batch_size,
                           f"the vocabulary [0, {self.config.vocab_size})")
        return out if emit else None

    # ---- NumPy twins ----------------------------------------------------------------------------

    def hash_numpy(self, input_ids: Any, context: Any = None) -> np.ndarray:
        """The rows of a whole-sequence call, computed by :func:`hash_numpy` (vectorised NumPy)."""
        ids = self._ids(input_ids, "input_ids")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise InvalidArgument(f"input_ids: token ids must be in [0, {self.config.vocab_size})")
        return hash_numpy(ids, self._context(context, ids.shape[0]), self.eos, self.multipliers, self.sizes,
                          self.offsets, self.config.heads_per_ngram)

    def step_ragged_numpy(self, state: PLEHashState, tokens: Any, slots: Any, query_start_loc: Any, *,
                          commit: bool = True) -> np.ndarray:
        """The rows (and state) of :meth:`step_ragged`, computed by :func:`hash_ragged_numpy`; checks less."""
        return hash_ragged_numpy(int_vector(tokens, "tokens", "[T]"), int_vector(query_start_loc, "query_start_loc",
                                                                          "[R + 1]"),
                                 int_vector(slots, "slots", "[R]"), state.history, self.eos, self.multipliers,
                                 self.sizes, self.offsets, self.config.heads_per_ngram, bool(commit))

    def __repr__(self) -> str:
        c = self.config
        return (f"PLEHasher(layers={list(c.ple_layer_ids)}, ngram_size={c.ngram_size}, heads={c.heads}, "
                f"vocab_size={c.vocab_size}, eos={c.eos_token_id})")


def _windows(back: np.ndarray, eos: int) -> np.ndarray:
    """The EOS rule on windows ``back [..., ngram_size]`` (column s: the token s back): column s reads EOS where an
    EOS sits strictly between the token and s back."""
    seen = np.logical_or.accumulate(back[..., 1:-1] == eos, axis=-1)      # (..., n - 2): an EOS 1..s back
    blocked = np.concatenate([np.zeros(back.shape[:-1] + (2,), dtype=bool), seen], axis=-1)
    return np.where(blocked, eos, back)


def hash_numpy(ids: np.ndarray, context: np.ndarray, eos: int, multipliers: np.ndarray, sizes: np.ndarray,
               offsets: np.ndarray, heads_per_ngram: int) -> np.ndarray:
    """The PLE hash of whole sequences in vectorised NumPy: int64 ``[B, T]`` after ``context [B, C]`` ->
    ``[B, T, n_layers, heads]``."""
    B, T = ids.shape
    C = context.shape[1]
    full = np.concatenate([context, ids], axis=1)                        # (B, C + T), oldest first
    back = np.stack([full[:, C - s:C - s + T] for s in range(C + 1)], axis=-1)   # (B, T, C + 1): s tokens back
    return rows_numpy(_windows(back, eos), multipliers, sizes, offsets, heads_per_ngram)


def hash_ragged_numpy(tokens: np.ndarray, query_start_loc: np.ndarray, slots: np.ndarray, history: np.ndarray,
                      eos: int, multipliers: np.ndarray, sizes: np.ndarray, offsets: np.ndarray, heads_per_ngram: int,
                      commit: bool = True) -> np.ndarray:
    """:func:`~engram_model.ple._kernels.hash_ragged` in vectorised NumPy (arguments checked by the caller): rows
    ``[T, n_layers, heads]`` of one step, and where ``commit`` the requests' slots of ``history`` moved on."""
    T, R, C = tokens.shape[0], slots.shape[0], history.shape[1]
    every = np.arange(T)
    req = np.repeat(np.arange(R), np.diff(query_start_loc))            # (T,) the request of each token
    local = every - query_start_loc[req]                                # (T,) its index in the request's tokens
    back = np.arange(C + 1)                                             # (C + 1,) s tokens back
    held = history[slots[req]]                                          # (T, C) the request's context, oldest first
    from_call = local[:, None] >= back                                  # (T, C + 1): within this call's tokens
    window = np.where(from_call, tokens[np.maximum(every[:, None] - back, 0)],
                      np.take_along_axis(held, np.clip(C - (back - local[:, None]), 0, C - 1), axis=1))
    out = rows_numpy(_windows(window, eos), multipliers, sizes, offsets, heads_per_ngram)
    if commit:
        has = query_start_loc[1:] > query_start_loc[:-1]
        ends = query_start_loc[1:][has] - 1                             # last token of each request with tokens
        history[slots[has]] = window[ends, :C][:, ::-1]                 # its last C tokens, oldest first
    return out
