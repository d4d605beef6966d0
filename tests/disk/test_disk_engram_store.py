"""EngramStore(..., disk_dir=...): layers on local SSD through the same API as every other place for tables."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from suite_helpers import run_threads
from engram_store import (
    DistributedStore,
    EngramStore,
    EngramStoreConfig,
    InvalidArgument,
    ObjectExists,
    ObjectNotFound,
    lookup_many,
)

pytestmark = pytest.mark.timeout(120)

SIZES = [701, 1009, 97]
CONFIG = EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=66, row_format="bytes")


def _tables(seed: int, sizes=SIZES, dim=66) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (n, dim), dtype=np.uint8) for n in sizes]


def _ids(rng, B: int, L: int, sizes=SIZES) -> np.ndarray:
    return np.stack([rng.integers(0, n, (B, L)) for n in sizes], axis=-1)


def _expected(tables, ids):
    return np.stack([tables[h][ids[..., h]] for h in range(len(tables))], axis=-2)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A layer written once under a disk_dir; tests open EngramStores of their own on it."""
    path = tmp_path_factory.mktemp("disk")
    tables = _tables(1)
    with EngramStore(1, CONFIG, disk_dir=path) as writer:
        writer.populate(tables)
    return path, tables


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cache_rows=st.sampled_from([0, 8, 200, 5000]), B=st.integers(1, 4), L=st.integers(1, 40),
       seed=st.integers(0, 2**31 - 1))
def test_lookups_equal_numpy_indexing_whatever_the_cache(published, cache_rows, B, L, seed):
    path, tables = published
    rng = np.random.default_rng(seed)
    with EngramStore(1, CONFIG, disk_dir=path, row_cache_bytes=cache_rows * 160) as layer:
        for _ in range(3):  # repeats are served by the cache where it holds them
            ids = _ids(rng, B, L)
            np.testing.assert_array_equal(layer.lookup(ids), _expected(tables, ids))
            np.testing.assert_array_equal(layer.prefetch(ids, background=True).result(timeout=60),
                                          _expected(tables, ids))


