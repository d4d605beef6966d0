"""compat.EngramStore(layer_id, config, store): Mooncake's single-layer float32 API (its first EngramStore).

Ports the behaviours of Mooncake's scripts/test_engram_store.py of that generation, plus the argument checks of
its binding: the builtin exception types are Mooncake's, and each is also an engram_store error.
"""
from __future__ import annotations

import numpy as np
import pytest

from compat_helpers import SIZES, float_config, float_tables, gather, next_layer
from engram_store import EngramError, NotConnected, ObjectExists, ObjectNotFound
from engram_store.compat import EngramStore, EngramStoreConfig

pytestmark = pytest.mark.timeout(120)

D = 8


@pytest.fixture
def layer(mc_store):
    """A populated single-layer EngramStore, removed after the test."""
    table = EngramStore(layer_id=next_layer(), config=float_config(SIZES, D), store=mc_store)
    tables = float_tables(SIZES, D, seed=1)
    table.populate(tables)
    try:
        yield table, tables
    finally:
        table.remove_from_store(force=True)


# ---- metadata ----------------------------------------------------------------------------------------


def test_creation_and_metadata(mc_store):
    layer_id = next_layer()
    table = EngramStore(layer_id, float_config(SIZES, D), mc_store)
    assert table.get_num_heads() == 4
    assert table.get_embedding_dim() == D
    assert table.get_table_vocab_sizes() == SIZES
    assert table.get_store_keys() == [f"engram:l{layer_id}:h{h}" for h in range(4)]


def test_creation_without_store_keeps_metadata_accessible():
    table = EngramStore(7, float_config(SIZES, D))
    assert table.get_num_heads() == 4 and table.get_embedding_dim() == D
    assert table.get_store_keys()[0] == "engram:l7:h0"


def test_config_defaults_and_copy_semantics():
    config = EngramStoreConfig()
    assert (config.table_vocab_sizes, config.embedding_dim, config.row_bytes) == ([1024], 64, 0)
    config.table_vocab_sizes.append(5)  # reading returns a copy, as pybind11 does
    assert config.table_vocab_sizes == [1024]
    sizes = [3, 4]
    config.table_vocab_sizes = sizes
    sizes.append(5)  # setting copies in
    assert config.table_vocab_sizes == [3, 4]
    config.table_vocab_sizes = np.array([7, 8])
    assert config.table_vocab_sizes == [7, 8] and all(type(n) is int for n in config.table_vocab_sizes)
    for field, value in [("table_vocab_sizes", [1.5]), ("table_vocab_sizes", "17"), ("embedding_dim", 8.0),
                         ("row_bytes", "32")]:
        with pytest.raises(TypeError, match=field):
            setattr(config, field, value)


@pytest.mark.parametrize("sizes, dim, message", [
    ([], 8, r"table_vocab_sizes: expected a non-empty list"),
    ([17, 0], 8, r"table_vocab_sizes\[1\]: expected a positive integer, got 0"),
    ([17, -3], 8, r"table_vocab_sizes\[1\]: expected a positive integer, got -3"),
    ([17], 0, r"embedding_dim: expected a positive integer, got 0"),
])
def test_constructor_refuses_bad_configs_with_value_error(sizes, dim, message):
    with pytest.raises(ValueError, match=message):
        EngramStore(1, float_config(sizes, dim))


def test_constructor_refuses_other_stores_and_configs():
    with pytest.raises(RuntimeError, match="store: expected a MooncakeDistributedStore.*got dict"):
        EngramStore(1, float_config(), {"not": "a store"})
    with pytest.raises(TypeError, match="config: expected an EngramStoreConfig, got dict"):
        EngramStore(1, {"table_vocab_sizes": [3]})
    with pytest.raises(TypeError, match="layer id int"):
        EngramStore("1", float_config())


# ---- populate and lookup ---------------------------------------------------------------------------


def test_populate_and_lookup_shape_with_python_lists(layer):
    table, _ = layer
    rows = table.lookup([[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13, 14, 15]]])
    assert rows.shape == (2, 2, 4, D) and rows.dtype == np.float32
    assert np.isfinite(rows).all()


def test_lookup_matches_stored_rows_from_numpy_ids(layer):
    table, tables = layer
    ids = np.array([[[0, 1, 2, 3], [16, 18, 22, 28]]], dtype=np.int64)
    np.testing.assert_array_equal(table.lookup(ids), gather(tables, ids))


