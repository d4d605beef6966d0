"""compat.EngramStore next to Mooncake's own, on a real Mooncake store (``mooncake_master`` from its wheel).

The installed wheel carries Mooncake's single-layer EngramStore: the same user script prints the same line on
both, and a layer written by either is read by the other. The byte-row API runs over a real
``mooncake.store.MooncakeDistributedStore``. Skipped, with the reason, where the wheel cannot load.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

try:
    import mooncake.store as mooncake_store  # fails without the wheel, or without libibverbs.so.1
except ImportError as exc:
    pytest.skip(f"mooncake.store does not load ({exc}); install Mooncake's wheel with `pip install -e "
                "\".[mooncake]\"` and `apt-get install libibverbs1` to run these tests", allow_module_level=True)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mooncake"))

from compat_helpers import (MOONCAKE_IMPORT, SIZES, byte_config, float_config, float_tables, gather,  # noqa: E402
                            next_layer, run_script, user_script)
from mooncake_procs import MooncakeMaster, connect  # noqa: E402

from engram_store import ObjectExists  # noqa: E402
from engram_store.compat import EngramStore  # noqa: E402
from engram_store.testing import Cluster  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def mooncake():
    """A real MooncakeDistributedStore that mounts the only segment, against its own mooncake_master."""
    with MooncakeMaster() as master:
        store = connect(master.address, segment_size=128 << 20)
        try:
            yield store
        finally:
            store.close()


def test_single_layer_script_prints_the_same_on_mooncake_and_on_compat(tmp_path):
    with MooncakeMaster() as master:
        on_mooncake = run_script(user_script("single_layer.py", tmp_path, imports=MOONCAKE_IMPORT), master.address)
    with Cluster(segments=0) as cluster:
        on_compat = run_script(user_script("single_layer.py", tmp_path), cluster.address)
    assert on_compat == on_mooncake
    assert on_mooncake.endswith("removed=4 again=0 left=[0, 0, 0, 0]")


def test_single_layer_tables_written_by_either_are_read_by_the_other(mooncake):
    layer_id = next_layer()
    theirs_config = mooncake_store.EngramStoreConfig()
    theirs_config.table_vocab_sizes = SIZES
    theirs_config.embedding_dim = 8
    theirs = mooncake_store.EngramStore(layer_id, theirs_config, mooncake)
    ours = EngramStore(layer_id, float_config(SIZES, 8), mooncake)
    assert ours.get_store_keys() == theirs.get_store_keys()
    tables = float_tables(SIZES, 8, seed=3)
    ids = np.array([[[16, 18, 22, 28], [1, 2, 3, 4]]], dtype=np.int64)
    try:
        theirs.populate(tables)
        np.testing.assert_array_equal(ours.lookup(ids), gather(tables, ids))
        with pytest.raises(RuntimeError) as info:
            ours.populate(tables)  # create-only across implementations
        assert isinstance(info.value, ObjectExists)
        assert ours.remove_from_store(force=True) == 4
        ours.populate(tables)
        np.testing.assert_array_equal(theirs.lookup(ids.tolist()), gather(tables, ids))
    finally:
        ours.remove_from_store(force=True)


def test_byte_rows_on_a_real_mooncake_store(mooncake):
    first, second = next_layer(), next_layer()
    table = EngramStore({first: byte_config(SIZES, 264), second: byte_config([7, 11], 37)}, store_client=mooncake)
    rng = np.random.default_rng(4)
    tables = {layer_id: [rng.integers(0, 256, (n, table.get_row_bytes(layer_id)), dtype=np.uint8)
                         for n in table.get_table_vocab_sizes(layer_id)] for layer_id in (first, second)}
    try:
        for layer_id, layer_tables in tables.items():
            table.populate(layer_id, layer_tables)
        with pytest.raises(RuntimeError, match="already exists"):
            table.populate(first, tables[first])
        ids = [np.array([[[16, 18, 22, 28], [0, 0, 0, 0]]], dtype=np.int64), np.array([[[6, 10]]], dtype=np.int64)]
        outputs = [np.empty((1, 2, 4, 264), dtype=np.uint8), np.empty((1, 1, 2, 37), dtype=np.uint8)]
        table.lookup_into(first, ids[0], outputs[0])
        np.testing.assert_array_equal(outputs[0], gather(tables[first], ids[0]))
        outputs[0].fill(0)
        table.lookup_many_into([first, second], ids, outputs)
        for layer_id, i, output in zip((first, second), ids, outputs):
            np.testing.assert_array_equal(output, gather(tables[layer_id], i))
        bad = ids[0].copy()
        bad[0, 1, 3] = 29
        with pytest.raises(RuntimeError, match=r"row_ids\[0, 1, 3\] = 29 is out of range"):
            table.lookup_into(first, bad, outputs[0])
        assert not outputs[0].any()
        # Mooncake leases what a read touched for 10 s: remove without force is refused meanwhile.
        with pytest.raises(RuntimeError, match="remove_from_store failed, rc=-706"):
            table.remove_from_store(first)
    finally:
        assert table.remove_from_store(first, force=True) == 4
        assert table.remove_from_store(second, force=True) == 2
    assert mooncake.batch_is_exist(table.get_store_keys(first)) == [0, 0, 0, 0]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=4), row_bytes=st.integers(1, 300),
       B=st.integers(1, 3), L=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_byte_row_lookups_on_mooncake_equal_fancy_indexing(mooncake, sizes, row_bytes, B, L, seed):
    layer_id = next_layer()
    table = EngramStore({layer_id: byte_config(sizes, row_bytes)}, mooncake)
    rng = np.random.default_rng(seed)
    tables = [rng.integers(0, 256, (n, row_bytes), dtype=np.uint8) for n in sizes]
    table.populate(layer_id, tables)
    try:
        ids = np.stack([rng.integers(0, n, (B, L)) for n in sizes], axis=-1).astype(np.int64)
        output = np.empty((B, L, len(sizes), row_bytes), dtype=np.uint8)
        table.lookup_into(layer_id, ids, output)
        assert output.tobytes() == gather(tables, ids).tobytes()
    finally:
        table.remove_from_store(layer_id, force=True)
