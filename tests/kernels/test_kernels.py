"""The Numba kernels against plain NumPy formulations of the same operations."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_store import kernels as k

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def ranges_in(draw, max_limit: int = 4096):
    """(limit, offsets, lengths) with every range inside [0, limit)."""
    limit = draw(st.integers(0, max_limit))
    n = draw(st.integers(0, 20))
    offsets, lengths = [], []
    for _ in range(n):
        o = draw(st.integers(0, limit))
        offsets.append(o)
        lengths.append(draw(st.integers(0, limit - o)))
    return limit, np.array(offsets, dtype=np.int64), np.array(lengths, dtype=np.int64)


@SETTINGS
@given(ranges_in(), st.integers(0, 2**32), st.sampled_from([1, 4, 8]), st.integers(0, 7))
def test_gather_then_scatter_equals_slicing(case, seed, scale, slack):
    # Scaled ranges take the 4- and 8-byte word paths; ``slack`` leaves a ragged tail on the buffers.
    limit, offsets, lengths = case
    limit, offsets, lengths = limit * scale + slack, offsets * scale, lengths * scale
    src = np.random.default_rng(seed).integers(0, 256, limit, dtype=np.uint8)
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    assert k.check_ranges(offsets, lengths, limit) == -1
    assert k.gather_ranges(src, offsets, lengths, out) == out.size
    expected = np.concatenate([src[o:o + n] for o, n in zip(offsets, lengths)] + [np.empty(0, np.uint8)])
    np.testing.assert_array_equal(out, expected)
    dst = np.zeros(limit, dtype=np.uint8)
    k.scatter_ranges(out, dst, offsets, lengths)
    ref = np.zeros(limit, dtype=np.uint8)
    for o, n, piece in zip(offsets, lengths, np.split(expected, np.cumsum(lengths)[:-1]) if lengths.size else []):
        ref[o:o + n] = piece
    np.testing.assert_array_equal(dst, ref)


def _pieces_reference(lengths: list[int], piece: int) -> list[list[int]]:
    """Plain Python: a range of >= piece bytes alone, the others run greedily into pieces of <= piece bytes."""
    pieces: list[list[int]] = []
    run: list[int] = []
    for i, n in enumerate(lengths):
        if n >= piece or sum(lengths[j] for j in run) + n > piece:
            if run:
                pieces.append(run)
            run = []
        run.append(i)
        if n >= piece:
            pieces.append(run)
            run = []
    if run:
        pieces.append(run)
    return pieces


@SETTINGS
@given(st.lists(st.one_of(st.integers(0, 40), st.integers(0, 300)), max_size=60), st.integers(1, 100))
def test_plan_pieces_matches_a_greedy_python_cut(lengths, piece):
    pairs = np.zeros((len(lengths), 2), dtype=np.int64)
    pairs[:, 0] = np.arange(len(lengths)) * 1000
    pairs[:, 1] = lengths
    bounds, sizes = k.plan_pieces(pairs, sum(lengths), piece)
    expected = _pieces_reference(lengths, piece)
    assert [list(range(lo, hi)) for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist())] == expected
    assert sizes.tolist() == [sum(lengths[i] for i in p) for p in expected]
    assert all(s <= piece or hi - lo == 1 for s, lo, hi in zip(sizes, bounds[:-1], bounds[1:]))


_I64 = st.integers(-2**63, 2**63 - 1)


@SETTINGS
@given(st.lists(st.tuples(_I64, _I64), max_size=12), st.integers(0, 2**62))
def test_check_ranges_matches_exact_integer_arithmetic(pairs, limit):
    offsets = np.array([p[0] for p in pairs], dtype=np.int64)
    lengths = np.array([p[1] for p in pairs], dtype=np.int64)
    expected = next((i for i, (o, n) in enumerate(pairs) if o < 0 or n < 0 or o + n > limit), -1)
    assert k.check_ranges(offsets, lengths, limit) == expected


@st.composite
def id_batches(draw):
    """(ids [M, H], num_rows [H]) with every id valid."""
    H = draw(st.integers(1, 6))
    M = draw(st.integers(1, 40))
    num_rows = np.array(draw(st.lists(st.integers(1, 50), min_size=H, max_size=H)), dtype=np.int64)
    seed = draw(st.integers(0, 2**32))
    ids = np.random.default_rng(seed).integers(0, num_rows, size=(M, H), dtype=np.int64)
    return ids, num_rows


@SETTINGS
@given(id_batches(), st.data())
def test_first_bad_row_finds_the_first_offender(batch, data):
    ids, num_rows = batch
    assert k.first_bad_row(ids, num_rows) == -1
    flat = data.draw(st.integers(0, ids.size - 1))
    m, h = divmod(flat, ids.shape[1])
    bad = ids.copy()
    bad[m, h] = data.draw(st.sampled_from([-1, int(num_rows[h]), 2**63 - 1, -2**63]))
    got = k.first_bad_row(bad, num_rows)
    assert got == flat
    # ... and it is the first in row-major order.
    mask = (bad < 0) | (bad >= num_rows)
    assert got == int(np.flatnonzero(mask.ravel())[0])


def _draw_heads(data, H: int) -> np.ndarray:
    """A non-empty list of distinct heads in any order."""
    return np.array(data.draw(st.permutations(range(H))), dtype=np.int64)[:data.draw(st.integers(1, H))]


def _listed_segment(tables: list[np.ndarray], heads: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """The listed heads' tables back to back in one "segment": (row_bytes, base byte offsets, segment bytes)."""
    row_bytes = tables[0].shape[1] * tables[0].dtype.itemsize
    base = np.concatenate(([0], np.cumsum([tables[h].shape[0] * row_bytes for h in heads])[:-1])).astype(np.int64)
    return row_bytes, base, np.concatenate([tables[h].ravel() for h in heads]).view(np.uint8)


