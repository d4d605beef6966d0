"""Every page read from SSD is checked: the page checksum kernel against its twin, what the writer stores, what a
read does with a damaged page, and the layers that are read unchecked (and say so)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from disk_helpers import expected_rows, make_tables
from suite_helpers import flip_byte
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_store import EngramStore, EngramStoreConfig
from engram_store.disk import DiskDir, DiskLayout, DiskReadError, IOEngine, RowCache, aio_available
from engram_store.disk import _checksum

pytestmark = pytest.mark.timeout(60)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 9000), st.integers(0, (1 << 63) - 1), st.integers(0, 2**32))
def test_page_checksum_kernel_matches_xxh64(n, seed, data_seed):
    data = np.random.default_rng(data_seed).integers(0, 256, n, dtype=np.uint8)
    assert _checksum.page_checksum(data, seed) == _checksum.xxh64_numpy(data, seed)


def _flip(path: str, offset: int) -> None:
    os.chmod(path, 0o644)  # published read-only
    flip_byte(path, offset, 0x01)


def test_each_block_of_a_written_layer_ends_with_the_checksum_of_the_rest(small_layer):
    d, sizes, _ = small_layer
    lay = DiskLayout.of(264, sizes, checked=True)
    assert lay.checked and lay.summed_bytes == 4096 - 8
    data = np.fromfile(os.path.join(d.layer_path(7), "rows.bin"), dtype=np.uint8)
    for offset in range(0, data.size, lay.block_bytes):
        block = data[offset:offset + lay.block_bytes]
        stored = int(block[-8:].view("<u8")[0])
        assert stored == _checksum.xxh64_numpy(block[:-8], offset), f"block at {offset}"
    assert d.page_checks(7) == "xxh64"


@pytest.mark.parametrize("mode", ["aio", "threads"])
def test_a_flipped_byte_in_a_page_is_a_disk_read_error_naming_layer_head_and_page(small_layer, mode):
    if mode == "aio" and not aio_available():
        pytest.skip("no Linux native AIO here")
    d, sizes, tables = small_layer
    lay = DiskLayout.of(264, sizes)
    _flip(os.path.join(d.layer_path(7), "rows.bin"), lay.row_offset(2, 37) + 100)  # head 2, page 2 (rows 30-44)
    cache = RowCache(1 << 20, 264)
    with IOEngine(4, mode) as engine, d.open(7, cache=cache, engine=engine) as layer:
        bad = np.array([[0, 0, 31], [1, 2, 44]], dtype=np.int64)
        out = np.empty(bad.size * 264, dtype=np.uint8)
        for _ in range(2):  # nothing of the damaged page was cached: the second read finds it damaged too
            with pytest.raises(DiskReadError, match=r"disk layer 7: head 2, page 2 \(rows 30-44\) at offset "
                                                     f"{lay.row_offset(2, 30)} .* does not match its checksum"):
                layer.read_rows(bad, out)
        good = np.array([[5, 3, 29], [99, 30, 45]], dtype=np.int64)  # the pages beside it read as ever
        out = np.empty(good.size * 264, dtype=np.uint8)
        layer.read_rows(good, out)
        np.testing.assert_array_equal(out, expected_rows(tables, good))
    with pytest.raises(DiskReadError, match="head 2, page 2 "):
        d.verify(7)


def test_a_damaged_page_fails_an_engram_store_lookup_through_a_host_cache(tmp_path):
    config = EngramStoreConfig(table_vocab_sizes=[300, 40], embedding_dim=264, row_format="bytes")
    tables = make_tables(np.random.default_rng(5), [300, 40], 264)
    with EngramStore(3, config, disk_dir=tmp_path, row_cache_bytes=1 << 20, cache_scope="host") as layer:
        layer.populate(tables)
        _flip(os.path.join(tmp_path, "layer-3", "rows.bin"), DiskLayout.of(264, [300, 40]).row_offset(1, 20))
        ids = np.array([[[0, 20]]], dtype=np.int64)
        with pytest.raises(DiskReadError, match="disk layer 3: head 1, page 1 "):
            layer.lookup(ids)
        ids = np.array([[[0, 3]]], dtype=np.int64)
        np.testing.assert_array_equal(layer.lookup(ids)[0, 0], np.stack([tables[0][0], tables[1][3]]))


def _layers_list(disk_dir) -> dict:
    done = subprocess.run([sys.executable, "-m", "engram_store.tables.cli", "list", "--disk-dir", str(disk_dir),
                           "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return {info["layer_id"]: info["detail"] for info in json.loads(done.stdout)["layers"]}


def test_layers_without_page_checksums_open_read_unchecked_and_say_so(tmp_path):
    d = DiskDir(tmp_path)
    rng = np.random.default_rng(9)
    tables = make_tables(rng, [40, 7], 264)
    d.write(1, 264, [40, 7], tables, progress=False)
    d.write(2, 256, [40, 7], make_tables(rng, [40, 7], 256), progress=False)  # rows that fill their pages
    manifest = os.path.join(d.layer_path(1), "manifest.json")  # layer 1 as a writer before page checksums left it
    with open(manifest) as f:
        record = json.load(f)
    record["format"] = "engram-disk-v1"
    del record["page_checksum"]
    os.chmod(manifest, 0o644)
    with open(manifest, "w") as f:
        json.dump(record, f)
    assert d.page_checks(1) == "unchecked (written before page checksums)"
    assert d.page_checks(2) == "unchecked (its rows fill the pages: no room for a checksum)"
    listed = _layers_list(tmp_path)
    assert listed == {1: "pages read unchecked (written before page checksums)",
                      2: "pages read unchecked (its rows fill the pages: no room for a checksum)"}
    with d.open(1) as layer:
        ids = np.array([[3, 6], [39, 0]], dtype=np.int64)
        out = np.empty(ids.size * 264, dtype=np.uint8)
        layer.read_rows(ids, out)
        np.testing.assert_array_equal(out, expected_rows(tables, ids))
