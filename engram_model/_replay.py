"""How large a hot-row cache must be, before serving: a corpus's rows (or a profile) replayed into the hit rate at
every size, for any model family's geometry (``engram-stats --v41``, ``--ple``).

* **tokens**: the corpus is hashed as the model does (a family's hasher, each sequence in steps of ``batch``
  tokens, the layers' rows of a step looked up one layer after the other) and the rows are replayed into the same
  miss-ratio curve a serving process keeps (:class:`engram_store.disk.MissRatioCurve`: an LRU stack over a
  spatially hashed sample, here of up to 2**20 rows, so a corpus of up to that many distinct rows is replayed
  exactly). Every layer shares one stack, as every layer of a row size shares one cache. The working set and the
  first-touch bound (the hit rate of a cache of unbounded size, which still misses every first touch) are counted
  exactly, a bit per row.
* **a profile** (``engram-stats --profile``: every looked-up row with its count, no order): the hit rate of a
  cache holding the S most frequent rows (each missed once), what a warm start pins (``warm_cache``). It knows
  nothing of locality: on the standard library's V4.1 traffic an LRU hit 24.7% at 0.1% of the working set where
  the most frequent rows hit 13.0% (54.4% and 58.3% at 20% and 100%): replay the tokens where you have them.

A curve is reported over ``SIZE_LADDER`` shares of the working set (the distinct rows looked up: a larger cache
hits no more), as ``row_cache_bytes`` (``bytes_for_rows``), per layer and per n-gram order (column ``(n - 2) *
n_heads + h`` of a layer is head h of order n), with the smallest cache that reaches a hit rate the user names.
A geometry names ``layer_ids``, ``cols``, ``num_embeddings(layer_id)``, ``n_heads`` per order, ``max_ngram_size``
and ``row_bytes`` (a ``V41Config``, or ``engram_model.ple``'s sizing geometry of a ``PLEConfig``).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
from numba import njit

from engram_store.disk import SIZE_LADDER, LayerProfile, MissRatioCurve, bytes_for_rows
from engram_store.errors import InvalidArgument, describe


#: Rows the replay tracks at most (~80 MiB): a corpus with fewer distinct rows is replayed exactly.
REPLAY_MAX_KEYS = 1 << 20


#: Sizes searched for a target hit rate: this many a doubling.
TARGET_STEPS_PER_OCTAVE = 32


@njit(cache=True, nogil=True)
def _first_touches(rows, seen, firsts):
    """Count in ``firsts[c]`` the rows of column c never looked up before (``seen``: a bit per table row)."""
    n, C = rows.shape
    for t in range(n):
        for c in range(C):
            r = rows[t, c]
            bit = np.uint8(1 << (r & 7))
            if not seen[r >> 3] & bit:
                seen[r >> 3] |= bit
                firsts[c] += 1


class Replay:
    """The rows of a corpus, replayed: a curve, and exact lookups and first touches per layer and column.
    ``config``: a V41Config, or another family's geometry with the same names (``layer_ids``, ``cols``,
    ``num_embeddings(layer_id)``, ``n_heads`` per order, ``max_ngram_size``, ``row_bytes``)."""

    def __init__(self, config: Any, max_keys: int = REPLAY_MAX_KEYS):
        self.config = config
        self.curve = MissRatioCurve(max_keys)
        self.col0 = {lid: self.curve.add_columns(config.cols) for lid in config.layer_ids}
        self.looked = {lid: np.zeros(config.cols, dtype=np.int64) for lid in config.layer_ids}
        self.firsts = {lid: np.zeros(config.cols, dtype=np.int64) for lid in config.layer_ids}
        self._seen = {lid: np.zeros(config.num_embeddings(lid) // 8 + 1, dtype=np.uint8) for lid in config.layer_ids}
        self._row_base = np.zeros(config.cols, dtype=np.int64)  # rows are the layer's table rows already

    def step(self, rows: np.ndarray) -> None:
        """One step's rows, ``[T, n_layers, cols]`` as the hasher gives them, layer after layer."""
        for j, lid in enumerate(self.config.layer_ids):
            ids = np.ascontiguousarray(rows[:, j, :])
            self.curve.observe(ids, self._row_base, j + 1, self.col0[lid])
            self.looked[lid] += ids.shape[0]
            _first_touches(ids, self._seen[lid], self.firsts[lid])

    def hits(self, lid: int, sizes: np.ndarray) -> np.ndarray:
        """Estimated hits ``[cols, len(sizes)]`` of layer ``lid``'s columns in an LRU of each size (rows)."""
        col0 = self.col0[lid]
        return self.curve.hits(range(col0, col0 + self.config.cols), sizes)[0]


def replay_hasher(hasher: Any, config: Any, ids: np.ndarray, batch: int = 256,
                  max_keys: int = REPLAY_MAX_KEYS) -> Replay:
    """Hash ``ids`` (one sequence per row, -1 after a row's end) with any family's ``hasher`` (``begin(1)``, then
    ``step(state, [1, T])`` -> ``[1, T, n_layers, cols]``), each sequence in steps of ``batch`` tokens, and replay
    its rows into a :class:`Replay` of ``config``'s geometry (``layer_ids``, ``cols``, ``num_embeddings``)."""
    if batch < 1:
        raise InvalidArgument(f"batch: expected an int >= 1, got {describe(batch)}")
    replay = Replay(config, max_keys)
    for seq in np.atleast_2d(ids):
        seq = seq[seq >= 0]
        state = hasher.begin(1)
        for a in range(0, seq.size, batch):
            replay.step(hasher.step(state, seq[None, a:a + batch])[0])  # [T, n_layers, cols]
    return replay