def test_lookup_list_and_numpy_paths_match(layer):
    table, _ = layer
    ids = np.array([[[3, 2, 1, 0], [16, 18, 22, 28]], [[5, 5, 5, 5], [0, 0, 0, 0]]], dtype=np.int64)
    np.testing.assert_array_equal(table.lookup(ids.tolist()), table.lookup(ids))
    np.testing.assert_array_equal(table.lookup(ids.astype(np.int32)), table.lookup(ids))  # arrays of any int width


def test_populate_casts_to_float32_as_mooncake_does(mc_store):
    table = EngramStore(next_layer(), float_config([5, 6], 3), mc_store)
    tables = [np.arange(15, dtype=np.float64).reshape(5, 3), np.arange(18, dtype=np.int64).reshape(6, 3)[:, ::-1]]
    try:
        table.populate(tables)
        ids = np.array([[[4, 5]]])
        np.testing.assert_array_equal(table.lookup(ids)[0, 0], [[12, 13, 14], [17, 16, 15]])
    finally:
        assert table.remove_from_store() == 2


def test_remove_from_store(mc_store):
    table = EngramStore(next_layer(), float_config(SIZES, D), mc_store)
    table.populate(float_tables(SIZES, D, seed=2))
    assert table.remove_from_store() == 4
    assert [mc_store.is_exist(key) for key in table.get_store_keys()] == [0, 0, 0, 0]
    assert table.remove_from_store() == 0


# ---- errors ------------------------------------------------------------------------------------------


def test_populate_rejects_reusing_existing_layer_keys(layer):
    table, tables = layer
    with pytest.raises(RuntimeError, match="already exists") as info:
        table.populate(tables)
    assert isinstance(info.value, ObjectExists)


def test_lookup_rejects_missing_tables(mc_store):
    table = EngramStore(next_layer(), float_config(SIZES, D), mc_store)
    with pytest.raises(RuntimeError, match="not in the store") as info:
        table.lookup([[[0, 0, 0, 0]]])
    assert isinstance(info.value, ObjectNotFound)


def test_populate_rejects_wrong_table_shape(mc_store):
    table = EngramStore(next_layer(), float_config(SIZES, D), mc_store)
    tables = float_tables(SIZES, D, seed=3)
    tables[0] = tables[0][:-1]
    with pytest.raises(RuntimeError, match=r"embedding_buffers\[0\]: expected shape \(17, 8\).*got \(16, 8\)"):
        table.populate(tables)
    assert [mc_store.is_exist(key) for key in table.get_store_keys()] == [0, 0, 0, 0]


def test_populate_rejects_wrong_counts_and_non_arrays(mc_store):
    table = EngramStore(next_layer(), float_config(SIZES, D), mc_store)
    tables = float_tables(SIZES, D, seed=4)
    with pytest.raises(RuntimeError, match="expected 4 tables .* got 3"):
        table.populate(tables[:3])
    with pytest.raises(RuntimeError, match=r"embedding_buffers\[2\]: expected a NumPy array, got list"):
        table.populate(tables[:2] + [tables[2].tolist(), tables[3]])
    with pytest.raises(TypeError, match="expected a list"):
        table.populate(tuple(tables))


def test_lookup_rejects_empty_input(layer):
    table, _ = layer
    with pytest.raises(RuntimeError, match="row_ids"):
        table.lookup([])


def test_lookup_rejects_wrong_head_dimension(layer):
    table, _ = layer
    with pytest.raises(RuntimeError, match="H = 4"):
        table.lookup(np.zeros((1, 1, 3), dtype=np.int64))


def test_lookup_rejects_out_of_range_row_id(layer):
    table, _ = layer
    with pytest.raises(RuntimeError, match=r"row_ids\[0, 0, 1\] = 999 is out of range: head 1 .* 19 rows"):
        table.lookup([[[0, 999, 0, 0]]])
    with pytest.raises(RuntimeError, match=r"row_ids\[0, 1, 3\] = -1"):
        table.lookup([[[0, 0, 0, 0], [0, 0, 0, -1]]])


def test_without_a_store_reads_and_writes_fail_with_runtime_error():
    table = EngramStore(3, float_config(SIZES, D))
    with pytest.raises(RuntimeError) as populate:
        table.populate(float_tables(SIZES, D, seed=5))
    with pytest.raises(RuntimeError) as lookup:
        table.lookup([[[0, 0, 0, 0]]])
    with pytest.raises(RuntimeError, match="rc=-600") as remove:
        table.remove_from_store()
    for info in (populate, lookup, remove):
        assert isinstance(info.value, NotConnected) and isinstance(info.value, EngramError)