@SETTINGS
@given(id_batches(), st.data())
def test_plan_ranges_and_scatter_reproduce_a_numpy_gather(batch, data):
    ids, num_rows = batch
    M, H = ids.shape
    D = data.draw(st.integers(1, 5))
    heads = _draw_heads(data, H)
    tables = [np.random.default_rng(h).standard_normal((int(num_rows[h]), D)).astype(np.float32) for h in range(H)]

    uniq, starts, inverse = k.plan_unique_rows(ids, heads)
    for j, h in enumerate(heads):
        np.testing.assert_array_equal(uniq[starts[j]:starts[j + 1]], np.unique(ids[:, h]))
    unlisted = np.setdiff1d(np.arange(H), heads)
    assert (inverse[:, unlisted] == -1).all()
    for h in heads:
        np.testing.assert_array_equal(uniq[inverse[:, h]], ids[:, h])

    # Lay the listed heads' tables out back to back in one "segment" and read the ranges back to back.
    row_bytes, base, segment = _listed_segment(tables, heads)
    offsets, lengths, range_head = k.rows_to_ranges(uniq, starts, base, row_bytes)
    assert k.check_ranges(offsets, lengths, segment.size) == -1
    assert lengths.sum() == uniq.size * row_bytes
    # Adjacent rows are merged: no two consecutive ranges of one head touch.
    touching = (range_head[1:] == range_head[:-1]) & (offsets[:-1] + lengths[:-1] == offsets[1:])
    assert not touching.any()
    got = np.empty(int(lengths.sum()), dtype=np.uint8)
    k.gather_ranges(segment, offsets, lengths, got)
    rows = got.view(np.float32).reshape(-1, D)

    out = np.zeros((M, H, D), dtype=np.float32)
    k.scatter_rows(rows, inverse, heads, 0, out)
    expected = np.zeros((M, H, D), dtype=np.float32)
    for h in heads:
        expected[:, h] = tables[h][ids[:, h]]
    np.testing.assert_array_equal(out, expected)

    # The local-direct gather reads the same rows straight from the float32 segment.
    local = np.zeros((M, H, D), dtype=np.float32)
    base_elems = np.zeros(H, dtype=np.int64)
    base_elems[heads] = base // 4
    k.gather_rows_local(segment.view(np.float32), base_elems, ids, heads, D, local)
    np.testing.assert_array_equal(local, expected)


@SETTINGS
@given(id_batches(), st.data())
def test_direct_pairs_read_the_listed_heads_rows_in_output_order(batch, data):
    ids, num_rows = batch
    M, H = ids.shape
    D = data.draw(st.integers(1, 5))
    itemsize = data.draw(st.sampled_from([1, 2, 4, 8]))
    dtype = {1: np.uint8, 2: np.uint16, 4: np.float32, 8: np.float64}[itemsize]
    heads = _draw_heads(data, H)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32)))
    tables = [rng.integers(0, 200, (int(num_rows[h]), D)).astype(dtype) for h in range(H)]
    row_bytes, base, segment = _listed_segment(tables, heads)

    pairs = k.direct_pairs(ids, heads, base, row_bytes)
    assert pairs.shape == (M * heads.size, 2) and (pairs[:, 1] == row_bytes).all()
    got = np.empty(M * heads.size * row_bytes, dtype=np.uint8)
    assert k.gather_pairs(segment, pairs, got, got.size) == -1
    expected = np.stack([tables[h][ids[:, h]] for h in heads], axis=1)  # [M, K, D]
    np.testing.assert_array_equal(got.view(dtype).reshape(M, heads.size, D), expected)
    with pytest.raises(ValueError, match="base_offsets: expected"):
        k.direct_pairs(ids, heads, np.append(base, 0), row_bytes)


def test_rows_to_ranges_merges_runs():
    rows = np.array([0, 1, 2, 5, 7, 8, 0, 1], dtype=np.int64)
    starts = np.array([0, 6, 8], dtype=np.int64)
    offsets, lengths, heads = k.rows_to_ranges(rows, starts, np.array([0, 1000], dtype=np.int64), 10)
    assert offsets.tolist() == [0, 50, 70, 1000]
    assert lengths.tolist() == [30, 10, 20, 20]
    assert heads.tolist() == [0, 0, 0, 1]


