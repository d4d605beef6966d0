"""Properties of compat.EngramStore's byte-row lookups: whatever the row width, layer set and ids, lookup_into
and lookup_many_into return exactly NumPy's fancy indexing of the uint8 tables, on every path a layer is read
from: a store whose segment is mapped here, segment processes read over the network, the caller's own arrays
(bind_local), and files under local_dir."""
from __future__ import annotations

import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compat_helpers import byte_config, gather, next_layer
from engram_store import DistributedStore
from engram_store.compat import EngramStore, ReplicateConfig
from engram_store.testing import Cluster

pytestmark = pytest.mark.timeout(300)

#: Up to three layers, each with 1-4 heads of 1-400 rows and rows of 1-300 bytes.
layer_sets = st.lists(st.tuples(st.lists(st.integers(1, 400), min_size=1, max_size=4), st.integers(1, 300)),
                      min_size=1, max_size=3)
batches = st.tuples(st.integers(1, 4), st.integers(1, 8))  # B, L
#: How far apart ids fall: narrow spans make duplicate and adjacent rows likely.
spans = st.sampled_from([1, 3, 16, 10_000])


@pytest.fixture(scope="module")
def embedded():
    """A store whose segment is mapped in this process: every head is gathered from memory."""
    with DistributedStore.embedded(segment_size="64MiB") as store:
        yield store


@pytest.fixture(scope="module")
def cluster():
    with Cluster(segments=2, segment_size="64MiB") as c:
        yield c


@pytest.fixture(scope="module")
def remote(cluster):
    """Connected to two segment processes without mapping their memory: every row travels over the network."""
    with DistributedStore.connect(cluster.address, local_direct=False) as store:
        yield store


def make_layers(layer_set, seed):
    """``{layer_id: config}`` and ``{layer_id: tables}`` with fresh layer ids."""
    rng = np.random.default_rng(seed)
    configs, tables = {}, {}
    for sizes, row_bytes in layer_set:
        layer_id = next_layer()
        configs[layer_id] = byte_config(sizes, row_bytes)
        tables[layer_id] = [rng.integers(0, 256, (n, row_bytes), dtype=np.uint8) for n in sizes]
    return configs, tables


def draw_ids(rng, sizes, B, L, span):
    starts = [rng.integers(0, max(1, n - span + 1)) for n in sizes]
    return np.stack([start + rng.integers(0, min(n, span), (B, L)) for start, n in zip(starts, sizes)],
                    axis=-1).astype(np.int64)  # (B, L, H)


def check_lookups(table, tables, batch, span, seed):
    """lookup_into per layer, then lookup_many_into over all layers (one of them twice), equal fancy indexing."""
    rng = np.random.default_rng(seed)
    B, L = batch
    layer_ids, ids, outputs = [], [], []
    for layer_id, layer_tables in tables.items():
        sizes, row_bytes = table.get_table_vocab_sizes(layer_id), table.get_row_bytes(layer_id)
        layer_ids.append(layer_id)
        ids.append(draw_ids(rng, sizes, B, L, span))
        output = np.full(ids[-1].shape + (row_bytes,), 0xAB, dtype=np.uint8)
        assert table.lookup_into(layer_id, ids[-1], output) is None
        assert output.tobytes() == gather(layer_tables, ids[-1]).tobytes()
        outputs.append(np.zeros_like(output))
    first = layer_ids[0]
    layer_ids.append(first)
    ids.append(draw_ids(rng, table.get_table_vocab_sizes(first), L, B, span))
    outputs.append(np.zeros(ids[-1].shape + (table.get_row_bytes(first),), dtype=np.uint8))
    assert table.lookup_many_into(layer_ids, ids, outputs) is None
    for layer_id, i, output in zip(layer_ids, ids, outputs):
        assert output.tobytes() == gather(tables[layer_id], i).tobytes()


def check_store_path(store, layer_set, batch, span, seed):
    configs, tables = make_layers(layer_set, seed)
    table = EngramStore(configs, store_client=store)
    try:
        for layer_id, layer_tables in tables.items():
            table.populate(layer_id, layer_tables)
        check_lookups(table, tables, batch, span, seed)
    finally:
        for layer_id in configs:
            table.remove_from_store(layer_id, force=True)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layer_set=layer_sets, batch=batches, span=spans, seed=st.integers(0, 2**31))
def test_store_path_mapped_segment_equals_fancy_indexing(embedded, layer_set, batch, span, seed):
    check_store_path(embedded, layer_set, batch, span, seed)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layer_set=layer_sets, batch=batches, span=spans, seed=st.integers(0, 2**31))
def test_store_path_segment_processes_equals_fancy_indexing(remote, layer_set, batch, span, seed):
    check_store_path(remote, layer_set, batch, span, seed)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layer_set=layer_sets, batch=batches, span=spans, seed=st.integers(0, 2**31))
def test_bind_local_path_equals_fancy_indexing(layer_set, batch, span, seed):
    configs, tables = make_layers(layer_set, seed)
    with EngramStore(configs) as table:
        for layer_id, layer_tables in tables.items():
            table.bind_local(layer_id, layer_tables)
        check_lookups(table, tables, batch, span, seed)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layer_set=layer_sets, batch=batches, span=spans, seed=st.integers(0, 2**31))
def test_local_dir_path_equals_fancy_indexing(layer_set, batch, span, seed):
    configs, tables = make_layers(layer_set, seed)
    with tempfile.TemporaryDirectory(prefix="engram-compat-") as directory:
        reader = EngramStore(configs, local_dir=directory)  # built before anything is published
        with EngramStore(configs, local_dir=directory) as writer:
            for layer_id, layer_tables in tables.items():
                writer.populate(layer_id, [t.copy() for t in layer_tables])
        check_lookups(reader, tables, batch, span, seed)
        reader.close()


def test_replica_num_puts_copies_on_distinct_segments():
    with Cluster(segments=2, segment_size="16MiB") as cluster, \
            DistributedStore.connect(cluster.address, local_direct=False) as store:
        layer_id = next_layer()
        table = EngramStore({layer_id: byte_config([300, 301], 37)}, store)
        rng = np.random.default_rng(1)
        tables = [rng.integers(0, 256, (n, 37), dtype=np.uint8) for n in [300, 301]]
        replica = ReplicateConfig()
        replica.replica_num = 2
        table.populate(layer_id, tables, replica)
        infos = store.locate(table.get_store_keys(layer_id), lease=False)
        assert [len({r.segment_id for r in info.replicas}) for info in infos] == [2, 2]
        ids = np.array([[[299, 300], [0, 1]]], dtype=np.int64)
        output = np.empty((1, 2, 2, 37), dtype=np.uint8)
        table.lookup_into(layer_id, ids, output)
        assert output.tobytes() == gather(tables, ids).tobytes()
