"""The gathers from this host's memory that V41Rows and PLERows share (``engram_model._rows_gather``): whichever
way a span's rows are prefetched (bursts on 4 KiB pages, one row at a time on huge pages), every slot is NumPy's row,
or zeros outside the window; and a span asks for the prefetch its pages want."""
from __future__ import annotations

import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_model import _rows_gather_kernels as K
from engram_model._rows_gather import NO_LUT, span_of
from engram_store.kernels import PREFETCH_ROWS
from engram_store.pages import MADV_HUGEPAGE, huge_pages, madvise


def _layer(rng, cols: int, row_bytes: int):
    sizes = rng.integers(1, 40, cols)
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    table = rng.integers(0, 256, (int(offsets[-1]), row_bytes), dtype=np.uint8)
    return table, offsets, [table[offsets[c]:offsets[c + 1]] for c in range(cols)]


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cols=st.integers(1, 6), tokens=st.integers(1, 40),
       row_bytes=st.sampled_from([8, 9, 16, 40, 264]), ahead=st.sampled_from([0, 1, 3, PREFETCH_ROWS]),
       window=st.booleans())
def test_every_prefetch_plan_gathers_numpys_rows(seed, cols, tokens, row_bytes, ahead, window):
    rng = np.random.default_rng(seed)
    table, offsets, tables = _layer(rng, cols, row_bytes)
    span = span_of(tables, list(range(cols)), offsets, row_bytes)
    ids = np.stack([rng.integers(offsets[c], offsets[c + 1], tokens) for c in range(cols)], axis=1).reshape(-1)
    ids[rng.random(ids.shape) < 0.1] = -1
    v0, v1 = (int(offsets[-1]) // 3, int(offsets[-1]) * 2 // 3 + 1) if window else (0, int(offsets[-1]))
    inside = (ids >= v0) & (ids < v1)
    expected = np.where(inside[:, None], table[np.clip(ids, 0, None)], 0)

    out = np.full((ids.size, row_bytes), 0xA5, np.uint8)
    K.rows_from_span(span.bytes, span.delta, offsets, ids, 0, cols, v0, v1, 0, ids.size, row_bytes, ahead, NO_LUT,
                     out)
    np.testing.assert_array_equal(out, expected)

    blocks = max(1, row_bytes // 33)
    codes = np.full((ids.size, row_bytes - blocks), 0xA5, np.uint8)
    scales = np.full((ids.size, blocks), 0xA5, np.uint8)
    K.split_from_span(span.bytes, span.delta, offsets, ids, 0, cols, v0, v1, 0, ids.size, row_bytes, ahead, codes,
                      scales)
    np.testing.assert_array_equal(np.concatenate([codes, scales], axis=1), expected)

    if span.words is not None:  # raw rows a word at a time
        words = np.zeros((ids.size, row_bytes // 8), np.uint64)
        K.rows_from_span(span.words, span.word_delta, offsets, ids, 0, cols, v0, v1, 0, ids.size, row_bytes // 8,
                         ahead, NO_LUT, words)
        np.testing.assert_array_equal(words.view(np.uint8).reshape(ids.size, row_bytes), expected)


def _thp(setting: str) -> str:
    try:
        with open(f"/sys/kernel/mm/transparent_hugepage/{setting}", encoding="ascii") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return ""


def test_a_span_on_huge_pages_prefetches_one_row_at_a_time_and_one_on_small_pages_in_bursts():
    size = 8 << 20
    if _thp("enabled") in ("madvise", "always"):
        anon = mmap.mmap(-1, size + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf = np.frombuffer(anon, np.uint8)
        start = (-buf.ctypes.data) % (2 << 20)  # whole 2 MiB pages
        assert madvise(buf.ctypes.data + start, size, MADV_HUGEPAGE) == 0
        buf[start:start + size] = 1
        if huge_pages(buf.ctypes.data + start + size // 2):  # (the kernel may still give small ones: no memory)
            table = buf[start:start + size].reshape(-1, 64)
            assert span_of([table], [0], np.array([0, table.shape[0]], np.int64), 64).ahead == PREFETCH_ROWS
    if _thp("shmem_enabled") not in ("never", "deny", ""):
        pytest.skip("this host may give shared memory huge pages: the small-page case needs one that does not")
    shared = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)  # shared memory: 4 KiB pages here
    small = np.frombuffer(shared, np.uint8)
    small[:] = 1
    assert not huge_pages(small.ctypes.data + size // 2)
    table = small.reshape(-1, 64)
    assert span_of([table], [0], np.array([0, table.shape[0]], np.int64), 64).ahead == 0