def test_readonly_inputs_are_accepted():
    src = np.arange(32, dtype=np.uint8)
    src.flags.writeable = False
    out = np.empty(4, dtype=np.uint8)
    k.gather_ranges(src, np.array([3], dtype=np.int64), np.array([4], dtype=np.int64), out)
    assert out.tolist() == [3, 4, 5, 6]


@pytest.mark.parametrize("call, match", [
    (lambda: k.check_ranges(np.zeros(2, np.int32), np.zeros(2, np.int64), 4), "offsets: expected a 1-D int64"),
    (lambda: k.check_ranges(np.zeros(2, np.int64), np.zeros(3, np.int64), 4), "same size"),
    (lambda: k.gather_ranges(np.zeros(4, np.uint8), np.array([2], np.int64), np.array([4], np.int64),
                             np.empty(4, np.uint8)), "outside src"),
    (lambda: k.gather_ranges(np.zeros(4, np.uint8), np.array([0], np.int64), np.array([4], np.int64),
                             np.empty(3, np.uint8)), "out holds 3 bytes"),
    (lambda: k.first_bad_row(np.zeros((2, 2), np.int32), np.ones(2, np.int64)), "ids: expected a 2-D int64"),
    (lambda: k.first_bad_row(np.zeros((2, 2), np.int64), np.ones(3, np.int64)), "num_rows: expected 2"),
    (lambda: k.plan_unique_rows(np.zeros((2, 2), np.int64), np.array([2], np.int64)), r"heads: .*\[0, 2\)"),
    (lambda: k.plan_unique_rows(np.zeros((2, 2), np.int64), np.array([1, 1], np.int64)), "distinct"),
    (lambda: k.rows_to_ranges(np.arange(3), np.array([0, 2], np.int64), np.zeros(1, np.int64), 4), "starts"),
    (lambda: k.scatter_rows(np.zeros((1, 2), np.float32), np.zeros((2, 2), np.int64), np.arange(2),
                            0, np.zeros((2, 2, 3), np.float32)), "rows: expected 3 columns"),
    (lambda: k.scatter_rows(np.zeros((1, 2), np.float32), np.ones((2, 2), np.int64), np.arange(2),
                            0, np.zeros((2, 2, 2), np.float32)), "outside the 1 rows"),
    (lambda: k.gather_rows_local(np.zeros(4, np.float32), np.zeros(2, np.int64), np.ones((1, 2), np.int64),
                                 np.arange(2), 4, np.zeros((1, 2, 4), np.float32)), "outside the mapped segment"),
])
def test_wrappers_reject_bad_arguments(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


@SETTINGS
@given(st.integers(1, 5000), st.integers(1, 3), st.sampled_from([1, 7, 300, 1 << 20, 1 << 40, 2**63 - 1]),
       st.booleans(), st.integers(0, 2**32))
def test_plan_unique_rows_on_long_batches(M, H, bound, negatives, seed):
    # Long batches take the radix-sort path (8- and 11-bit digits); negatives force the comparison sort.
    rng = np.random.default_rng(seed)
    ids = rng.integers(-bound if negatives else 0, bound, size=(M, H), dtype=np.int64)
    heads = np.arange(H, dtype=np.int64)[::-1].copy()
    uniq, starts, inverse = k.plan_unique_rows(ids, heads)
    for j, h in enumerate(heads):
        np.testing.assert_array_equal(uniq[starts[j]:starts[j + 1]], np.unique(ids[:, h]))
        np.testing.assert_array_equal(uniq[inverse[:, h]], ids[:, h])


@SETTINGS
@given(st.sampled_from([np.uint8, np.float16, np.float32, np.float64]), st.integers(1, 70), st.integers(1, 30),
       st.integers(1, 4), st.integers(0, 7), st.integers(0, 2**32))
def test_row_gathers_of_every_item_size(dtype, dim, M, H, skew, seed):
    # Rows of 1-, 2-, 4- and 8-byte items at any dimension and any item offset (``skew``) take the widest
    # word copy their alignment allows; the result is the same as NumPy fancy indexing.
    rng = np.random.default_rng(seed)
    n = 50
    flat = rng.integers(0, 255, size=(skew + H * n * dim) * np.dtype(dtype).itemsize, dtype=np.uint8)
    segment = flat.view(dtype)
    base = np.array([skew + h * n * dim for h in range(H)], dtype=np.int64)
    ids = rng.integers(0, n, size=(M, H), dtype=np.int64)
    heads = np.arange(H, dtype=np.int64)
    out = np.empty((M, H, dim), dtype=dtype)
    k.gather_rows_local(segment, base, ids, heads, dim, out)
    expected = np.stack([segment[base[h]:base[h] + n * dim].reshape(n, dim)[ids[:, h]] for h in range(H)], axis=1)
    assert out.tobytes() == expected.tobytes()
    uniq, _, inverse = k.plan_unique_rows(ids, heads)
    rows = np.ascontiguousarray(rng.integers(0, 255, size=(uniq.size, dim * np.dtype(dtype).itemsize),
                                             dtype=np.uint8)).view(dtype)
    scattered = np.empty((M, H, dim), dtype=dtype)
    k.scatter_rows(rows, inverse, heads, 0, scattered)
    assert scattered.tobytes() == rows[inverse].tobytes()
