"""The file layout, the manifest, and the streaming writer."""
from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import pytest
from disk_helpers import make_tables
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_store.tables._manifest import checksums as _checksums
from engram_store.errors import InvalidArgument, InvalidType
from engram_store.disk import PAGE_BYTES, DiskDir, DiskLayout, LayerWriter
from engram_store.disk import _kernels as dk

SETTINGS = settings(max_examples=25, deadline=None)
ROW_BYTES = st.one_of(st.sampled_from([1, 8, 264, 2048, 4096, 4097, 9000]), st.integers(1, 10_000))


@SETTINGS
@given(ROW_BYTES, st.lists(st.integers(1, 3000), min_size=1, max_size=6))
def test_rows_never_straddle_a_page_and_heads_start_on_pages(row_bytes, sizes):
    lay = DiskLayout.of(row_bytes, sizes)
    end = 0
    for h, n in enumerate(sizes):
        assert lay.head_offsets[h] % PAGE_BYTES == 0 and lay.head_offsets[h] >= end
        rows = np.unique(np.array([0, 1, n // 2, n - 2, n - 1]).clip(0, n - 1))
        for r in rows:
            start = lay.row_offset(h, int(r))
            if row_bytes <= PAGE_BYTES:
                assert start // PAGE_BYTES == (start + row_bytes - 1) // PAGE_BYTES, "a row straddles a page"
                assert lay.rows_per_block == PAGE_BYTES // row_bytes
            else:
                assert start % PAGE_BYTES == 0, "a large row does not start on a page"
        end = lay.head_offsets[h] + lay.head_blocks(h) * lay.block_bytes
        assert lay.row_offset(h, n - 1) + row_bytes <= end
    assert lay.file_bytes == end and lay.file_bytes % PAGE_BYTES == 0


def test_264_byte_rows_pack_15_to_a_page():
    lay = DiskLayout.of(264, [31, 2])
    assert (lay.rows_per_block, lay.block_bytes) == (15, 4096)
    assert lay.head_offsets == (0, 3 * 4096) and lay.file_bytes == 4 * 4096
    assert lay.row_offset(0, 15) == 4096 and lay.row_offset(0, 14) == 14 * 264


@SETTINGS
@given(ROW_BYTES, st.integers(0, 40), st.integers(0, 2**32))
def test_pack_then_unpack_equals_the_rows(row_bytes, n, seed):
    lay = DiskLayout.of(row_bytes, [max(n, 1)])
    rows = np.random.default_rng(seed).integers(0, 256, n * row_bytes, dtype=np.uint8)
    blocks = np.full(-(-n // lay.rows_per_block) * lay.block_bytes, 0xAB, dtype=np.uint8)
    assert dk._pack_rows(rows, row_bytes, lay.rows_per_block, lay.block_bytes, blocks) == blocks.size
    # NumPy: each block is its rows followed by zeros
    for b in range(blocks.size // lay.block_bytes):
        chunk = rows[b * lay.rows_per_block * row_bytes:(b + 1) * lay.rows_per_block * row_bytes]
        block = blocks[b * lay.block_bytes:(b + 1) * lay.block_bytes]
        np.testing.assert_array_equal(block[:chunk.size], chunk)
        assert not block[chunk.size:].any()
    back = np.empty_like(rows)
    dk._unpack_rows(blocks, row_bytes, lay.rows_per_block, lay.block_bytes, n, back)
    np.testing.assert_array_equal(back, rows)


@settings(max_examples=12, deadline=None)
@given(st.sampled_from([3, 264, 4096, 5000]), st.lists(st.integers(1, 400), min_size=1, max_size=4),
       st.integers(1, 5), st.integers(0, 2**32))
@pytest.mark.timeout(60)
def test_file_holds_each_row_at_its_offset_and_manifest_checksums_match_engram_store(row_bytes, sizes, chunk_pages,
                                                                                     seed):
    tables = make_tables(np.random.default_rng(seed), sizes, row_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        d = DiskDir(tmp)
        # head 0 from an array, the others from fill callbacks; small chunks so each head takes several
        heads = [tables[0]] + [lambda start, out, t=t: out.__setitem__(slice(None), t[start:start + len(out)])
                               for t in tables[1:]]
        path = d.write(2, row_bytes, sizes, heads, chunk_bytes=chunk_pages * 4096, progress=False)
        with open(os.path.join(path, "manifest.json")) as f:
            record = json.load(f)
        assert record["checksum"]["heads"] == _checksums(tables)[1]
        assert record["row_bytes"] == row_bytes and record["sizes"] == sizes and record["layer_id"] == 2
        lay = DiskLayout.of(row_bytes, sizes)
        data = np.fromfile(os.path.join(path, "rows.bin"), dtype=np.uint8)
        assert data.size == lay.file_bytes
        for h, table in enumerate(tables):
            for r in range(sizes[h]):
                o = lay.row_offset(h, r)
                np.testing.assert_array_equal(data[o:o + row_bytes], table[r])
        d.verify(2)


@pytest.mark.timeout(30)
def test_writer_streams_with_bounded_chunks_and_reports_progress(tmp_path):
    sizes, row_bytes = [1000, 7], 264
    tables = make_tables(np.random.default_rng(1), sizes, row_bytes)
    calls, seen = [], []

    def fill(start, out):
        assert out.dtype == np.uint8 and out.flags.c_contiguous and out.shape[1] == row_bytes
        calls.append((start, out.shape[0]))
        out[:] = tables[0][start:start + out.shape[0]]

    with LayerWriter(tmp_path, 0, row_bytes, sizes, chunk_bytes=8192, progress=seen.append) as w:
        w.write_head(1, tables[1].view(np.int8))  # any dtype, seen as bytes; heads in any order
        w.write_head(0, fill)
    assert calls == [(s, min(30, 1000 - s)) for s in range(0, 1000, 30)]  # 2 pages of 15 rows at a time
    assert seen[-1] == sum(sizes) * row_bytes and seen == sorted(seen)
    DiskDir(tmp_path).verify(0)


def test_verify_finds_a_damaged_file(small_layer):
    d, sizes, tables = small_layer
    file = os.path.join(d.layer_path(7), "rows.bin")
    os.chmod(file, 0o644)
    with open(file, "r+b") as f:
        f.seek(DiskLayout.of(264, sizes).row_offset(2, 5))
        f.write(b"\xff")
    with pytest.raises(Exception, match="head 2, page 0 .* checksum"):
        d.verify(7)


@pytest.mark.parametrize("row_bytes, sizes, match", [
    (0, [1], "row_bytes: expected an int > 0, got 0"),
    (8, [], "sizes: expected a non-empty list"),
    (8, [3, 0], r"sizes\[1\]: expected an int > 0, got 0"),
    (8, "12", "sizes: expected a non-empty list"),
])
def test_layout_refuses_bad_geometry(row_bytes, sizes, match):
    with pytest.raises(InvalidArgument, match=match):
        DiskLayout.of(row_bytes, sizes)


def test_layout_refuses_bad_types():
    with pytest.raises(InvalidType, match="row_bytes"):
        DiskLayout.of(8.0, [1])
    with pytest.raises(InvalidType, match=r"sizes\[0\]"):
        DiskLayout.of(8, [True])


@pytest.mark.timeout(30)
def test_writer_refuses_bad_heads(tmp_path):
    with LayerWriter(tmp_path, 1, 8, [4, 2], progress=False) as w:
        with pytest.raises(InvalidArgument, match=r"heads\[0\]: expected 4 rows of 8 bytes"):
            w.write_head(0, np.zeros((4, 4), np.uint8))
        with pytest.raises(InvalidType, match=r"heads\[0\]: expected an array"):
            w.write_head(0, [1, 2, 3])
        with pytest.raises(InvalidArgument, match=r"head: expected an int in \[0, 2\), got 5"):
            w.write_head(5, np.zeros((4, 8), np.uint8))
        with pytest.raises(InvalidArgument, match="C-contiguous"):
            w.write_head(0, np.zeros((4, 16), np.uint8)[:, ::2])
        w.write_head(0, np.zeros((4, 8), np.uint8))
        with pytest.raises(InvalidArgument, match="already written"):
            w.write_head(0, np.zeros((4, 8), np.uint8))
        w.write_head(1, np.ones((2, 2), np.float32))
    assert DiskDir(tmp_path).layers() == [1]
    with pytest.raises(InvalidArgument, match="layer_id: expected an int >= 0, got -1"):
        LayerWriter(tmp_path, -1, 8, [1])
    with pytest.raises(InvalidArgument, match="heads: expected 2 tables"):
        DiskDir(tmp_path).write(2, 8, [1, 1], [np.zeros((1, 8), np.uint8)])
    assert DiskDir(tmp_path).layers() == [1]
