"""Incremental hashing for decode: each request adds a few tokens per step, its n-grams reach back further.

Hashing the new tokens of a step alone, as a ``[B, 1]`` batch, would left-pad them and give the rows of
n-grams that never occurred. :class:`IncrementalHasher` keeps, per request, the last compressed tokens it
saw (``max_ngram_size - 1`` of them, plus ``max_rollback`` more so that tokens rejected by speculative decoding
can be taken back) and hashes each step's tokens with that left context, so the rows equal those of hashing
the whole sequence at once.

The kept tokens of all requests live in one slot table (a ring of ``keep`` tokens per slot, with the ring's
head, the number of tokens kept and the number seen); a dict maps request ids to slots and released slots are
reused. A step is one kernel call for the whole batch (:func:`engram_model.demo._kernels.hash_step`): it reads each
request's context from its slot, hashes the new tokens of every layer and appends them to the slot.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from engram_store.errors import InvalidArgument, InvalidType, describe, is_int

from . import _kernels
from ._hasher import NgramHashMapping

STATE_VERSION = 1
#: Requests a hasher holds before its slot table first grows (it doubles whenever it is full).
INITIAL_CAPACITY = 64


def _check_count(name: str, value: Any, minimum: int) -> int:
    if not is_int(value) or value < minimum:
        raise InvalidArgument(f"{name}: expected an integer >= {minimum}, got {describe(value)}")
    return int(value)


class IncrementalHasher:
    """Per-request n-gram context for decode steps, over one :class:`NgramHashMapping`.

    ``layer_ids`` (default: all layers of the mapping) are hashed in one pass per step. ``initial_capacity``
    requests fit before the slot table grows (it doubles as needed; released slots are reused). Thread-safe.
    """

    def __init__(self, mapping: NgramHashMapping, layer_ids: Sequence[int] | None = None, max_rollback: int = 64,
                 initial_capacity: int = INITIAL_CAPACITY):
        if not isinstance(mapping, NgramHashMapping):
            raise InvalidType(f"mapping: expected an NgramHashMapping, got {type(mapping).__name__}")
        max_rollback = _check_count("max_rollback", max_rollback, 0)
        capacity = _check_count("initial_capacity", initial_capacity, 1)
        self.mapping = mapping
        self.layer_ids = [mapping._check_layer(lid) for lid in (mapping.layer_ids if layer_ids is None
                                                               else layer_ids)]
        if not self.layer_ids:
            raise InvalidArgument(f"layer_ids: expected at least one of {mapping.layer_ids}, got an empty list")
        self.context = mapping.max_ngram_size - 1
        self.max_rollback = max_rollback
        self._keep = self.context + self.max_rollback
        # The hash of every listed layer, as the kernel reads it (C-contiguous, fixed dtypes: one signature).
        self._multipliers = np.stack([mapping.layer_multipliers[lid] for lid in self.layer_ids]).astype(np.int64)
        self._primes = np.array([mapping.get_table_vocab_sizes(lid) for lid in self.layer_ids], dtype=np.int64)
        self._inv_primes = 1.0 / self._primes                       # (n_layers, H) float64
        self._pad_id = np.int64(mapping.pad_id)
        self._min_n = np.int64(mapping.min_ngram_size)
        self._n_head = np.int64(mapping.n_head_per_ngram)
        # The slot table: row s is one request's last compressed tokens, a ring written at head[s].
        self._ring = np.zeros((capacity, self._keep), dtype=np.int64)  # (S, keep)
        self._head = np.zeros(capacity, dtype=np.int64)                # where the next token goes
        self._count = np.zeros(capacity, dtype=np.int64)               # tokens kept, <= keep
        self._total = np.zeros(capacity, dtype=np.int64)               # tokens seen since the start
        self._slots: dict[Hashable, int] = {}
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest free slot
        self._lock = threading.Lock()

    # ---- steps --------------------------------------------------------------------------------

    def hash_step(self, request_ids: Sequence[Hashable], new_token_ids: Any) -> dict[int, np.ndarray]:
        """Rows of the new tokens: ``{layer_id: int64 [B, T, H]}`` for ``new_token_ids`` ``[B, T]`` (T >= 1).

        Request ``request_ids[b]`` gets row ``b``; a request seen for the first time starts a sequence.
        The returned arrays are the caller's: later steps do not write to them.
        """
        request_ids = list(request_ids)
        compressed = np.ascontiguousarray(self.mapping.prepare_ids(new_token_ids))  # (B, T) int64
        B, T = compressed.shape
        if len(request_ids) != B:
            raise InvalidArgument(f"request_ids: expected {B} ids (one per row of new_token_ids), "
                                  f"got {len(request_ids)}")
        if len(set(request_ids)) != B:
            raise InvalidArgument("request_ids: a request appears twice in one step; pass its tokens as one row")
        out = np.empty((len(self.layer_ids), B, T, self._primes.shape[1]), dtype=np.int64)  # (n_layers, B, T, H)
        with self._lock:
            get = self._slots.get
            slots = [get(r, -1) for r in request_ids]
            if -1 in slots:
                slots = [s if s >= 0 else self._new_slot(r) for r, s in zip(request_ids, slots)]
            _kernels.hash_step(compressed, np.array(slots, dtype=np.int64), self._ring, self._head, self._count,
                               self._total, self._pad_id, self._multipliers, self._primes, self._inv_primes,
                               self._min_n, self._n_head, out)
        return {lid: out[i] for i, lid in enumerate(self.layer_ids)}

    def rollback(self, request_id: Hashable, n_tokens: int) -> None:
        """Take back the last ``n_tokens`` tokens of a request (rejected speculative tokens)."""
        if not is_int(n_tokens) or n_tokens < 0:
            raise InvalidArgument(f"n_tokens: expected an integer >= 0, got {describe(n_tokens)}")
        n_tokens = int(n_tokens)
        with self._lock:
            slot = self._get(request_id)
            total, kept = int(self._total[slot]), int(self._count[slot])
            if n_tokens > total:
                raise InvalidArgument(f"n_tokens: request {request_id!r} has {total} tokens, cannot take "
                                      f"back {n_tokens}")
            remaining = total - n_tokens
            # After the rollback the request needs min(remaining, context) tokens of context still kept.
            if kept - n_tokens < min(remaining, self.context):
                raise InvalidArgument(f"n_tokens: taking back {n_tokens} tokens needs more history than is kept "
                                      f"(max_rollback={self.max_rollback}); build the hasher with a larger "
                                      "max_rollback")
            self._head[slot] = (int(self._head[slot]) - n_tokens) % self._keep
            self._count[slot] = kept - n_tokens
            self._total[slot] = remaining

    # ---- moving and freeing requests ----------------------------------------------------------

    def export_state(self, request_id: Hashable) -> dict:
        """The request's context as plain data (JSON- and msgpack-friendly), for :meth:`import_state` elsewhere."""
        with self._lock:
            slot = self._get(request_id)
            kept = int(self._count[slot])
            oldest_first = (int(self._head[slot]) - kept + np.arange(kept)) % self._keep
            return {"version": STATE_VERSION, "context": self.context,
                    "tokens": self._ring[slot, oldest_first].tolist(), "total": int(self._total[slot]),
                    "tokenizer_vocab_size": self.mapping.tokenizer_vocab_size, "pad_id": self.mapping.pad_id}

    def import_state(self, request_id: Hashable, state: dict) -> None:
        """Continue a request exported by another hasher of the same configuration (e.g. prefill -> decode)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise InvalidArgument(f"state: expected a dict from export_state() (version {STATE_VERSION}), "
                                  f"got {describe(state)}")
        mine = {"context": self.context, "tokenizer_vocab_size": self.mapping.tokenizer_vocab_size,
                "pad_id": self.mapping.pad_id}
        for name, value in mine.items():
            if state.get(name) != value:
                raise InvalidArgument(f"state: exported with {name}={state.get(name)!r}, this hasher has {value!r}; "
                                      "both sides must use the same Engram configuration and tokenizer")
        tokens = np.asarray(state.get("tokens"), dtype=np.int64).ravel()
        total = state.get("total")
        if not isinstance(total, int) or total < tokens.size:
            raise InvalidArgument(f"state: 'total' must be an integer >= the {tokens.size} tokens, got {total!r}")
        tokens = tokens[-self._keep:]
        with self._lock:
            slot = self._slots.get(request_id)
            if slot is None:
                slot = self._new_slot(request_id)
            self._ring[slot, :tokens.size] = tokens
            self._head[slot] = tokens.size % self._keep
            self._count[slot] = tokens.size
            self._total[slot] = total

    def release(self, request_id: Hashable) -> None:
        """Forget a finished request (unknown ids are ignored); its slot serves the next new request."""
        with self._lock:
            slot = self._slots.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)

    def __contains__(self, request_id: Hashable) -> bool:
        with self._lock:
            return request_id in self._slots

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    @property
    def capacity(self) -> int:
        """Requests the slot table holds before it grows again."""
        with self._lock:
            return self._ring.shape[0]

    # ---- the slot table (callers hold the lock) -----------------------------------------------

    def _get(self, request_id: Hashable) -> int:
        slot = self._slots.get(request_id)
        if slot is None:
            raise InvalidArgument(f"request_id: {request_id!r} is not a known request (never stepped, or released)")
        return slot

    def _new_slot(self, request_id: Hashable) -> int:
        """An empty slot for a request that starts a sequence."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._head[slot] = self._count[slot] = self._total[slot] = 0
        self._slots[request_id] = slot
        return slot

    def _grow(self) -> None:
        """Double the slot table; the new slots join the free list."""
        old = self._ring.shape[0]
        new = 2 * old
        self._ring = np.concatenate([self._ring, np.zeros_like(self._ring)])  # (2S, keep)
        self._head, self._count, self._total = (np.concatenate([a, np.zeros_like(a)])
                                                for a in (self._head, self._count, self._total))
        self._free.extend(range(new - 1, old - 1, -1))