class ProfileCurve:
    """A profile's counts as a curve: at each size S, the hits of a cache holding the S most frequent rows, each
    missed once (see the module docstring); in the shape of :class:`Replay`."""

    def __init__(self, config: Any, profiles: Mapping[int, LayerProfile]):
        missing = [lid for lid in config.layer_ids if lid not in profiles]
        if missing:
            raise InvalidArgument(f"profile: expected layers {list(config.layer_ids)}, it has no layer {missing} "
                                  f"(it holds {sorted(profiles)})")
        self.config = config
        self.looked, self.firsts = {}, {}
        cols, counts = [], []
        for j, lid in enumerate(config.layer_ids):
            prof = profiles[lid]
            if prof.heads.size and (prof.heads.min() < 0 or prof.heads.max() >= config.cols):
                raise InvalidArgument(f"profile: layer {lid} names columns up to {int(prof.heads.max())}, the "
                                      f"config has {config.cols} (another config's profile?)")
            self.looked[lid] = np.bincount(prof.heads, weights=prof.counts, minlength=config.cols).astype(np.int64)
            self.firsts[lid] = np.bincount(prof.heads, minlength=config.cols).astype(np.int64)
            cols.append(prof.heads + j * config.cols)
            counts.append(prof.counts)
        order = np.argsort(-np.concatenate(counts), kind="stable")  # most frequent first, every layer together
        self._cols = np.concatenate(cols)[order]
        self._hits = np.concatenate(counts)[order] - 1  # a held row's lookups after its first

    def hits(self, lid: int, sizes: np.ndarray) -> np.ndarray:
        j, C = self.config.layer_ids.index(lid), self.config.cols
        out = np.zeros((C, len(sizes)))
        for i, size in enumerate(sizes):
            top = int(round(size))
            every = np.bincount(self._cols[:top], weights=self._hits[:top], minlength=C * len(self.config.layer_ids))
            out[:, i] = every[j * C:(j + 1) * C]
        return out


def sizing_report(source: Replay | ProfileCurve, hit_rate: float | None = None) -> dict[str, Any]:
    """The curve of every layer and of the cache they share, per order, the working set, the first-touch bound,
    and with ``hit_rate`` the smallest cache reaching it (see the module docstring)."""
    config = source.config
    row_bytes = config.row_bytes
    universe = sum(config.num_embeddings(lid) for lid in config.layer_ids)
    looked = sum(int(source.looked[lid].sum()) for lid in config.layer_ids)
    firsts = sum(int(source.firsts[lid].sum()) for lid in config.layer_ids)
    ladder = np.array([max(1.0, f * firsts) for f in SIZE_LADDER])  # past the working set nothing changes
    hits = {lid: source.hits(lid, ladder) for lid in config.layer_ids}
    curve = lambda h, n: [{"bytes": bytes_for_rows(round(s), row_bytes), "rows": int(round(s)),
                           "hit_rate": float(x) / n if n else 0.0} for s, x in zip(ladder, h)]
    layers = {}
    for lid in config.layer_ids:
        h, n_col = hits[lid], source.looked[lid]
        orders = {}
        for n in range(2, config.max_ngram_size + 1):
            cols = slice((n - 2) * config.n_heads, (n - 1) * config.n_heads)
            orders[n] = [x["hit_rate"] for x in curve(h[cols].sum(axis=0), int(n_col[cols].sum()))]
        layers[lid] = {"rows": config.num_embeddings(lid), "lookups": int(n_col.sum()),
                       "working_set_rows": int(source.firsts[lid].sum()),
                       "first_touch_bound": _bound(int(n_col.sum()), int(source.firsts[lid].sum())),
                       "hit_rate_by_size": curve(h.sum(axis=0), int(n_col.sum())), "hit_rate_by_order": orders}
    report = {"row_bytes": row_bytes, "rows": universe, "lookups": looked, "working_set_rows": firsts,
              "working_set_bytes": bytes_for_rows(firsts, row_bytes), "first_touch_bound": _bound(looked, firsts),
              "hit_rate_by_size": curve(sum(hits[lid].sum(axis=0) for lid in hits), looked), "layers": layers}
    if hit_rate is not None:
        rows = _smallest_reaching(source, hit_rate, universe, looked)
        report["target"] = {"hit_rate": hit_rate, "rows": rows,
                            "bytes": bytes_for_rows(rows, row_bytes) if rows is not None else None}
    return report


def _smallest_reaching(source: Replay | ProfileCurve, hit_rate: float, universe: int, looked: int) -> int | None:
    """The smallest size (rows, on a grid of ``TARGET_STEPS_PER_OCTAVE`` sizes a doubling) whose hit rate is at
    least ``hit_rate``, by bisection (the curve never falls as the cache grows); None if no size reaches it."""
    octaves = max(1, math.ceil(math.log2(max(universe, 2))))
    grid = np.unique(np.minimum(np.ceil(np.exp2(np.arange(octaves * TARGET_STEPS_PER_OCTAVE + 1)
                                                / TARGET_STEPS_PER_OCTAVE)), universe))
    rate = lambda i: sum(float(source.hits(lid, grid[i:i + 1]).sum()) for lid in source.config.layer_ids) \
        / max(looked, 1)
    if rate(grid.size - 1) < hit_rate - 1e-12:
        return None
    lo, hi = -1, grid.size - 1  # rate(hi) reaches it; rate(lo) does not (-1: nothing)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if rate(mid) >= hit_rate - 1e-12 else (mid, hi)
    return int(grid[hi])


def _bound(looked: int, firsts: int) -> float:
    return (looked - firsts) / looked if looked else 0.0