def test_concurrent_lookups_from_threads_share_the_cache(published):
    path, tables = published
    with EngramStore(1, CONFIG, disk_dir=path, row_cache_bytes=64 << 10) as layer:
        def run(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(30):
                ids = _ids(rng, 2, 16) % np.array([50, 50, 50])  # a hot set: hits and fills race
                np.testing.assert_array_equal(layer.lookup(ids), _expected(tables, ids))

        run_threads(run, 4, 60, "a lookup thread")
        stats = layer.stats()
        assert stats["lookups"] == 120 and stats["rows"] == 120 * 2 * 16 * 3
        assert stats["cache_hits"] > 0 and stats["pages_read"] > 0 and stats["bytes_read"] >= 4096
        assert stats["cache_hits"] + stats["cache_misses"] == stats["rows"]


def test_several_layers_on_one_disk_dir_read_together_and_stats(tmp_path):
    other = EngramStoreConfig(table_vocab_sizes=[300, 301], embedding_dim=8)  # float32 rows of 32 bytes
    t1, t2 = _tables(2), [np.random.default_rng(3).standard_normal((n, 8), dtype=np.float32) for n in (300, 301)]
    layers = EngramStore({1: CONFIG, 14: other}, disk_dir=tmp_path, row_cache_bytes=1 << 20)
    layers.populate(t1, layer=1)
    layers.populate(t2, layer=14)
    rng = np.random.default_rng(4)
    ids1, ids2 = _ids(rng, 2, 8), _ids(rng, 2, 8, [300, 301])
    rows = layers.lookup_layers({1: ids1, 14: ids2})
    np.testing.assert_array_equal(rows[1], _expected(t1, ids1))
    np.testing.assert_array_equal(rows[14], _expected(t2, ids2))
    both = lookup_many([(layers, ids1), (layers, ids2)], layers=[1, 14]).result()
    np.testing.assert_array_equal(both[1], rows[14])
    assert layers.stats(layer=14)["pages_read"] > 0 and layers.stats(layer=14)["lookups"] == 2
    assert layers.local_tables(layer=1) is None  # on disk, not in memory
    assert layers.verify(layer=1) == [0, 1, 2]
    reader = EngramStore(14, other, disk_dir=tmp_path)  # another EngramStore (or process) on the same directory
    np.testing.assert_array_equal(reader.lookup(ids2), rows[14])
    assert layers.remove_from_store(layer=14) == 2
    with pytest.raises(ObjectNotFound, match="not published under disk_dir"):
        EngramStore(14, other, disk_dir=tmp_path).lookup(ids2)
    layers.populate(t2, layer=14)  # written anew after the remove
    np.testing.assert_array_equal(layers.lookup(ids2, layer=14), rows[14])
    layers.close()
    reader.close()


def test_disk_layers_refuse_what_they_cannot_do(tmp_path, published):
    path, tables = published
    with pytest.raises(ObjectExists, match="already published under disk_dir"):
        EngramStore(1, CONFIG, disk_dir=path).populate(tables)
    shard = EngramStore(2, CONFIG, disk_dir=tmp_path, heads=[0])
    with pytest.raises(InvalidArgument, match="heads: a disk layer is written whole"):
        shard.populate(tables[:1])
    with pytest.raises(InvalidArgument, match="replica_num"):
        EngramStore(2, CONFIG, disk_dir=tmp_path).populate(tables, replica_num=2)
    with pytest.raises(ObjectNotFound, match="layer 3 is not published under disk_dir"):
        EngramStore(3, CONFIG, disk_dir=tmp_path).lookup(np.zeros((1, 1, 3), np.int64))
    with pytest.raises(InvalidArgument, match="bind_local"):
        EngramStore(3, CONFIG, disk_dir=tmp_path).bind_local(tables)
    with pytest.raises(InvalidArgument, match="not both"):
        EngramStore(3, CONFIG, disk_dir=tmp_path, local_dir=tmp_path / "mem")
    with DistributedStore.embedded(segment_size="8MiB") as store:
        with pytest.raises(InvalidArgument, match="disk_dir: tables are either in a store or under disk_dir"):
            EngramStore(3, CONFIG, store, disk_dir=tmp_path)
    bad = EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=64, row_format="bytes")
    with pytest.raises(Exception, match="row_bytes|64|66"):
        EngramStore(1, bad, disk_dir=path)  # the published layout is checked when the layer is opened


@pytest.mark.parametrize("heads", [None, [0, 2]])
def test_an_id_out_of_range_is_refused_by_name_before_the_cache_serves_a_row(published, heads):
    """A disk layer checks a lookup's ids as its read plans them: an id outside its head raises the InvalidArgument
    every place for tables raises (the facade's ``row_ids[b, l, h]``, in the store's heads), and nothing is written,
    not even the rows the cache holds; the next lookup reads as before."""
    path, tables = published
    held = [tables[h] for h in (heads or range(len(SIZES)))]
    sizes = [len(t) for t in held]
    rng = np.random.default_rng(5)
    ids = _ids(rng, 2, 3, sizes)
    with EngramStore(1, CONFIG, disk_dir=path, row_cache_bytes=1 << 20, heads=heads) as layer:
        for _ in range(2):  # the second one is served by the cache
            np.testing.assert_array_equal(layer.lookup(ids), _expected(held, ids))
        for b, l, h, value in ((1, 2, 1, sizes[1]), (0, 0, 0, -1), (1, 0, len(sizes) - 1, 1 << 40)):
            bad = ids.copy()
            bad[b, l, h] = value
            with pytest.raises(InvalidArgument, match=rf"row_ids\[{b}, {l}, {h}\] = {value} is out of range: "
                                                      rf"head {h} of layer 1 has {sizes[h]} rows"):
                layer.lookup(bad)
            out = np.full(ids.shape + (66,), 7, dtype=np.uint8)
            with pytest.raises(InvalidArgument, match=rf"row_ids\[{b}, {l}, {h}\] = {value} is out of range"):
                layer.lookup_into(bad, out)
            assert (out == 7).all()
        np.testing.assert_array_equal(layer.lookup(ids), _expected(held, ids))
