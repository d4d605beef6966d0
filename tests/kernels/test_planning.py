"""Read planning at its edges, kernel by kernel: the remote lookup's plan against a plain NumPy plan, the sort it
stands on at the sizes where it changes method, ranges merged within a head and never across two, and range
checks at the exact bounds.

An off-by-one in a plan reads the neighbouring row, merges two heads' rows into one range, or lets a range end one
byte past its segment; each case here is where such a change shows, in milliseconds, without the store.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engram_store import InvalidArgument, InvalidType
from engram_store import kernels as k
from engram_store.kernels._sort import _sort_positions

SETTINGS = settings(max_examples=80, deadline=None)


def _plan_numpy(ids, order, base, row_bytes):
    """The plan of :func:`kernels.plan_reads`, in NumPy: each listed head's distinct rows ascending, runs of
    consecutive rows merged into one range, never across heads."""
    M, H = ids.shape
    pairs, head_rows, head_ranges = [], [0], [0]
    inverse = np.full((M, H), -1, np.int64)
    for j, h in enumerate(order):
        rows = np.unique(ids[:, h])
        inverse[:, h] = head_rows[-1] + np.searchsorted(rows, ids[:, h])
        cuts = np.flatnonzero(np.diff(rows) != 1) + 1
        for run in np.split(rows, cuts):
            pairs.append((base[j] + run[0] * row_bytes, run.size * row_bytes))
        head_rows.append(head_rows[-1] + rows.size)
        head_ranges.append(len(pairs))
    return np.array(pairs, np.int64).reshape(-1, 2), np.array(head_rows), np.array(head_ranges), inverse


@st.composite
def plans(draw):
    """(ids, order, base offsets, row_bytes): few rows per head so runs, repeats and heads whose rows continue
    another's (head B's first row one past head A's last) are common; sometimes long enough for the radix sort."""
    H = draw(st.integers(1, 5))
    M = draw(st.sampled_from([1, 2, 3, 17, 63, 64, 65, 300]))
    span = draw(st.sampled_from([1, 2, 4, 8, 40, 1 << 33]))
    seed = draw(st.integers(0, 2**32))
    rng = np.random.default_rng(seed)
    shift = rng.integers(0, 4, H)  # head h's rows from shift[h]: neighbouring heads' rows often meet
    ids = (rng.integers(0, span, (M, H)) + shift).astype(np.int64)
    order = rng.permutation(H)[:draw(st.integers(1, H))].astype(np.int64)
    base = rng.integers(0, 1 << 20, order.size).astype(np.int64)
    return ids, order, base, draw(st.sampled_from([1, 8, 264]))


@SETTINGS
@given(plans())
@example((np.array([[3, 4], [4, 5], [2, 6]], np.int64), np.array([0, 1], np.int64), np.array([0, 40], np.int64), 8))
@example((np.array([[0]], np.int64), np.array([0], np.int64), np.array([8], np.int64), 8))
def test_the_remote_lookups_plan_is_the_numpy_plan(case):
    ids, order, base, row_bytes = case
    plan = k.plan_reads(ids, order, base, row_bytes)
    pairs, head_rows, head_ranges, inverse = _plan_numpy(ids, order, base, row_bytes)
    np.testing.assert_array_equal(plan.pairs, pairs)
    np.testing.assert_array_equal(plan.head_rows, head_rows)
    np.testing.assert_array_equal(plan.head_ranges, head_ranges)
    np.testing.assert_array_equal(plan.inverse, inverse)
    unchecked = k.plan_reads_unchecked(ids, order, base, np.int64(row_bytes))
    np.testing.assert_array_equal(unchecked[0][:unchecked[1]], pairs)


@pytest.mark.parametrize("M", [2047, 2048, 2049])
def test_a_long_batch_is_planned_as_numpy_plans_it(M):
    """From 2048 positions the sort takes 11-bit digits, and the plan's scratch counts must have room for them."""
    ids = np.random.default_rng(M).integers(0, 3000, (M, 2)).astype(np.int64)
    order, base = np.array([1, 0], np.int64), np.array([0, 1 << 20], np.int64)
    plan = k.plan_reads(ids, order, base, 8)
    pairs, _, _, inverse = _plan_numpy(ids, order, base, 8)
    np.testing.assert_array_equal(plan.pairs, pairs)
    np.testing.assert_array_equal(plan.inverse, inverse)
    uniq, starts, inverse = k.plan_unique_rows(ids, order)
    np.testing.assert_array_equal(uniq, np.concatenate([np.unique(ids[:, h]) for h in order]))


def test_a_plan_never_merges_two_heads_whose_rows_meet():
    # Head 1's rows (5, 6) continue head 0's (3, 4), and its table starts right after row 4 of head 0's: one
    # range would read the same bytes, but each head's rows are numbered apart, so each keeps its own range.
    ids = np.array([[3, 5], [4, 6]], np.int64)
    plan = k.plan_reads(ids, np.array([0, 1], np.int64), np.array([0, 0], np.int64), 8)
    assert plan.pairs.tolist() == [[24, 16], [40, 16]]
    assert plan.head_rows.tolist() == [0, 2, 4] and plan.head_ranges.tolist() == [0, 1, 2]
    offsets, lengths, heads = k.rows_to_ranges(np.array([3, 4, 5, 6], np.int64), np.array([0, 2, 4], np.int64),
                                               np.array([0, 0], np.int64), 8)
    assert offsets.tolist() == [24, 40] and lengths.tolist() == [16, 16] and heads.tolist() == [0, 1]


