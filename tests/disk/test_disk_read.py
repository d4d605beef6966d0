"""Reads equal NumPy indexing of the source tables, with any cache, either engine, from many threads; every
error path is a clear error."""
from __future__ import annotations

import errno
import logging
import os
import tempfile
import threading

import numpy as np
import pytest
from disk_helpers import expected_rows, make_tables
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_store.errors import ConfigError, InvalidArgument, InvalidType, ObjectNotFound, StoreError
from engram_store.disk import (DiskDir, DiskLayer, DiskReadError, IOEngine, RowCache, _files, aio_available,
                               read_many)

MODES = ["threads"] + (["aio"] if aio_available() else [])


def random_ids(rng, sizes, M, skew=False):
    if skew:  # a few hot rows per head, so the cache sees hits and evictions
        return np.stack([rng.integers(0, min(n, 40), M) * (n // min(n, 40)) for n in sizes], axis=1)
    return np.stack([rng.integers(0, n, M) for n in sizes], axis=1)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([1, 8, 264, 4096, 5000]), st.lists(st.integers(1, 300), min_size=1, max_size=4),
       st.sampled_from([0, 1, 3, 1000]), st.sampled_from(MODES), st.integers(0, 2**32))
@pytest.mark.timeout(120)
def test_reads_equal_numpy_indexing_for_any_cache_size(row_bytes, sizes, cache_sets, mode, seed):
    rng = np.random.default_rng(seed)
    tables = make_tables(rng, sizes, row_bytes)
    per_set = 7 * row_bytes + 72 + 7
    cache = RowCache(cache_sets * per_set, row_bytes) if cache_sets else None
    with tempfile.TemporaryDirectory() as tmp, IOEngine(8, mode) as engine:
        d = DiskDir(tmp)
        d.write(0, row_bytes, sizes, tables, progress=False)
        with d.open(0, row_bytes, sizes, cache=cache, engine=engine) as layer:
            for step in range(4):
                ids = random_ids(rng, sizes, int(rng.integers(1, 60)), skew=step % 2 == 1)
                out = np.zeros(ids.size * row_bytes, np.uint8)
                layer.read_rows(ids, out)
                np.testing.assert_array_equal(out, expected_rows(tables, ids))
            st_ = layer.stats()
            assert st_["cache_hits"] + st_["cache_misses"] == st_["rows"]
            assert (st_["cache_hits"] > 0) == (cache is not None and st_["cache_hits"] > 0)
            if cache is None:
                assert st_["cache_hits"] == 0
            assert st_["pages_read"] * 4096 == st_["bytes_read"]


@pytest.mark.timeout(60)
def test_rows_sharing_a_page_are_read_once_and_cached_rows_not_at_all(small_layer):
    d, sizes, tables = small_layer
    cache = RowCache(1 << 20, 264)
    with d.open(7, 264, sizes, cache=cache) as layer:
        ids = np.array([[0, 0, 0], [14, 1, 15], [0, 2, 16], [1, 0, 29]], dtype=np.int64)
        out = np.empty(ids.size * 264, np.uint8)
        layer.read_rows(ids, out)
        np.testing.assert_array_equal(out, expected_rows(tables, ids))
        # head 0: rows 0, 14, 1 share page 0; head 1: page 0; head 2: pages 0 (row 0), 1 (rows 15, 16, 29)
        assert layer.stats(reset=True)["pages_read"] == 4
        layer.read_rows(ids, out)
        np.testing.assert_array_equal(out, expected_rows(tables, ids))
        assert layer.stats() == {"reads": 1, "rows": 12, "pages_read": 0, "bytes_read": 0, "cache_hits": 12,
                                 "cache_misses": 0, "direct": 1, "cache_hits_per_head": [4, 4, 4],
                                 "cache_misses_per_head": [0, 0, 0]}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_concurrent_readers_sharing_a_small_cache_read_right_rows(tmp_path, mode):
    rng = np.random.default_rng(3)
    sizes = [500, 300, 700]
    tables = [make_tables(rng, sizes, 264), make_tables(rng, sizes, 264)]
    d = DiskDir(tmp_path)
    for lid, t in enumerate(tables):
        d.write(lid, 264, sizes, t, progress=False)
    cache = RowCache(20 * (7 * 264 + 79), 264)  # 140 rows: constant eviction
    errors = []
    with IOEngine(8, mode) as engine, d.open(0, cache=cache, engine=engine) as a, \
            d.open(1, cache=cache, engine=engine) as b:
        def reader(seed):
            r = np.random.default_rng(seed)
            try:
                for _ in range(40):
                    ids0, ids1 = random_ids(r, sizes, 20, skew=True), random_ids(r, sizes, 9, skew=True)
                    out0, out1 = np.empty(ids0.size * 264, np.uint8), np.empty(ids1.size * 264, np.uint8)
                    read_many([(a, ids0, out0), (b, ids1, out1)])
                    np.testing.assert_array_equal(out0, expected_rows(tables[0], ids0))
                    np.testing.assert_array_equal(out1, expected_rows(tables[1], ids1))
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        hits = a.stats()["cache_hits"] + b.stats()["cache_hits"]
        assert hits > 0 and cache.held() <= cache.capacity_rows


@pytest.mark.timeout(30)
def test_the_cache_keeps_layers_apart_and_admits_on_a_second_miss(tmp_path):
    d = DiskDir(tmp_path)
    t0, t1 = np.zeros((14, 8), np.uint8), np.ones((14, 8), np.uint8)
    d.write(0, 8, [14], [t0], progress=False)
    d.write(1, 8, [14], [t1], progress=False)
    cache = RowCache(7 * 8 + 72 + 7, 8)  # one set of 7 ways
    assert cache.capacity_rows == 7
    with d.open(0, cache=cache) as a, d.open(1, cache=cache) as b:
        ids = np.arange(7, dtype=np.int64)[:, None]
        out = np.empty(56, np.uint8)
        a.read_rows(ids, out)              # fills the free ways
        b.read_rows(ids, out)              # same rows of another layer: first miss, the doorkeeper refuses
        assert (out == 1).all() and cache.held() == 7
        a.read_rows(ids, out)
        assert a.stats()["cache_hits"] == 7 and (out == 0).all()
        b.read_rows(ids, out)              # second miss: admitted, evicting layer 0's rows
        b.read_rows(ids, out)
        assert b.stats()["cache_hits"] > 0 and (out == 1).all()
        cache.clear()
        assert cache.held() == 0
        b.read_rows(ids, out)
        assert (out == 1).all()


@pytest.mark.timeout(30)
def test_a_hit_marks_its_row_used_so_clock_evicts_another(tmp_path):
    d = DiskDir(tmp_path)
    table = np.arange(16 * 8, dtype=np.uint8).reshape(16, 8)
    d.write(0, 8, [16], [table], progress=False)
    cache = RowCache(7 * 8 + 72 + 7, 8, admission="always")  # one set of 7 ways
    with d.open(0, cache=cache) as layer:
        out = np.empty(7 * 8, np.uint8)
        layer.read_rows(np.arange(7, dtype=np.int64)[:, None], out)    # rows 0-6 take the free ways
        one = np.empty(8, np.uint8)
        layer.read_rows(np.array([[3]], dtype=np.int64), one)          # a hit: row 3 is marked used
        assert layer.stats()["cache_hits"] == 1
        for victim in range(7, 13):                                    # six misses evict six rows ...
            layer.read_rows(np.array([[victim]], dtype=np.int64), one)
            assert (one == table[victim]).all()
        layer.stats(reset=True)
        layer.read_rows(np.array([[3]], dtype=np.int64), one)          # ... and CLOCK spared the used one
        assert layer.stats()["cache_hits"] == 1 and (one == table[3]).all()


# ---- errors ---------------------------------------------------------------------------------------------------


def test_a_missing_layer_is_none_or_object_not_found(tmp_path):
    assert DiskDir(tmp_path).open(4) is None
    with pytest.raises(ObjectNotFound, match="disk layer 4 is not published under"):
        DiskLayer(tmp_path, 4)


def test_a_layout_mismatch_is_refused(small_layer):
    d, sizes, _ = small_layer
    with pytest.raises(ConfigError, match=r"published with row_bytes=264, sizes=\[100, 31, 250\] \(3 heads\), but "
                                          r"the caller expects row_bytes=256"):
        d.open(7, 256, sizes)
    with pytest.raises(ConfigError, match=r"caller expects row_bytes=264, sizes=\[100, 31\]"):
        d.open(7, 264, sizes[:2])
    with pytest.raises(InvalidArgument, match="expected layers of row_bytes=8"):
        d.open(7, cache=RowCache(1 << 16, 8))


@pytest.mark.timeout(30)
def test_a_truncated_file_is_refused_at_open_and_fails_reads_after(small_layer):
    d, sizes, tables = small_layer
    file = os.path.join(d.layer_path(7), "rows.bin")
    for mode in MODES:
        with IOEngine(4, mode) as engine, d.open(7, engine=engine) as layer:
            os.chmod(file, 0o644)
            size = os.path.getsize(file)
            with open(file, "rb") as f:
                f.seek(size - 4096)
                last_page = f.read()
            os.truncate(file, size - 4096)  # the last page of head 2 is gone
            try:
                ids = np.array([[0, 0, 240], [1, 1, 1]], dtype=np.int64)
                out = np.zeros(ids.size * 264, np.uint8)
                with pytest.raises(DiskReadError, match=rf"short read of {file} at offset {size - 4096}: got 0 of "
                                                        "4096 bytes"):
                    layer.read_rows(ids, out)
                with pytest.raises(DiskReadError, match=rf"{file} holds {size - 4096} bytes, the manifest promises "
                                                        f"{size}"):
                    d.open(7)
            finally:
                with open(file, "r+b") as f:  # restore the page
                    f.seek(size - 4096)
                    f.write(last_page)
        d.verify(7)  # restored


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", MODES)
def test_an_io_error_names_the_file_and_offset(small_layer, mode, tmp_path):
    d, sizes, _ = small_layer
    with IOEngine(4, mode) as engine, d.open(7, engine=engine) as layer:
        directory = os.open(tmp_path, os.O_RDONLY)
        os.dup2(directory, layer._held.fd)  # the layer's descriptor now reads a directory: EISDIR / EINVAL
        os.close(directory)
        ids = np.array([[3, 0, 0], [40, 0, 0]], dtype=np.int64)
        with pytest.raises(DiskReadError, match=rf"reading 4096 bytes of {layer.file} at offset (0|8192) failed: "
                                                r".*\(errno (21|22)\)"):
            layer.read_rows(ids, np.zeros(ids.size * 264, np.uint8))


@pytest.mark.timeout(30)
def test_o_direct_refused_falls_back_to_the_page_cache_and_says_so(small_layer, monkeypatch, caplog):
    d, sizes, tables = small_layer
    real_open = os.open

    def no_direct(path, flags, mode=0o777, *, dir_fd=None):
        if flags & _files.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(_files.os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="engram_store.disk._files"), d.open(7) as layer:
        assert not layer.direct and layer.stats()["direct"] == 0
        ids = np.array([[99, 30, 249]], dtype=np.int64)
        out = np.empty(3 * 264, np.uint8)
        layer.read_rows(ids, out)
        np.testing.assert_array_equal(out, expected_rows(tables, ids))
    assert "refuses O_DIRECT" in caplog.text


def test_bad_arguments_are_refused_before_any_read(small_layer):
    d, sizes, _ = small_layer
    layer = d.open(7)
    out = np.empty(2 * 3 * 264, np.uint8)
    good = np.zeros((2, 3), np.int64)
    with pytest.raises(InvalidArgument, match=r"ids\[1, 1\] = 31 is out of range for head 1 of layer 7 "
                                              r"\(expected 0 <= id < 31\)"):
        layer.read_rows(np.array([[0, 0, 0], [0, 31, 0]], np.int64), out)
    with pytest.raises(InvalidArgument, match=r"ids\[0, 2\] = -1 is out of range"):
        layer.read_rows(np.array([[0, 0, -1], [0, 0, 0]], np.int64), out)
    with pytest.raises(InvalidType, match="ids: expected an int64 array"):
        layer.read_rows(good.astype(np.int32), out)
    with pytest.raises(InvalidArgument, match=r"ids: expected shape \[M, 3\]"):
        layer.read_rows(np.zeros((2, 2), np.int64), out)
    with pytest.raises(InvalidArgument, match="ids: expected a C-contiguous"):
        layer.read_rows(np.zeros((3, 2), np.int64).T, out)
    with pytest.raises(InvalidArgument, match="out: expected a writable C-contiguous buffer of 1584 bytes"):
        layer.read_rows(good, out[:-1])
    with pytest.raises(InvalidArgument, match="writable=False"):
        ro = out.copy()
        ro.flags.writeable = False
        layer.read_rows(good, ro)
    with pytest.raises(InvalidType, match="out: expected a writable numpy array, got bytearray"):
        layer.read_rows(good, bytearray(1584))
    with pytest.raises(InvalidArgument, match=r"requests\[0\]: expected a \(layer, ids, out\) tuple"):
        read_many([(layer, good)])
    with pytest.raises(InvalidType, match=r"requests\[1\]: expected a DiskLayer first"):
        read_many([(layer, good, out), ("layer", good, out)])
    with pytest.raises(InvalidArgument, match=r"capacity_bytes: expected a byte count >= 1920 \(one set of 7 rows "
                                              r"of 264 bytes\), got 100"):
        RowCache(100, 264)
    with pytest.raises(InvalidArgument, match=r"capacity_bytes: expected at most \d+ bytes \(2\*\*32 - 1 sets\)"):
        RowCache((1 << 32) * 1920, 264)  # refused before anything is allocated
    with pytest.raises(InvalidArgument, match="admission: expected one of"):
        RowCache(1 << 20, 264, admission="lru")
    with pytest.raises(InvalidArgument, match=r"depth: expected an int in \[1, 1024\], got 0"):
        IOEngine(0)
    with pytest.raises(InvalidArgument, match="mode: expected one of"):
        IOEngine(4, "uring")
    layer.close()
    layer.close()
    with pytest.raises(StoreError, match="this DiskLayer is closed"):
        layer.read_rows(good, out)
