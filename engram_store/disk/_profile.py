"""Warm start of the hot-row cache: a frequency profile of the rows a workload looks up, and the pinning of its most
frequent rows.

A profile is a ``.npz`` file (``engram-stats --profile PATH`` writes one from token ids; :func:`save_profile`
from any counts)::

    format      "engram-profile-v1"
    layer_ids   int64 [n_layers]
    l{L}_heads  int64 [K]   head (column) of each row, most frequent first
    l{L}_rows   int64 [K]   row within that head's table
    l{L}_counts int64 [K]   lookups of it in the profiled traffic

:func:`warm_layer` reads the most frequent rows of a layer from its file and pins them in the layer's cache
(:meth:`RowCache.pin`): CLOCK passes pinned rows by, so the rows common to all traffic stay while the other ways
serve what is recent. On the standard library's V4.1 traffic (``bench/bench_cache_policy.py``) pinning the top
rows of a profile taken from a prefix of the stream in 2 of each set's 7 ways beats an exact LRU of the whole
cache at 0.1%, 1% and 10% of the distinct rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument, InvalidType, describe, is_int
from . import _kernels as k
from ._cache import MAX_PINNED_WAYS
from ._reader import DiskLayer, _Batch, default_engine

FORMAT = "engram-profile-v1"
#: Rows read per round while warming (the rows and their blocks' buffers stay in memory one round at a time).
WARM_CHUNK_ROWS = 1 << 16


@dataclass(frozen=True)
class LayerProfile:
    """One layer's profiled rows, most frequent first."""

    heads: np.ndarray   # int64 [K]
    rows: np.ndarray    # int64 [K]
    counts: np.ndarray  # int64 [K]

    @classmethod
    def from_counts(cls, heads: np.ndarray, rows: np.ndarray, counts: np.ndarray) -> "LayerProfile":
        """Sorted by count, most frequent first (ties by head, then row)."""
        heads, rows, counts = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (heads, rows, counts))
        if not heads.size == rows.size == counts.size:
            raise InvalidArgument(f"profile: expected heads, rows and counts of one length, got {heads.size}, "
                                  f"{rows.size}, {counts.size}")
        order = np.lexsort((rows, heads, -counts))
        return cls(heads[order], rows[order], counts[order])


def save_profile(path: str | os.PathLike, layers: dict[int, LayerProfile]) -> None:
    """Write ``{layer_id: LayerProfile}`` to ``path`` (a ``.npz`` file, written whole or not at all)."""
    if not isinstance(layers, dict) or not layers:
        raise InvalidArgument(f"layers: expected a non-empty {{layer_id: LayerProfile}} dict, got {describe(layers)}")
    arrays = {"format": np.array(FORMAT), "layer_ids": np.array(sorted(layers), dtype=np.int64)}
    for lid, prof in layers.items():
        if not isinstance(prof, LayerProfile):
            raise InvalidType(f"layers[{lid}]: expected a LayerProfile, got {type(prof).__name__}")
        arrays.update({f"l{lid}_heads": prof.heads, f"l{lid}_rows": prof.rows, f"l{lid}_counts": prof.counts})
    path = os.fspath(path)
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def load_profile(path: str | os.PathLike) -> dict[int, LayerProfile]:
    """The profile written by :func:`save_profile` (or ``engram-stats --profile``)."""
    try:
        with np.load(os.fspath(path), allow_pickle=False) as z:
            if "format" not in z or str(z["format"]) != FORMAT:
                raise InvalidArgument(f"profile: {os.fspath(path)} is not an {FORMAT} file")
            return {int(lid): LayerProfile(z[f"l{lid}_heads"], z[f"l{lid}_rows"], z[f"l{lid}_counts"])
                    for lid in z["layer_ids"]}
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidArgument(f"profile: cannot read {os.fspath(path)}: {exc}") from None


def default_warm_rows(layer: DiskLayer, max_ways: int = MAX_PINNED_WAYS) -> int:
    """How many rows a warm start pins by default: ``max_ways`` of 7 ways' worth of the cache."""
    return layer.cache.capacity_rows * max_ways // k.WAYS


def warm_layer(layer: DiskLayer, profile: LayerProfile, max_rows: int | None = None,
               max_ways: int = MAX_PINNED_WAYS) -> int:
    """Read the ``max_rows`` most frequent rows of ``profile`` (default :func:`default_warm_rows`) from the
    layer's file and pin them in its cache, at most ``max_ways`` pinned ways a set; returns how many were pinned.
    Rows outside the layer's heads raise InvalidArgument (a profile of another layout)."""
    if not isinstance(layer, DiskLayer):
        raise InvalidType(f"layer: expected a DiskLayer, got {type(layer).__name__}")
    if layer.cache is None:
        raise InvalidArgument(f"layer: disk layer {layer.layer_id} has no row cache to warm")
    if not isinstance(profile, LayerProfile):
        raise InvalidType(f"profile: expected a LayerProfile, got {type(profile).__name__}")
    limit = default_warm_rows(layer, max_ways) if max_rows is None else max_rows
    if not is_int(limit) or limit < 0:
        raise InvalidArgument(f"max_rows: expected an int >= 0 or None, got {describe(max_rows)}")
    heads, rows = profile.heads[:limit], profile.rows[:limit]
    H = layer.num_heads
    bad = (heads < 0) | (heads >= H)
    bad[~bad] |= (rows[~bad] < 0) | (rows[~bad] >= layer.n_rows[heads[~bad]])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InvalidArgument(f"profile: entry {i} is row {int(rows[i])} of head {int(heads[i])}, outside layer "
                              f"{layer.layer_id} ({H} heads of {layer.layout.sizes[:4]}... rows)")
    pinned = 0
    for a in range(0, heads.size, WARM_CHUNK_ROWS):
        h, r = heads[a:a + WARM_CHUNK_ROWS], rows[a:a + WARM_CHUNK_ROWS]
        out = np.empty(h.size * layer.row_bytes, dtype=np.uint8)
        read_pairs(layer, h, r, out)
        keys = (np.int64(layer.tag) << k.KEY_ROW_BITS) | (layer.row_base[h] + r)
        pinned += layer.cache.pin(keys, out, max_ways)
    return pinned


class _PairJob:
    """A read of rows given as (head, row) pairs, in the shape :class:`_Batch` takes."""

    def __init__(self, layer: DiskLayer, heads: np.ndarray, rows: np.ndarray, out: np.ndarray):
        lay = layer.layout
        self.layer, self.out = layer, out
        block = np.asarray(lay.head_offsets, dtype=np.int64)[heads] + (rows // lay.rows_per_block) * lay.block_bytes
        self.offsets, inverse = np.unique(block, return_inverse=True)
        self.order = np.argsort(inverse, kind="stable")
        self.starts = np.searchsorted(inverse[self.order], np.arange(self.offsets.size + 1)).astype(np.int64)
        self.in_block = (rows % lay.rows_per_block) * lay.row_bytes
        self.miss_pos = np.arange(heads.size, dtype=np.int64)
        self.blocks = int(self.offsets.size)


def read_pairs(layer: DiskLayer, heads: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """Row ``rows[i]`` of head ``heads[i]`` into ``out[i * row_bytes:]``, from the file (never the cache)."""
    job = _PairJob(layer, heads, rows, out)
    if not job.blocks:
        return
    fd = layer.enter()
    try:
        batch = _Batch([job], [fd])
        (layer.engine or default_engine()).read(batch, layer.direct)
        batch.check()
    finally:
        layer.leave()
