"""Incremental hashing for decode: each request adds a few tokens per step, its n-grams reach back further.

Hashing the new tokens of a step alone, as a ``[B, 1]`` batch, would left-pad them and give the rows of
n-grams that never occurred. :class:`IncrementalHasher` keeps, per request, the last compressed tokens it
saw (``max_ngram_size - 1`` of them, plus ``max_rollback`` more so that tokens rejected by speculative decoding
can be taken back) and hashes each step's tokens with that left context, so the rows equal those of hashing
the whole sequence at once.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from engram_store._errors import InvalidArgument, InvalidType, describe

from ._hashing import NgramHashMapping, token_ids_2d

STATE_VERSION = 1


class _History:
    __slots__ = ("tokens", "total")

    def __init__(self, tokens: np.ndarray, total: int):
        self.tokens = tokens  # the last compressed tokens, oldest first (at most ``keep``)
        self.total = total    # tokens seen in all, so a short history can tell "sequence start" from "trimmed"


class IncrementalHasher:
    """Per-request n-gram context for decode steps, over one :class:`NgramHashMapping`.

    ``layer_ids`` (default: all layers of the mapping) are hashed in one pass per step. Thread-safe.
    """

    def __init__(self, mapping: NgramHashMapping, layer_ids: Sequence[int] | None = None, max_rollback: int = 64):
        if not isinstance(mapping, NgramHashMapping):
            raise InvalidType(f"mapping: expected an NgramHashMapping, got {type(mapping).__name__}")
        if isinstance(max_rollback, bool) or not isinstance(max_rollback, (int, np.integer)) or max_rollback < 0:
            raise InvalidArgument(f"max_rollback: expected an integer >= 0, got {describe(max_rollback)}")
        self.mapping = mapping
        self.layer_ids = [mapping._check_layer(lid) for lid in (mapping.layer_ids if layer_ids is None
                                                               else layer_ids)]
        self.context = mapping.max_ngram_size - 1
        self.max_rollback = int(max_rollback)
        self._keep = self.context + self.max_rollback
        self._requests: dict[Hashable, _History] = {}
        self._lock = threading.Lock()

    # ---- steps --------------------------------------------------------------------------------

    def hash_step(self, request_ids: Sequence[Hashable], new_token_ids: Any) -> dict[int, np.ndarray]:
        """Rows of the new tokens: ``{layer_id: int64 [B, T, H]}`` for ``new_token_ids`` ``[B, T]`` (T >= 1).

        Request ``request_ids[b]`` gets row ``b``; a request seen for the first time starts a sequence.
        """
        request_ids = list(request_ids)
        new = token_ids_2d(new_token_ids)
        if len(request_ids) != new.shape[0]:
            raise InvalidArgument(f"request_ids: expected {new.shape[0]} ids (one per row of new_token_ids), "
                                  f"got {len(request_ids)}")
        if len(set(request_ids)) != len(request_ids):
            raise InvalidArgument("request_ids: a request appears twice in one step; pass its tokens as one row")
        compressed = self.mapping.prepare_ids(new)
        B, T = compressed.shape
        C = self.context
        window = np.full((B, C + T), self.mapping.pad_id, dtype=np.int64)
        window[:, C:] = compressed
        with self._lock:
            histories = [self._requests.get(r) for r in request_ids]
            for b, history in enumerate(histories):
                if history is not None and C:
                    tail = history.tokens[-C:]
                    window[b, C - tail.size:C] = tail
            rows = self.mapping.hash_prepared(window, self.layer_ids)
            for b, (request_id, history) in enumerate(zip(request_ids, histories)):
                if history is None:
                    history = self._requests[request_id] = _History(np.empty(0, dtype=np.int64), 0)
                history.tokens = np.concatenate((history.tokens, compressed[b]))[-self._keep:]
                history.total += T
        return {lid: np.ascontiguousarray(r[:, C:]) for lid, r in rows.items()}

    def rollback(self, request_id: Hashable, n_tokens: int) -> None:
        """Take back the last ``n_tokens`` tokens of a request (rejected speculative tokens)."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 0:
            raise InvalidArgument(f"n_tokens: expected an integer >= 0, got {describe(n_tokens)}")
        with self._lock:
            history = self._get(request_id)
            if n_tokens > history.total:
                raise InvalidArgument(f"n_tokens: request {request_id!r} has {history.total} tokens, cannot take "
                                      f"back {n_tokens}")
            remaining = history.total - n_tokens
            # After the rollback the request needs min(remaining, context) tokens of context still kept.
            if history.tokens.size - n_tokens < min(remaining, self.context):
                raise InvalidArgument(f"n_tokens: taking back {n_tokens} tokens needs more history than is kept "
                                      f"(max_rollback={self.max_rollback}); build the hasher with a larger "
                                      "max_rollback")
            history.tokens = history.tokens[:history.tokens.size - n_tokens]
            history.total = remaining

    # ---- moving and freeing requests ----------------------------------------------------------

    def export_state(self, request_id: Hashable) -> dict:
        """The request's context as plain data (JSON- and msgpack-friendly), for :meth:`import_state` elsewhere."""
        with self._lock:
            history = self._get(request_id)
            return {"version": STATE_VERSION, "context": self.context, "tokens": history.tokens.tolist(),
                    "total": history.total, "tokenizer_vocab_size": self.mapping.tokenizer_vocab_size,
                    "pad_id": self.mapping.pad_id}

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
        with self._lock:
            self._requests[request_id] = _History(tokens[-self._keep:], total)

    def release(self, request_id: Hashable) -> None:
        """Forget a finished request (unknown ids are ignored)."""
        with self._lock:
            self._requests.pop(request_id, None)

    def __contains__(self, request_id: Hashable) -> bool:
        with self._lock:
            return request_id in self._requests

    def __len__(self) -> int:
        with self._lock:
            return len(self._requests)

    def _get(self, request_id: Hashable) -> _History:
        history = self._requests.get(request_id)
        if history is None:
            raise InvalidArgument(f"request_id: {request_id!r} is not a known request (never stepped, or released)")
        return history
