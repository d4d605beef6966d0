"""The gathers from this host's memory that V41Rows and PLERows share (``engram_model._rows_gather``): rows are
prefetched a burst ahead while a burst is copied, and every slot is NumPy's row, or zeros outside the window; the
decode step's one call (``checked_rows_from_span``) checks every id before it writes a row."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_model import _rows_gather_kernels as K
from engram_model._rows_gather import NO_LUT, span_of


def _layer(rng, cols: int, row_bytes: int):
    sizes = rng.integers(1, 40, cols)
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    table = rng.integers(0, 256, (int(offsets[-1]), row_bytes), dtype=np.uint8)
    return table, offsets, [table[offsets[c]:offsets[c + 1]] for c in range(cols)]


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cols=st.integers(1, 6), tokens=st.integers(1, 40),
       row_bytes=st.sampled_from([8, 9, 16, 40, 264]), window=st.booleans(), bad=st.booleans())
def test_every_form_gathers_numpys_rows_and_the_checked_call_writes_nothing_for_a_bad_id(seed, cols, tokens,
                                                                                          row_bytes, window, bad):
    rng = np.random.default_rng(seed)
    table, offsets, tables = _layer(rng, cols, row_bytes)
    span = span_of(tables, list(range(cols)), offsets, row_bytes)
    ids = np.stack([rng.integers(offsets[c], offsets[c + 1], tokens) for c in range(cols)], axis=1).reshape(-1)
    ids[rng.random(ids.shape) < 0.1] = -1
    v0, v1 = (int(offsets[-1]) // 3, int(offsets[-1]) * 2 // 3 + 1) if window else (0, int(offsets[-1]))
    inside = (ids >= v0) & (ids < v1)
    expected = np.where(inside[:, None], table[np.clip(ids, 0, None)], 0)
    total = int(offsets[-1])

    out = np.full((ids.size, row_bytes), 0xA5, np.uint8)
    K.rows_from_span(span.bytes, span.delta, offsets, ids, 0, cols, v0, v1, 0, ids.size, row_bytes, NO_LUT, out)
    np.testing.assert_array_equal(out, expected)

    blocks = max(1, row_bytes // 33)
    codes = np.full((ids.size, row_bytes - blocks), 0xA5, np.uint8)
    scales = np.full((ids.size, blocks), 0xA5, np.uint8)
    K.split_from_span(span.bytes, span.delta, offsets, ids, 0, cols, v0, v1, 0, ids.size, row_bytes, codes, scales)
    np.testing.assert_array_equal(np.concatenate([codes, scales], axis=1), expected)

    forms = [(span.bytes, span.delta, row_bytes, np.full((ids.size, row_bytes), 0xA5, np.uint8))]
    if span.words is not None:  # raw rows a word at a time
        words = np.zeros((ids.size, row_bytes // 8), np.uint64)
        K.rows_from_span(span.words, span.word_delta, offsets, ids, 0, cols, v0, v1, 0, ids.size, row_bytes // 8,
                         NO_LUT, words)
        np.testing.assert_array_equal(words.view(np.uint8).reshape(ids.size, row_bytes), expected)
        forms.append((span.words, span.word_delta, row_bytes // 8, np.zeros((ids.size, row_bytes // 8), np.uint64)))
    if bad:  # one id past the columns or below -1 (padding), anywhere: found before a row is written
        at = int(rng.integers(0, ids.size))
        ids[at] = total + int(rng.integers(0, 3)) if rng.random() < 0.5 else -2 - int(rng.integers(0, 3))
    for source, delta, items, dst in forms:
        before = dst.copy()
        found = K.checked_rows_from_span(source, delta, offsets, ids, total, v0, v1, items, NO_LUT, dst)
        got = dst.view(np.uint8).reshape(ids.size, row_bytes)
        if bad:
            assert found == K.first_bad(ids, total) == at
            np.testing.assert_array_equal(dst, before)
        else:
            assert found == K.first_bad(ids, total) == -1
            np.testing.assert_array_equal(got, expected)


def _plan_reference(ids, offsets, first, width, n, v0, v1, col_head):
    """plan_window's contract in plain Python: each slot's staging row, own-column ids at their token's row, the
    others after the first ceil(n / width) rows in slot order, and the store id each row reads."""
    cols = len(offsets) - 1
    T = -(-n // width)
    placed, later = [], {h: 0 for h in set(col_head.tolist())}
    for i in range(n):
        t, c = divmod(i, width)
        c += first
        g = int(ids[t * cols + c]) if c < cols else -1
        if not v0 <= g < v1:
            placed.append(None)
            continue
        home = int(np.searchsorted(offsets, g, side="right")) - 1
        h = int(col_head[home])
        if home == c:
            m = t
        else:
            m = T + later[h]
            later[h] += 1
        placed.append((m, h, g - int(offsets[home])))
    return T, placed


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cols=st.integers(1, 6), tokens=st.integers(1, 12), first=st.integers(0, 5),
       width=st.integers(1, 6), cut=st.integers(0, 5), window=st.booleans(), stray=st.floats(0, 0.5))
def test_plan_window_places_every_slot_as_its_contract_says(seed, cols, tokens, first, width, cut, window, stray):
    rng = np.random.default_rng(seed)
    first = min(first, cols - 1)
    _, offsets, _ = _layer(rng, cols, 8)
    total = int(offsets[-1])
    ids = np.stack([rng.integers(offsets[c], offsets[c + 1], tokens) for c in range(cols)], axis=1).reshape(-1)
    strays = rng.random(ids.shape) < stray  # ids of other columns, anywhere in the table
    ids[strays] = rng.integers(0, total, int(strays.sum()))
    ids[rng.random(ids.shape) < 0.1] = -1
    n = max(1, tokens * width - min(cut, width - 1))  # a last token cut short, as a tensor-parallel part may be
    v0, v1 = (total // 3, total * 2 // 3 + 1) if window else (0, total)
    col_head = np.arange(cols, dtype=np.int64)
    store_ids, src = K.plan_window(ids, offsets, first, width, n, v0, v1, col_head, cols)
    T, placed = _plan_reference(ids, offsets, first, width, n, v0, v1, col_head)
    assert src.shape == (n,) and store_ids.shape[1] == cols and store_ids.shape[0] >= T
    for i, want in enumerate(placed):
        if want is None:
            assert src[i] == -1
        else:
            m, h, row = want
            assert src[i] == m * cols + h
            assert store_ids[m, h] == row
