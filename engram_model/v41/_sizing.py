"""How large a V4.1 hot-row cache must be, before serving (``engram-stats --v41``): a corpus hashed with
``V41Hasher`` and replayed into the hit rate at every size (:mod:`engram_model._replay` has the replay, the
profile's curve and the report, shared with the other model families), and a ``disk_dir`` EngramStore's own
curves summed by n-gram order.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from engram_store.errors import InvalidArgument, describe, is_int

from .._replay import REPLAY_MAX_KEYS, Replay, replay_hasher
from ._config import V41Config
from ._hasher import V41Hasher


def replay_tokens(config: V41Config, token_map: np.ndarray, ids: np.ndarray, batch: int = 256,
                  max_keys: int = REPLAY_MAX_KEYS) -> Replay:
    """Hash ``ids`` (int ``[B, L]``, one sequence per row, -1 after a row's end) and replay its rows."""
    return replay_hasher(V41Hasher(config, token_map), config, ids, batch, max_keys)


def hit_rate_by_order(stats: Mapping[str, Any], n_heads: int, heads: list[int] | None = None,
                      prefix: str = "") -> dict[int, list[dict[str, float]]]:
    """``EngramStore.stats()`` of a V4.1 layer on ``disk_dir`` by n-gram order: ``{n: [{'bytes', 'hit_rate'},
    ...]}`` from ``hit_rate_by_size_per_head`` (``prefix="host_cache_"`` for the host cache's curves). ``heads``:
    the columns the store reads (a head shard's ``get_heads()``), by default all. Every column is looked up once
    a token, so an order's rate is the mean of its columns'."""
    per_head = stats.get(f"{prefix}hit_rate_by_size_per_head")
    ladder = stats.get(f"{prefix}hit_rate_by_size")
    if per_head is None or ladder is None:
        raise InvalidArgument(f"stats: expected {prefix}hit_rate_by_size and {prefix}hit_rate_by_size_per_head (the "
                              f"stats() of a disk_dir EngramStore), got keys {sorted(stats)[:8]}...")
    heads = list(range(len(per_head))) if heads is None else list(heads)
    if len(heads) != len(per_head):
        raise InvalidArgument(f"heads: expected {len(per_head)} columns (one per curve), got {len(heads)}")
    by_order: dict[int, list[list[float]]] = {}
    for col, rates in zip(heads, per_head):
        by_order.setdefault(col // n_heads + 2, []).append(rates)
    return {n: [{"bytes": e["bytes"], "hit_rate": float(np.mean([r[i] for r in rows]))}
                for i, e in enumerate(ladder)] for n, rows in sorted(by_order.items())}


def order_labels(n_heads: int) -> Callable[[int, int], dict[str, int]]:
    """``head_labels`` for ``engram_store.metrics_text`` / ``serve_metrics`` of V4.1 layers: each column's n-gram
    ``order`` (column ``(n - 2) * n_heads + h``) as a label of its series."""
    if not is_int(n_heads) or n_heads < 1:
        raise InvalidArgument(f"n_heads: expected an int >= 1 (V41Config.n_heads), got {describe(n_heads)}")
    return lambda layer_id, head: {"order": head // n_heads + 2}
