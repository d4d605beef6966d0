"""The planning and cache kernels against plain NumPy formulations."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_store.disk import DiskLayout, RowCache
from engram_store.disk import _kernels as dk

SETTINGS = settings(max_examples=60, deadline=None)
_NO_META, _NO_ROWS = np.empty(0, np.int64), np.empty(0, np.uint8)


@st.composite
def lookups(draw):
    row_bytes = draw(st.sampled_from([1, 8, 264, 4096, 5000]))
    sizes = draw(st.lists(st.integers(1, 200), min_size=1, max_size=5))
    M = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**32))
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, n, M) for n in sizes], axis=1)
    return DiskLayout.of(row_bytes, sizes), ids


def _plan(lay, ids, cache=None, tag=1, out=None):
    """A read's two kernels, as the reader calls them: ``((bad, hits, miss_pos, miss_key, offsets, starts, order,
    in_block), row_base, out)`` (bad -1 where every id is in its head; the rest is not valid otherwise)."""
    row_base = np.concatenate(([0], np.cumsum(lay.sizes)[:-1])).astype(np.int64)
    out = np.zeros(ids.size * lay.row_bytes, np.uint8) if out is None else out
    meta, rows = (cache.meta, cache.rows) if cache is not None else (_NO_META, _NO_ROWS)
    miss_pos, miss_key = np.empty(ids.size, np.int64), np.empty(ids.size, np.int64)
    K = dk._serve_hits(ids, np.asarray(lay.sizes, np.int64), row_base, tag, meta, rows, lay.row_bytes, out,
                       lay.row_bytes, miss_pos, miss_key)
    if K < 0:
        return (-1 - K, 0, None, None, None, None, None, None), row_base, out
    plan = dk._plan_read(ids, miss_pos[:K], np.asarray(lay.head_offsets, np.int64), lay.rows_per_block,
                         lay.block_bytes, lay.row_bytes)
    return (-1, ids.size - K, miss_pos[:K], miss_key[:K], *plan), row_base, out


@SETTINGS
@given(lookups())
def test_plan_reads_each_distinct_block_once_and_serves_every_row_from_its_block(case):
    lay, ids = case
    (bad, hits, miss_pos, miss_key, offsets, starts, order, in_block), row_base, _ = _plan(lay, ids)
    M, H = ids.shape
    assert bad == -1 and hits == 0
    np.testing.assert_array_equal(miss_pos, np.arange(M * H))
    heads = np.tile(np.arange(H), M)
    np.testing.assert_array_equal(miss_key, (np.int64(1) << 40) | (row_base[heads] + ids.reshape(-1)))
    # NumPy: the file offset of each row, split into its block and the offset within it
    row_off = np.array([lay.row_offset(h, int(r)) for (_, h), r in np.ndenumerate(ids)], np.int64)
    block = row_off - (row_off - np.asarray(lay.head_offsets)[heads]) % lay.block_bytes
    assert sorted(offsets.tolist()) == np.unique(block).tolist()
    assert starts[0] == 0 and starts[-1] == M * H and np.all(np.diff(starts) >= 1)
    for j, off in enumerate(offsets):
        served = order[starts[j]:starts[j + 1]]
        assert np.all(block[miss_pos[served]] == off)
        np.testing.assert_array_equal(off + in_block[served], row_off[miss_pos[served]])


@SETTINGS
@given(lookups())
def test_plan_reports_the_first_id_outside_its_head(case):
    lay, ids = case
    flat = ids.reshape(-1).copy()
    i = len(flat) // 2
    h = i % ids.shape[1]
    flat[i] = lay.sizes[h] if i % 2 else -1
    (bad, *_), _, _ = _plan(lay, flat.reshape(ids.shape))
    assert bad == i


@SETTINGS
@given(lookups(), st.integers(1, 6), st.sampled_from(["always", "doorkeeper"]), st.integers(0, 2**32))
def test_cache_serves_exactly_the_rows_it_was_given_and_stays_within_capacity(case, sets, admission, seed):
    lay, _ = case
    rb = lay.row_bytes
    cache = RowCache(sets * (7 * rb + 79), rb, admission)
    rng = np.random.default_rng(seed)
    tables = [rng.integers(0, 256, (n, rb), dtype=np.uint8) for n in lay.sizes]
    for _ in range(6):
        M = int(rng.integers(1, 30))
        ids = np.stack([rng.integers(0, min(n, 12), M) for n in lay.sizes], axis=1)  # repeats: hits and evictions
        out = np.full(ids.size * rb, 0xEE, np.uint8)
        (bad, hits, miss_pos, miss_key, *_), _, _ = _plan(lay, ids, cache, out=out)
        want = np.stack([tables[h][ids[:, h]] for h in range(ids.shape[1])], axis=1).reshape(ids.size, rb)
        got = out.reshape(ids.size, rb)
        served = np.setdiff1d(np.arange(ids.size), miss_pos)
        assert served.size == hits
        np.testing.assert_array_equal(got[served], want[served])  # every hit is the right row
        got[miss_pos] = want[miss_pos]  # what the disk read would bring
        cache.fill(miss_key, miss_pos, out)
        assert cache.held() <= cache.capacity_rows
    keys = cache.meta.reshape(-1, 8)[:, 1:]
    held = keys[keys >= 0]
    assert held.size == np.unique(held).size, "a key is cached twice"