def test_plan_reads_names_each_argument_it_refuses():
    ids = np.zeros((2, 3), np.int64)
    order, base = np.array([0, 2], np.int64), np.array([0, 64], np.int64)
    with pytest.raises(InvalidType, match=r"ids: expected a 2-D int64 array \[M, H\], got int32"):
        k.plan_reads(ids.astype(np.int32), order, base, 8)
    for bad in ([0, 3], [2, 2], [-1]):
        with pytest.raises(InvalidArgument, match=r"order: expected distinct head indices in \[0, 3\)"):
            k.plan_reads(ids, np.array(bad, np.int64), base[:len(bad)], 8)
    with pytest.raises(InvalidArgument, match="base_offsets: expected 2 entries .one per listed head., got 1"):
        k.plan_reads(ids, order, base[:1], 8)
    for row_bytes in (0, -8):
        with pytest.raises(InvalidArgument, match=f"row_bytes: expected a positive byte count, got {row_bytes}"):
            k.plan_reads(ids, order, base, row_bytes)
    # checked=True is the caller's word that all of this holds: the same plan, with no check made.
    np.testing.assert_array_equal(k.plan_reads(ids, order, base, 8, checked=True).pairs, [[0, 8], [64, 8]])


@pytest.mark.parametrize("H", [1, 3])
def test_an_empty_batch_plans_no_reads(H):
    """No positions (a batch of no tokens): every plan is empty, and the sort reads nothing of its empty column."""
    ids = np.zeros((0, H), np.int64)
    order, base = np.arange(H, dtype=np.int64)[::-1].copy(), np.zeros(H, np.int64)
    plan = k.plan_reads(ids, order, base, 8)
    assert plan.pairs.shape == (0, 2) and plan.inverse.shape == (0, H)
    assert plan.head_rows.tolist() == plan.head_ranges.tolist() == [0] * (H + 1)
    uniq, starts, inverse = k.plan_unique_rows(ids, order)
    assert uniq.size == 0 and starts.tolist() == [0] * (H + 1) and inverse.shape == (0, H)
    empty = np.empty(0, np.int64)
    assert _sort_positions(empty, empty.copy(), empty.copy(), np.empty(257, np.int64)).size == 0


@pytest.mark.parametrize("M", [1, 2, 63, 64, 65, 2047, 2048, 2049])
@pytest.mark.parametrize("values", ["small", "negative", "extreme", "equal"])
def test_the_sort_is_numpys_stable_argsort_at_every_method_boundary(M, values):
    """Insertion sort below 64 values, radix sort of 8-bit digits below 2048, of 11-bit digits from there."""
    rng = np.random.default_rng(M)
    col = {"small": rng.integers(0, 5, M), "negative": rng.integers(-300, 300, M),
           "extreme": rng.choice(np.array([-2**63, -1, 0, 1, 2**63 - 1], np.int64), M),
           "equal": np.full(M, 7)}[values].astype(np.int64)
    order, tmp = np.empty(M, np.int64), np.empty(M, np.int64)
    counts = np.empty((1 << (8 if M < 2048 else 11)) + 1, np.int64)
    got = _sort_positions(col, order, tmp, counts)
    np.testing.assert_array_equal(got, np.argsort(col, kind="stable"))


@pytest.mark.parametrize("limit", [0, 1, 4096])
def test_range_checks_hold_at_the_exact_bounds(limit):
    inside = [(0, 0), (0, limit), (limit, 0)] + ([(limit - 1, 1), (1, limit - 1)] if limit else [])
    outside = [(-1, 0), (0, -1), (0, limit + 1), (limit, 1), (limit + 1, 0), (-1, limit + 2), (2**62, 2**62)]
    for o, n in inside:
        assert k.check_ranges(np.array([o]), np.array([n]), limit) == -1, (o, n)
        assert k.check_pairs(np.zeros(limit, np.uint8), np.array([[o, n]], np.int64)) == (-1, n)
    for o, n in outside:
        assert k.check_ranges(np.array([0, o]), np.array([0, n]), limit) == 1, (o, n)
        assert k.check_pairs(np.zeros(limit, np.uint8), np.array([[0, 0], [o, n]], np.int64))[0] == 1, (o, n)
    assert k.check_pairs(np.zeros(limit, np.uint8), np.array([[0, limit], [limit, 0]], np.int64)) == (-1, limit)


def test_the_first_bad_row_is_found_at_the_exact_bounds():
    num_rows = np.array([1, 5], np.int64)
    assert k.first_bad_row(np.array([[0, 0], [0, 4]], np.int64), num_rows) == -1
    assert k.first_bad_row(np.array([[0, 4], [0, 5]], np.int64), num_rows) == 3
    assert k.first_bad_row(np.array([[1, 0], [0, 5]], np.int64), num_rows) == 0
    assert k.first_bad_row(np.array([[0, -1]], np.int64), num_rows) == 1


@pytest.mark.parametrize("lengths, piece, bounds", [
    ([4, 4], 8, [0, 2]),            # exactly a piece together
    ([4, 5], 8, [0, 1, 2]),         # one byte over: two
    ([8, 1], 8, [0, 1, 2]),         # a range of a whole piece stands alone
    ([1, 8, 1], 8, [0, 1, 2, 3]),
    ([7, 1, 1], 8, [0, 2, 3]),
    ([0, 0, 8, 0], 8, [0, 2, 3, 4]),
])
def test_pieces_are_cut_at_the_exact_piece_size(lengths, piece, bounds):
    pairs = np.stack([np.arange(len(lengths)) * 100, lengths], axis=1).astype(np.int64)
    got_bounds, sizes = k.plan_pieces(pairs, sum(lengths), piece)
    assert got_bounds.tolist() == bounds
    assert sizes.tolist() == [sum(lengths[a:b]) for a, b in zip(bounds, bounds[1:])]
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"piece_bytes: expected > 0, got {bad}"):
            k.plan_pieces(pairs, sum(lengths), bad)
