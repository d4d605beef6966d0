"""How large a PLE hot-row cache must be, before serving: ``engram-stats --ple``.

The replay and report every family shares (:mod:`engram_model._replay`: an LRU miss-ratio curve over a spatially
hashed sample, exact working set and first-touch bound, per layer and n-gram order, or a profile's most frequent
rows) over the PLE geometry: :func:`sizing_geometry` names a PLE config's layers, heads and rows as that report
reads them, and :func:`replay_tokens` hashes a corpus of raw token ids (the model's own tokenizer's) with
:class:`~engram_model.ple.PLEHasher`, each sequence from an EOS context, in steps of ``batch`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .._replay import REPLAY_MAX_KEYS, Replay, replay_hasher
from ._config import PLEConfig, PLEHashBuffers
from ._hasher import PLEHasher


@dataclass(frozen=True)
class SizingGeometry:
    """A PLE config's tables in the names the sizing report reads: ``cols`` heads per layer, ``n_heads`` of each
    order 2..``max_ngram_size``, ``rows`` of each layer's table (padding included), ``row_bytes``."""

    layer_ids: tuple[int, ...]
    cols: int
    n_heads: int
    max_ngram_size: int
    row_bytes: int
    rows: tuple[int, ...]

    def num_embeddings(self, layer_id: int) -> int:
        return self.rows[self.layer_ids.index(layer_id)]


def sizing_geometry(config: PLEConfig, buffers: Mapping[int, PLEHashBuffers] | None = None) -> SizingGeometry:
    """The sizing geometry of ``config`` (its tables' rows by ``buffers`` where a checkpoint gave them)."""
    rows = tuple((buffers or {}).get(lid, config.hash_buffers(lid)).rows for lid in config.ple_layer_ids)
    return SizingGeometry(config.ple_layer_ids, config.heads, config.heads_per_ngram, config.ngram_size,
                          config.row_bytes, rows)


def replay_tokens(config: PLEConfig, ids: np.ndarray, batch: int = 256, max_keys: int = REPLAY_MAX_KEYS,
                  buffers: Mapping[int, PLEHashBuffers] | None = None) -> Replay:
    """Hash ``ids`` (int ``[B, L]``, one sequence per row, -1 after a row's end) and replay its rows."""
    return replay_hasher(PLEHasher(config, buffers), sizing_geometry(config, buffers), ids, batch, max_keys)
