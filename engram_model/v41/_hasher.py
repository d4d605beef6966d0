"""V41Hasher: token ids -> rows of every Engram layer's table, as DeepSeek-V4.1's ``inference/engram.py`` hashes.

At position p of a sequence, with ``c[q] = token_map[ids[q]]`` (DEAD where ``token_mask`` is False)::

    blocked = False
    for s in 0 .. max_ngram - 1:
        blocked |= p - s < 0  or  c[p - s] is DEAD  or  p - s is before the current document's start
        tok[s] = compressed_pad if blocked else c[p - s]      # once blocked, stays blocked
    r = tok[0] * m[0]
    for n in 2 .. max_ngram:
        r ^= tok[n - 1] * m[n - 1]
        row[(n - 2) * n_heads + h] = r % prime[n - 2][h] + offset[(n - 2) * n_heads + h]

Document starts come from ``position_ids`` (slot s is blocked where ``position_ids[p] < s``). Token ids below
the compressed vocabulary times multipliers below ``int64_max / compressed_vocab_size`` cannot overflow.

Serving hashes step by step: :meth:`V41Hasher.begin` gives a :class:`V41HashState` holding, per sequence, the
last ``max_ngram - 1`` compressed ids (DEAD where none); :meth:`V41Hasher.step` hashes new tokens after it and
moves it on; ``state.copy()`` is a snapshot to go back to when speculative tokens are rejected. Steps of any
sizes give the rows of one whole-sequence call. The work is one Numba kernel call
(:func:`engram_model.v41._kernels.hash_step`); :func:`hash_numpy` is the same hash vectorised in NumPy.

Continuous batching (vLLM, SGLang) passes one step's requests flattened, and keeps each request's history in a slot
of one state (``begin(max_slots)``)::

    tokens [T]; request r owns tokens[query_start_loc[r] : query_start_loc[r + 1]] and history[slots[r]]
    doc_start[t]: token t starts a document (as if its position were 0: nothing before it is looked back at)
    step_ragged(..., commit=False): hash a speculative draft, the state stays;  commit(...): the accepted tokens
    move the state, nothing is hashed;  state.reset(slots): those slots start new requests

Every request's rows over all its steps are those of one whole-sequence call on its accepted tokens (with
``position_ids`` restarting at its document starts). One kernel call
(:func:`engram_model.v41._kernels.hash_ragged`) does a step or a commit; :func:`hash_ragged_numpy` is its twin.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engram_store.errors import InvalidArgument, InvalidType, describe, is_int

from .._ngram import int_vector, ragged_arguments, ragged_refused, rows_numpy
from .._tokenizer import as_int_ids
from . import _kernels
from ._config import V41Config
from ._kernels import DEAD
from ._tokens import check_token_map

_EMPTY_MASK = np.ones((1, 1), dtype=np.bool_)
_EMPTY_POSITIONS = np.zeros((1, 1), dtype=np.int64)
_NO_FLAGS = np.zeros(1, dtype=np.bool_)  # stands in for an absent token_mask / doc_start (the kernel skips it)


class V41HashState:
    """Per-sequence hash history of a batch: ``history`` int64 ``[B, max_ngram - 1]``, the compressed id k + 1
    tokens back in column k, DEAD (-1) where there is none (before the start, or a masked token).

    ``copy()`` snapshots it (a few bytes per sequence); ``reset(rows)`` starts those sequences afresh. For
    :meth:`V41Hasher.step_ragged` each row is a slot that one request holds from its arrival until it finishes.
    """

    __slots__ = ("history",)

    def __init__(self, history: np.ndarray):
        self.history = history

    @property
    def batch_size(self) -> int:
        return self.history.shape[0]

    def copy(self) -> "V41HashState":
        return V41HashState(self.history.copy())

    def reset(self, rows: Any = None) -> None:
        """Forget the history of ``rows`` (indices into the batch, or slots; all when None): they start new
        sequences."""
        if rows is None:
            self.history.fill(DEAD)
            return
        idx = as_int_ids(rows, "rows").ravel()
        if idx.size and (idx.min() < 0 or idx.max() >= self.batch_size):
            raise InvalidArgument(f"rows: expected batch rows in [0, {self.batch_size}), got {describe(rows)}")
        self.history[idx] = DEAD

    def __repr__(self) -> str:
        return f"V41HashState(batch_size={self.batch_size}, context={self.history.shape[1]})"


class V41Hasher:
    """The V4.1 n-gram hash of every layer in ``config.layer_ids``, for one token map.

    ``token_map`` is the int64 ``[vocab]`` array of :func:`engram_model.v41.build_token_map` (or
    :func:`load_token_map`); its number of compressed ids must be ``config.compressed_vocab_size``, since the
    multipliers are drawn against it. Output ids are rows of each layer's one table (``row % prime + offset``),
    ``[B, L, len(layer_ids), cols]``. Thread-safe: a state belongs to one caller at a time.
    """

    def __init__(self, config: V41Config, token_map: np.ndarray):
        if not isinstance(config, V41Config):
            raise InvalidType(f"config: expected a V41Config, got {type(config).__name__}")
        token_map = check_token_map(token_map)
        distinct = int(token_map.max()) + 1
        if distinct != config.compressed_vocab_size:
            raise InvalidArgument(f"token_map: has {distinct} compressed ids, expected config.compressed_vocab_size "
                                  f"= {config.compressed_vocab_size} (the hash multipliers are drawn against it: "
                                  "another tokenizer, or a config for another model?)")
        if config.pad_id >= token_map.size:
            raise InvalidArgument(f"config.pad_id: {config.pad_id} is not a token id of the token map "
                                  f"({token_map.size} ids)")
        self.config = config
        self.token_map = token_map
        self.pad = int(token_map[config.pad_id])  # the compressed pad id fills blocked slots
        lids = config.layer_ids
        self.multipliers = np.stack([config.multipliers(lid) for lid in lids])                       # (nl, max_n)
        self.primes = np.array([[p for hs in config.primes(lid) for p in hs] for lid in lids], np.int64)  # (nl, cols)
        self.offsets = np.stack([config.offsets(lid) for lid in lids])                               # (nl, cols)
        self._inv_primes = 1.0 / self.primes
        for arr in (self.multipliers, self.primes, self.offsets, self._inv_primes):
            arr.flags.writeable = False

    @property
    def context(self) -> int:
        """Earlier tokens an n-gram reaches back to: ``max_ngram_size - 1``."""
        return self.config.max_ngram_size - 1

    def begin(self, batch_size: int) -> V41HashState:
        """A fresh state for ``batch_size`` sequences (every slot before their first token is blocked); for
        :meth:`step_ragged`, ``batch_size`` slots (the most requests in flight at once)."""
        if not is_int(batch_size) or batch_size < 1:
            raise InvalidArgument(f"batch_size: expected an integer >= 1, got {describe(batch_size)}")
        return V41HashState(np.full((int(batch_size), self.context), DEAD, dtype=np.int64))

    def __call__(self, input_ids: Any, token_mask: Any = None, position_ids: Any = None) -> np.ndarray:
        """Rows of whole sequences ``input_ids [B, L]``: int64 ``[B, L, len(layer_ids), cols]``."""
        ids = self._ids(input_ids, "input_ids")
        return self._run(ids, token_mask, position_ids, self.begin(max(ids.shape[0], 1)).history)

    hash = __call__

    def step(self, state: V41HashState, tokens: Any, token_mask: Any = None, position_ids: Any = None) -> np.ndarray:
        """Rows of ``tokens [B, T]``, the next T tokens of the state's B sequences; moves the state on.

        ``position_ids`` (optional) gives each token's position in its document, as for a whole sequence.
        """
        if not isinstance(state, V41HashState):
            raise InvalidType(f"state: expected the V41HashState of begin(), got {type(state).__name__}")
        ids = self._ids(tokens, "tokens")
        if state.history.shape != (ids.shape[0], self.context):
            raise InvalidArgument(f"state: holds {state.batch_size} sequences of context "
                                  f"{state.history.shape[1]}, tokens have B = {ids.shape[0]} (context {self.context})")
        return self._run(ids, token_mask, position_ids, state.history)

    def step_ragged(self, state: V41HashState, tokens: Any, slots: Any, query_start_loc: Any, *,
                    token_mask: Any = None, doc_start: Any = None, commit: bool = True) -> np.ndarray:
        """Rows of one engine step of R requests: int64 ``[T, len(layer_ids), cols]``.

        ``tokens`` int ``[T]``, request r's are ``tokens[query_start_loc[r] : query_start_loc[r + 1]]`` (none is
        allowed: its slot stays as it was), the next ones after the history in ``state`` slot ``slots[r]`` (``[R]``,
        distinct). ``query_start_loc`` int ``[R + 1]`` runs from 0 to T, non-decreasing. ``token_mask`` bool
        ``[T]``: False marks a token that is not text (it and the n-grams reaching it hash the pad, as in a
        whole-sequence call). ``doc_start`` bool ``[T]``: True where a new document starts inside a request's
        tokens. ``commit=False`` hashes a speculative draft and leaves the state as it was; :meth:`commit` then
        moves it by the accepted tokens. Nothing is changed when a call is refused.
        """
        return self._ragged(state, tokens, slots, query_start_loc, token_mask, doc_start, True, bool(commit))

    def commit(self, state: V41HashState, tokens: Any, slots: Any, query_start_loc: Any, *,
               token_mask: Any = None, doc_start: Any = None) -> None:
        """Move ``state`` by the accepted tokens of a step hashed with ``commit=False`` (arguments as for
        :meth:`step_ragged`: each request's accepted prefix, none for a fully rejected draft); hashes nothing."""
        self._ragged(state, tokens, slots, query_start_loc, token_mask, doc_start, False, True)

    def _ragged(self, state: V41HashState, tokens: Any, slots: Any, query_start_loc: Any, token_mask: Any,
                doc_start: Any, emit: bool, commit: bool) -> np.ndarray | None:
        if not isinstance(state, V41HashState):
            raise InvalidType(f"state: expected the V41HashState of begin(), got {type(state).__name__}")
        if state.history.shape[1] != self.context:
            raise InvalidArgument(f"state: has context {state.history.shape[1]}, this hasher's is {self.context}")
        ids, starts, where = ragged_arguments(tokens, slots, query_start_loc)
        T = ids.shape[0]
        mask = self._flags(token_mask, "token_mask", (T,), "mask")
        docs = self._flags(doc_start, "doc_start", (T,), "doc_start")
        nl, cols = len(self.config.layer_ids), self.config.cols
        out = np.empty((T if emit else 0, nl, cols), dtype=np.int64)
        kind, at = _kernels.hash_ragged(ids, starts, where, self.token_map, _NO_FLAGS if mask is None else mask,
                                        mask is not None, _NO_FLAGS if docs is None else docs, docs is not None,
                                        state.history, self.pad, self.multipliers, self.primes, self._inv_primes,
                                        self.offsets, self.config.n_heads, emit, commit, out)
        if kind:
            self._ragged_refused(int(kind), int(at), ids, starts, where, state.batch_size)
        return out if emit else None

    def _ragged_refused(self, kind: int, at: int, ids: np.ndarray, starts: np.ndarray, slots: np.ndarray,
                        n_slots: int) -> None:
        """Raise for the problem :func:`~engram_model.v41._kernels.hash_ragged` found (its codes)."""
        ragged_refused(kind, at, ids, starts, slots, n_slots, f"the token map [0, {self.token_map.size})")

    def _ids(self, value: Any, name: str) -> np.ndarray:
        if isinstance(value, np.ndarray) and value.dtype == np.int64 and value.ndim == 2 \
                and value.flags.c_contiguous:
            return value  # the decode fast path: nothing to convert
        ids = as_int_ids(value, name)
        if ids.ndim != 2:
            raise InvalidArgument(f"{name}: expected token ids of shape [B, L], got shape {ids.shape}")
        return np.ascontiguousarray(ids)

    def _flags(self, value: Any, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray | None:
        if value is None:
            return None
        if kind == "positions":
            arr = as_int_ids(value, name)
        else:
            arr = np.asarray(value)
            if arr.dtype != np.bool_:
                meaning = "False: not a text token" if kind == "mask" else "True: a document starts"
                raise InvalidType(f"{name}: expected a bool array ({meaning}), got dtype {arr.dtype}")
        if arr.shape != shape:
            raise InvalidArgument(f"{name}: expected shape {shape} (that of the token ids), got {arr.shape}")
        if kind == "positions" and arr.size and arr.min() < 0:
            at = [int(i) for i in np.unravel_index(int(np.argmax(arr < 0)), arr.shape)]
            raise InvalidArgument(f"{name}: expected positions >= 0 (each token's position in its document), "
                                  f"got {int(arr[tuple(at)])} at {at}")
        return np.ascontiguousarray(arr, dtype=np.int64 if kind == "positions" else np.bool_)

    def _run(self, ids: np.ndarray, token_mask: Any, position_ids: Any, history: np.ndarray) -> np.ndarray:
        B, T = ids.shape
        mask = self._flags(token_mask, "token_mask", (B, T), "mask")
        positions = self._flags(position_ids, "position_ids", (B, T), "positions")
        out = np.empty((B, T, len(self.config.layer_ids), self.config.cols), dtype=np.int64)
        if ids.size == 0:
            return out
        bad = _kernels.hash_step(ids, self.token_map, _EMPTY_MASK if mask is None else mask, mask is not None,
                                 _EMPTY_POSITIONS if positions is None else positions, positions is not None,
                                 history, self.pad, self.multipliers, self.primes, self._inv_primes, self.offsets,
                                 self.config.n_heads, out)
        if bad >= 0:
            b, t = divmod(int(bad), T)
            raise InvalidArgument(f"input_ids: token id {int(ids[b, t])} at [{b}, {t}] is outside the token map "
                                  f"[0, {self.token_map.size})")
        return out

    def hash_numpy(self, input_ids: Any, token_mask: Any = None, position_ids: Any = None) -> np.ndarray:
        """The same rows as a whole-sequence call, computed by :func:`hash_numpy` (vectorised NumPy)."""
        ids = self._ids(input_ids, "input_ids")
        if ids.size and (ids.min() < 0 or ids.max() >= self.token_map.size):
            raise InvalidArgument(f"input_ids: token ids must be in [0, {self.token_map.size})")
        B, T = ids.shape
        return hash_numpy(ids, self.token_map, self.pad, self.multipliers, self.primes, self.offsets,
                          self.config.n_heads, self._flags(token_mask, "token_mask", (B, T), "mask"),
                          self._flags(position_ids, "position_ids", (B, T), "positions"))

    def step_ragged_numpy(self, state: V41HashState, tokens: Any, slots: Any, query_start_loc: Any, *,
                          token_mask: Any = None, doc_start: Any = None, commit: bool = True) -> np.ndarray:
        """The rows (and state) of :meth:`step_ragged`, computed by :func:`hash_ragged_numpy`; checks less."""
        ids = int_vector(tokens, "tokens", "[T]")
        T = ids.shape[0]
        return hash_ragged_numpy(ids, int_vector(query_start_loc, "query_start_loc", "[R + 1]"),
                                 int_vector(slots, "slots", "[R]"), state.history, self.token_map, self.pad,
                                 self.multipliers, self.primes, self.offsets, self.config.n_heads,
                                 self._flags(token_mask, "token_mask", (T,), "mask"),
                                 self._flags(doc_start, "doc_start", (T,), "doc_start"), bool(commit))

    def __repr__(self) -> str:
        c = self.config
        return (f"V41Hasher(layers={list(c.layer_ids)}, max_ngram_size={c.max_ngram_size}, cols={c.cols}, "
                f"vocab={self.token_map.size} -> {c.compressed_vocab_size})")


def hash_numpy(ids: np.ndarray, token_map: np.ndarray, pad: int, multipliers: np.ndarray, primes: np.ndarray,
               offsets: np.ndarray, n_heads: int, token_mask: np.ndarray | None = None,
               position_ids: np.ndarray | None = None) -> np.ndarray:
    """The V4.1 hash of whole sequences in vectorised NumPy: int64 ``[B, L]`` -> ``[B, L, n_layers, cols]``."""
    c = token_map[ids]                                                   # (B, L) compressed
    if token_mask is not None:
        c = np.where(token_mask, c, DEAD)
    B, L = c.shape
    max_n = multipliers.shape[1]
    blocked = np.zeros((B, L), dtype=bool)
    tokens = np.empty((B, L, max_n), dtype=np.int64)                    # (B, L, max_n): s tokens back, pad if blocked
    for s in range(max_n):
        back = np.full((B, L), DEAD, dtype=np.int64)                    # c[p - s], DEAD before the start
        if s < L:
            back[:, s:] = c[:, :L - s]
        blocked |= back == DEAD
        if position_ids is not None:
            blocked |= position_ids < s
        tokens[..., s] = np.where(blocked, pad, back)
    return rows_numpy(tokens, multipliers, primes, offsets, n_heads)


def hash_ragged_numpy(tokens: np.ndarray, query_start_loc: np.ndarray, slots: np.ndarray, history: np.ndarray,
                      token_map: np.ndarray, pad: int, multipliers: np.ndarray, primes: np.ndarray,
                      offsets: np.ndarray, n_heads: int, token_mask: np.ndarray | None = None,
                      doc_start: np.ndarray | None = None, commit: bool = True) -> np.ndarray:
    """:func:`~engram_model.v41._kernels.hash_ragged` in vectorised NumPy (arguments checked by the caller):
    rows ``[T, n_layers, cols]`` of one step, and where ``commit`` the requests' slots of ``history`` moved on."""
    T, R, C = tokens.shape[0], slots.shape[0], history.shape[1]
    every = np.arange(T)
    req = np.repeat(np.arange(R), np.diff(query_start_loc))            # (T,) the request of each token
    local = every - query_start_loc[req]                                # (T,) its index in the request's tokens
    c = token_map[tokens]
    if token_mask is not None:
        c = np.where(token_mask, c, DEAD)
    since = np.full(T, C + 1)                                           # (T,) tokens since a document start, if any
    if doc_start is not None:
        last = np.maximum.accumulate(np.where(doc_start, every, -1))
        since = np.where(last >= query_start_loc[req], every - last, since)
    back = np.arange(C + 1)                                             # (max_n,) s tokens back
    held = history[slots[req]]                                          # (T, C) the request's history
    from_call = local[:, None] >= back                                  # (T, max_n): within this call's tokens
    window = np.where(from_call, c[np.maximum(every[:, None] - back, 0)],
                      np.take_along_axis(held, np.clip(back - local[:, None] - 1, 0, C - 1), axis=1))
    blocked = np.logical_or.accumulate((window == DEAD) | (since[:, None] < back), axis=1)
    out = rows_numpy(np.where(blocked, pad, window), multipliers, primes, offsets, n_heads)
    if commit:
        ends = query_start_loc[1:][query_start_loc[1:] > query_start_loc[:-1]] - 1   # last token of each request
        moved = slots[query_start_loc[1:] > query_start_loc[:-1]]
        history[moved] = np.where(back[:C] <= since[ends, None], window[ends, :C], DEAD)
    return out


