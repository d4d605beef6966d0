"""EngramStore: lookup equals NumPy fancy indexing on the local-direct and remote paths; the contract holds."""

import itertools
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from suite_helpers import read_ranges_served, run_threads
from engram_store import (
    ConfigError,
    DistributedStore,
    EngramStore,
    EngramStoreConfig,
    InvalidArgument,
    InvalidType,
    NotConnected,
    ObjectExists,
    MixedLayer,
    ObjectNotFound,
    prefetch_many,
)
from engram_store.testing import Cluster
from engram_store.tables import _plan as _engram_store
from engram_store.tables._source_store import StoreSource

pytestmark = pytest.mark.timeout(240)

_layers = itertools.count(1000)


@pytest.fixture(scope="module")
def local_store():
    """Embedded: the segment is mapped in this process, so every head is read local-direct."""
    with DistributedStore.embedded(segment_size="128MiB") as store:
        yield store


@pytest.fixture(scope="module")
def remote_cluster():
    with Cluster(segments=2, segment_size="128MiB", heartbeat_timeout_s=5.0) as c:
        yield c


@pytest.fixture(scope="module")
def remote_store(remote_cluster):
    """Connected to segment processes without mapping their memory: every head is read remotely."""
    with DistributedStore.connect(remote_cluster.address, local_direct=False) as store:
        yield store


def make_tables(sizes, dim, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, dim), dtype=np.float32) for n in sizes]


def expected_rows(tables, ids):
    B, L, H = ids.shape
    out = np.empty((B, L, H, tables[0].shape[1]), tables[0].dtype)
    for h in range(H):
        out[:, :, h] = tables[h][ids[:, :, h]]
    return out


def random_ids(rng, sizes, B, L, dup_pool=None):
    ids = np.stack([rng.integers(0, n, (B, L)) for n in sizes], axis=-1)
    if dup_pool:  # force duplicates and adjacent rows
        for h, n in enumerate(sizes):
            ids[..., h] = rng.integers(0, min(n, dup_pool), (B, L))
    return ids.astype(np.int64)


geometry = st.fixed_dictionaries({
    "sizes": st.lists(st.integers(1, 3000), min_size=1, max_size=6),
    "dim": st.sampled_from([1, 3, 16, 64]),
    "B": st.integers(1, 8),
    "L": st.integers(1, 40),
    "dups": st.sampled_from([None, 2, 7]),
    "seed": st.integers(0, 2**31),
})


def _check_lookup(store, g):
    layer = next(_layers)
    tables = make_tables(g["sizes"], g["dim"], g["seed"])
    es = EngramStore(layer, EngramStoreConfig(table_vocab_sizes=g["sizes"], embedding_dim=g["dim"]), store)
    es.populate(tables)
    try:
        rng = np.random.default_rng(g["seed"] + 1)
        ids = random_ids(rng, g["sizes"], g["B"], g["L"], g["dups"])
        want = expected_rows(tables, ids)
        np.testing.assert_array_equal(es.lookup(ids), want)
        np.testing.assert_array_equal(es.lookup(ids.tolist()), want)  # the list path agrees
        out = np.full_like(want, np.nan)
        assert es.lookup_into(ids, out) is out
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(es.prefetch(ids).result(timeout=30), want)
    finally:
        assert es.remove_from_store() == len(g["sizes"])
        es.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(g=geometry)
def test_lookup_equals_fancy_indexing_local_direct(local_store, g):
    _check_lookup(local_store, g)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(g=geometry)
def test_lookup_equals_fancy_indexing_remote(remote_store, g):
    _check_lookup(remote_store, g)


@pytest.fixture(scope="module")
def one_segment_store():
    """Every head of a layer on one remote segment: the lean path of a lookup."""
    with Cluster(segments=1, segment_size="64MiB", heartbeat_timeout_s=5.0) as c:
        with DistributedStore.connect(c.address, local_direct=False) as store:
            yield store


@pytest.mark.parametrize("direct", [True, False], ids=["rows-as-they-are", "distinct-rows"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(g=geometry)
def test_lookup_equals_fancy_indexing_one_remote_segment(one_segment_store, g, direct, monkeypatch):
    # Small lookups read every (m, h) row straight into the output; larger ones read each distinct row once.
    monkeypatch.setattr(_engram_store, "DIRECT_MAX_ROWS", 1 << 30 if direct else 0)
    _check_lookup(one_segment_store, g)


def test_small_lookups_read_rows_as_they_are_and_large_ones_read_distinct_rows(one_segment_store, monkeypatch):
    sizes = [300] * 4
    tables = make_tables(sizes, 8, 5)
    es = EngramStore(next(_layers), EngramStoreConfig(sizes, 8), one_segment_store)
    es.populate(tables)
    ids = random_ids(np.random.default_rng(6), sizes, 4, 16, dup_pool=7)  # 256 ids, at most 28 distinct
    distinct = sum(len(np.unique(ids[..., h])) for h in range(len(sizes)))
    for limit, rows in ((ids.size, ids.size), (ids.size - 1, distinct)):
        monkeypatch.setattr(_engram_store, "DIRECT_MAX_ROWS", limit)
        es.stats(reset=True)
        np.testing.assert_array_equal(es.lookup(ids), expected_rows(tables, ids))
        stats = es.stats()
        assert (stats["remote_requests"], stats["remote_rows"], stats["remote_bytes"]) == (1, rows, rows * 8 * 4)
    es.remove_from_store()


def test_an_id_out_of_range_on_the_lean_path_is_refused_by_name_and_reads_nothing(one_segment_store):
    """A lookup read in one kernel call checks its ids as it builds the request: an id outside its head's rows
    raises the same InvalidArgument as every path, nothing is sent (the channel stays open), and the next lookup
    reads the rows again in one call."""
    sizes = [40, 50, 60]
    tables = make_tables(sizes, 4, 11)
    es = EngramStore(next(_layers), EngramStoreConfig(sizes, 4), one_segment_store)
    es.populate(tables)
    rng = np.random.default_rng(12)
    ids = random_ids(rng, sizes, 2, 3)
    for _ in range(2):  # the second lookup takes the lean path
        assert np.array_equal(es.lookup(ids), expected_rows(tables, ids))
    before = one_segment_store.raw_routes.channels.copy()
    counts = es.stats()["remote_requests"]
    for b, l, h, value in ((1, 2, 1, 50), (0, 0, 2, -1), (1, 0, 0, 1 << 40)):
        bad = ids.copy()
        bad[b, l, h] = value
        with pytest.raises(InvalidArgument, match=rf"row_ids\[{b}, {l}, {h}\] = {value} is out of range: head {h} "):
            es.lookup(bad)
        out = np.full((2, 3, 3, 4), 7.0, dtype=np.float32)
        with pytest.raises(InvalidArgument, match=rf"row_ids\[{b}, {l}, {h}\] = {value} is out of range"):
            es.lookup_into(bad, out)
        assert (out == 7.0).all()
    # no request went out, and no connection was dropped for it
    assert es.stats()["remote_requests"] == counts
    assert one_segment_store.raw_routes.channels == before and all(ch.sock is not None for ch in before)
    assert np.array_equal(es.lookup(ids), expected_rows(tables, ids))
    assert es.stats()["remote_requests"] == counts + 1
    es.remove_from_store()


@pytest.fixture(scope="module")
def mixed_store():
    """One segment mapped in this process (mounted by the client) and one in another process: a layer's heads
    are read partly local-direct, partly over the network."""
    with Cluster(segments=1, segment_size="64MiB", heartbeat_timeout_s=5.0) as c:
        with DistributedStore.connect(c.address, segment_size="64MiB") as store:
            # The other process's segment stands for one on another host: this client does not map it.
            mapped = store.local_view
            store.local_view = lambda r: mapped(r) if r.segment_id == store.local_segment.segment_id else None
            yield store


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(g=geometry)
def test_lookup_equals_fancy_indexing_heads_local_and_remote(mixed_store, g):
    _check_lookup(mixed_store, g)


def test_a_layer_spread_over_a_local_and_a_remote_segment_reads_both_ways(mixed_store):
    sizes = [3000] * 8
    tables = make_tables(sizes, 16, 4)
    es = EngramStore(next(_layers), EngramStoreConfig(sizes, 16), mixed_store)
    es.populate(tables)
    try:
        ids = random_ids(np.random.default_rng(8), sizes, 4, 16)
        np.testing.assert_array_equal(es.lookup(ids), expected_rows(tables, ids))
        stats = es.stats()
        assert stats["local_rows"] > 0 and stats["remote_rows"] > 0, stats
        local_heads = stats["local_rows"] // ids[..., 0].size
        assert 0 < local_heads < len(sizes) and stats["local_rows"] == local_heads * ids[..., 0].size
        assert stats["rows"] == ids.size and stats["remote_requests"] == 1
    finally:
        es.remove_from_store()


@pytest.mark.parametrize("spread", [False, True], ids=["one-segment", "two-segments"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(g=geometry, round_bytes=st.integers(1, 6000), round_rows=st.integers(1, 300))
def test_lookups_larger_than_a_round_are_read_in_several(one_segment_store, remote_store, spread, g, round_bytes,
                                                        round_rows, monkeypatch):
    # A lookup (or a batch of layers) larger than READ_ROUND_BYTES / READ_ROUND_ROWS is cut into position ranges
    # read one round after another, so no request exceeds a segment's limits; it still counts one lookup.
    monkeypatch.setattr(_engram_store, "READ_ROUND_BYTES", round_bytes)
    monkeypatch.setattr(_engram_store, "READ_ROUND_ROWS", round_rows)
    store = remote_store if spread else one_segment_store
    tables = make_tables(g["sizes"], g["dim"], g["seed"])
    config = EngramStoreConfig(table_vocab_sizes=g["sizes"], embedding_dim=g["dim"])
    reversed_config = EngramStoreConfig(table_vocab_sizes=g["sizes"][::-1], embedding_dim=g["dim"])
    first, second = next(_layers), next(_layers)
    es = EngramStore({first: config, second: reversed_config}, store=store)
    es.populate(tables, layer=first)
    es.populate(tables[::-1], layer=second)
    try:
        ids = random_ids(np.random.default_rng(g["seed"] + 1), g["sizes"], g["B"], g["L"], g["dups"])
        ids2 = ids[..., ::-1].copy()
        np.testing.assert_array_equal(es.lookup(ids, layer=first), expected_rows(tables, ids))
        stats = es.stats(layer=first)
        assert (stats["lookups"], stats["rows"]) == (1, ids.size)
        per_m = len(g["sizes"]) * g["dim"] * 4
        step = max(1, min(round_bytes // per_m, round_rows // len(g["sizes"])))
        assert stats["remote_requests"] >= -(-g["B"] * g["L"] // step)  # one round at least per position range
        both = es.lookup_layers({first: ids, second: ids2})
        np.testing.assert_array_equal(both[first], expected_rows(tables, ids))
        np.testing.assert_array_equal(both[second], expected_rows(tables[::-1], ids2))
        assert es.stats(layer=second)["lookups"] == 1
    finally:
        es.remove_from_store(layer=first)
        es.remove_from_store(layer=second)
        es.close()


def test_heads_spread_over_two_remote_segments_are_read_in_one_round(remote_store, remote_cluster):
    # A layer spread over several servers reads each distinct row once, whatever DIRECT_MAX_ROWS says.
    sizes = [5000] * 8
    tables = make_tables(sizes, 16, 0)
    es = EngramStore(next(_layers), EngramStoreConfig(sizes, 16), remote_store)
    es.populate(tables)
    ids = random_ids(np.random.default_rng(3), sizes, 64, 1, dup_pool=40)
    assert len({r.segment_id for info in remote_store.locate(es.get_store_keys(), lease=False)
                for r in info.replicas}) == 2
    np.testing.assert_array_equal(es.lookup(ids), expected_rows(tables, ids))
    stats = es.stats()
    assert stats["remote_requests"] == 2 and stats["local_rows"] == 0 and stats["retries"] == 0
    assert stats["rows"] == ids.size
    distinct = sum(len(np.unique(ids[..., h])) for h in range(len(sizes)))
    assert stats["remote_rows"] == distinct < ids.size
    assert stats["remote_bytes"] == stats["remote_rows"] * 16 * 4
    np.testing.assert_array_equal(es.lookup(ids), expected_rows(tables, ids))
    assert es.stats(reset=True)["placement_refreshes"] == 1  # resolved once, then cached
    assert es.stats()["lookups"] == 0
    es.remove_from_store()


def test_local_direct_lookups_send_no_request(local_store):
    sizes = [3001, 3011]
    tables = make_tables(sizes, 8, 5)
    es = EngramStore(next(_layers), EngramStoreConfig(sizes, 8), local_store)
    es.populate(tables)
    ids = random_ids(np.random.default_rng(6), sizes, 4, 16)
    np.testing.assert_array_equal(es.lookup(ids), expected_rows(tables, ids))
    stats = es.stats()
    assert stats["lookups"] == 1 and stats["local_rows"] == stats["rows"] == ids.size
    assert stats["remote_requests"] == 0
    es.remove_from_store()


def test_populate_is_create_only_and_remove_counts(local_store):
    layer = next(_layers)
    cfg = EngramStoreConfig(table_vocab_sizes=[10, 20], embedding_dim=4)
    es = EngramStore(layer, cfg, local_store)
    tables = make_tables([10, 20], 4, 1)
    es.populate(tables)
    with pytest.raises(ObjectExists, match=f"engram:l{layer}:h0"):
        es.populate(tables)
    assert es.remove_from_store() == 2
    assert es.remove_from_store() == 0
    # one head left behind by someone else still blocks populate, and the message names it
    local_store.put(f"engram:l{layer}:h1", np.zeros((20, 4), np.float32))
    with pytest.raises(ObjectExists, match=f"engram:l{layer}:h1"):
        es.populate(tables)
    assert local_store.batch_is_exist([f"engram:l{layer}:h0"]) == [False]
    assert es.remove_from_store() == 1


def test_invalid_inputs_raise_and_write_nothing(local_store):
    layer = next(_layers)
    es = EngramStore(layer, EngramStoreConfig([10, 20], 4), local_store)
    good = make_tables([10, 20], 4, 2)
    bad_populates = [
        (good[:1], InvalidArgument, "expected 2 tables"),
        ([good[0], good[1].astype(np.float64)], InvalidType, r"embedding_buffers\[1\].*float32"),
        ([good[0], good[1][:19]], InvalidArgument, r"embedding_buffers\[1\].*\(20, 4\)"),
        ([good[0], np.asfortranarray(np.zeros((20, 4), np.float32))[:, :]], None, None),
        ([good[0], good[1][:, :2].repeat(2, axis=1)[:, ::1]], None, None),
        (np.stack([good[0], good[0]]), InvalidType, "list"),
        ([good[0], [[0.0] * 4] * 20], InvalidType, "NumPy array"),
    ]
    for tables, exc, match in bad_populates:
        if exc is None:
            continue
        with pytest.raises(exc, match=match):
            es.populate(tables)
        assert local_store.batch_is_exist(es.get_store_keys()) == [False, False]
    with pytest.raises(InvalidArgument, match="non-contiguous|C-contiguous"):
        es.populate([good[0], np.zeros((4, 20), np.float32).T])
    with pytest.raises(InvalidArgument, match="replica_num"):
        es.populate(good, replica_num=0)
    assert local_store.batch_is_exist(es.get_store_keys()) == [False, False]

    es.populate(good)
    bad_lookups = [
        ([], InvalidArgument, "non-empty|3 dimensions"),
        (np.zeros((0, 1, 2), np.int64), InvalidArgument, "non-empty"),
        (np.zeros((1, 1, 3), np.int64), InvalidArgument, "H = 2"),
        (np.zeros((1, 2), np.int64), InvalidArgument, "3 dimensions"),
        ([[[0, 1], [2]]], InvalidArgument, "ragged"),
        ([[[0, 1.5]]], InvalidType, "integer"),
        (np.zeros((1, 1, 2), np.float32), InvalidType, "integer"),
        (np.array([[[0, 20]]]), InvalidArgument, r"row_ids\[0, 0, 1\] = 20.*0 <= id < 20"),
        (np.array([[[0, 1]], [[-1, 0]]]), InvalidArgument, r"row_ids\[1, 0, 0\] = -1"),
        ([[["a", "b"]]], InvalidType, "integer"),
    ]
    for ids, exc, match in bad_lookups:
        with pytest.raises(exc, match=match):
            es.lookup(ids)
    with pytest.raises(InvalidArgument, match="out: expected"):
        es.lookup_into([[[0, 0]]], np.empty((1, 1, 2, 5), np.float32))
    with pytest.raises(InvalidArgument, match="out: expected"):
        es.lookup_into([[[0, 0]]], np.empty((1, 1, 2, 4), np.float64))
    with pytest.raises(InvalidArgument, match="row_ids"):
        es.prefetch([[[0, 99]]])
    es.remove_from_store()


def test_metadata_only_store():
    es = EngramStore(3, EngramStoreConfig(table_vocab_sizes=[7, 9], embedding_dim=8))
    assert es.get_table_vocab_sizes() == [7, 9]
    assert es.get_store_keys() == ["engram:l3:h0", "engram:l3:h1"]
    assert es.get_num_heads() == 2 and es.get_embedding_dim() == 8
    for call in (lambda: es.populate(make_tables([7, 9], 8, 0)), lambda: es.lookup([[[0, 0]]]),
                 lambda: es.remove_from_store()):
        with pytest.raises(NotConnected, match="store=None"):
            call()


def test_config_defaults_attributes_and_validation():
    cfg = EngramStoreConfig()
    assert cfg.table_vocab_sizes == [1024] and cfg.embedding_dim == 64
    cfg.table_vocab_sizes = [5, 6]
    cfg.embedding_dim = 2
    assert EngramStore(0, cfg).get_table_vocab_sizes() == [5, 6]
    cfg.embedding_dim = 0
    with pytest.raises(InvalidArgument, match="embedding_dim"):
        EngramStore(0, cfg)
    with pytest.raises(InvalidArgument, match=r"table_vocab_sizes\[1\]"):
        EngramStoreConfig(table_vocab_sizes=[3, -1])
    with pytest.raises(InvalidArgument, match="layer_id"):
        EngramStore(-1, EngramStoreConfig())


def test_concurrent_lookups_from_threads(local_store):
    sizes = [1000, 2000, 3000]
    tables = make_tables(sizes, 8, 5)
    es = EngramStore(next(_layers), EngramStoreConfig(sizes, 8), local_store)
    es.populate(tables)
    done = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(20):
            ids = random_ids(rng, sizes, 4, 16)
            np.testing.assert_array_equal(es.lookup(ids), expected_rows(tables, ids))
        done.append(seed)

    run_threads(worker, 4, 60, "a lookup thread")  # a worker that raises fails the test
    assert sorted(done) == [0, 1, 2, 3]
    es.remove_from_store()
    es.close()


@pytest.mark.parametrize("when", ["after the master published it", "before it reached the master"])
def test_a_populate_interrupted_while_its_manifest_is_put_leaves_no_manifest_without_heads(local_store, monkeypatch,
                                                                                              when):
    """Seed 974124 of the fault explorer: SIGINT reached a populate while its manifest's put was on its way back,
    after the master had published the manifest; the populate took its heads back and left a manifest naming heads
    that were gone (a half-published layer). Now the manifest goes first, whichever side of the master the
    interrupt came."""
    layer, sizes = next(_layers), [300, 200]
    tables = make_tables(sizes, 8, 3)
    es = EngramStore(layer, EngramStoreConfig(sizes, 8), local_store)
    put_manifest = StoreSource.put_manifest

    def interrupted(self, *args, **kwargs):
        if when.startswith("after"):
            put_manifest(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(StoreSource, "put_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        es.populate(tables)
    monkeypatch.undo()
    assert local_store.batch_is_exist(es.get_store_keys()) == [False] * 2
    assert not local_store.is_exist(f"engram:l{layer}:manifest")
    es.populate(tables)  # nothing was left to refuse it
    ids = np.array([[[0, 199], [299, 0]]])
    np.testing.assert_array_equal(es.lookup(ids), expected_rows(tables, ids))
    assert es.remove_from_store() == 2


@pytest.mark.parametrize("where, head", [("local", 0), ("remote", 1)])
def test_a_layer_whose_head_is_not_the_table_its_manifest_names_is_refused_never_read_mixed(local_store,
                                                                                           remote_store, where, head):
    """Seed 977060 of the fault explorer: a master restarted without a journal took back a layer's heads from two
    segments, one of which had been away while the layer was removed and populated again, and lookups returned
    rows of both populates. A reader now compares the checksum the store keeps of each head with the manifest's
    and refuses the layer, naming the head. Here the mix is made directly: a head written over, through the
    store's own API, with a table of another populate. A manifest of other checksums (crc32) is not compared."""
    import json
    import zlib

    store = local_store if where == "local" else remote_store
    layer, sizes = next(_layers), [300, 200]
    tables, others = make_tables(sizes, 8, 5), make_tables(sizes, 8, 6)
    es = EngramStore(layer, EngramStoreConfig(sizes, 8), store)
    es.populate(tables)
    ids = np.array([[[0, 199], [299, 0]]])
    np.testing.assert_array_equal(es.lookup(ids), expected_rows(tables, ids))
    key, manifest_key = es.get_store_keys()[head], f"engram:l{layer}:manifest"
    store.remove(key, force=True)
    store.put(key, others[head].tobytes())
    reader = EngramStore(layer, EngramStoreConfig(sizes, 8), store)
    with pytest.raises(MixedLayer, match=rf"layer {layer}: head {head} \({key!r}\) holds another table .* mixes "
                                         "heads of two populates"):
        reader.lookup(ids)
    mixed = [others[h] if h == head else tables[h] for h in range(2)]
    record = json.loads(store.get(manifest_key, lease=False))
    record.update(checksum="crc32", checksums=[f"{zlib.crc32(t.tobytes()) & 0xFFFFFFFF:08x}" for t in mixed])
    store.remove(manifest_key, force=True)
    store.put(manifest_key, json.dumps(record, sort_keys=True).encode())
    np.testing.assert_array_equal(EngramStore(layer, EngramStoreConfig(sizes, 8), store).lookup(ids),
                                  expected_rows(mixed, ids))  # (what this manifest names)
    assert es.remove_from_store(force=True) == 2


def test_a_layer_written_again_while_a_reader_checks_it_is_read_whole_from_the_new_populate(remote_store,
                                                                                             monkeypatch):
    """The heads are located before the manifest is read: a layer removed and populated again in between pairs the
    earlier heads with the later manifest. That is looked at again, not refused: the reader finds the new heads,
    checks them, and reads them."""
    from engram_store.tables._keyed import KeyedSource

    layer, sizes = next(_layers), [300, 200]
    first, second = make_tables(sizes, 8, 7), make_tables(sizes, 8, 8)
    writer = EngramStore(layer, EngramStoreConfig(sizes, 8), remote_store)
    writer.populate(first)
    reader = EngramStore(layer, EngramStoreConfig(sizes, 8), remote_store)
    read_manifest, rewritten = KeyedSource.read_manifest, []

    def written_again_first(self, lay, *args, **kwargs):  # the reader's first manifest read: after a new populate
        if self is reader._source and not rewritten:
            rewritten.append(True)
            writer.remove_from_store(force=True)
            writer.populate(second)
        return read_manifest(self, lay, *args, **kwargs)

    monkeypatch.setattr(KeyedSource, "read_manifest", written_again_first)
    ids = np.array([[[0, 199], [299, 0]]])
    np.testing.assert_array_equal(reader.lookup(ids), expected_rows(second, ids))
    assert rewritten
    monkeypatch.undo()
    assert writer.remove_from_store(force=True) == 2


def test_a_layer_whose_heads_are_gone_is_populated_again_with_a_manifest_of_its_own(remote_store):
    """The fault explorer (seed 980508): a layer's head was lost with its segment and its manifest was not; a
    populate wrote the head again and kept the old manifest, which named the lost table, so readers refused the
    layer as mixed. The manifest left of a layer whose every head is gone now goes with the populate."""
    layer, sizes = next(_layers), [300, 200]
    first, second = make_tables(sizes, 8, 9), make_tables(sizes, 8, 10)
    es = EngramStore(layer, EngramStoreConfig(sizes, 8), remote_store)
    es.populate(first)
    for key in es.get_store_keys():  # the heads gone, as with a segment that died; the manifest left
        remote_store.remove(key, force=True)
    es.populate(second)
    ids = np.array([[[0, 199], [299, 0]]])
    np.testing.assert_array_equal(EngramStore(layer, EngramStoreConfig(sizes, 8), remote_store).lookup(ids),
                                  expected_rows(second, ids))
    assert es.verify() == [0, 1]
    assert es.remove_from_store() == 2


def test_segment_killed_during_populate_leaves_no_key():
    with Cluster(segments=2, segment_size="256MiB", heartbeat_timeout_s=2.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=2000) as store:
            layer = 7
            sizes = [400_000] * 8  # 8 x 400k x 16 x 4 B = 205 MB: long enough to kill mid-way
            tables = make_tables(sizes, 16, 0)
            es = EngramStore(layer, EngramStoreConfig(sizes, 16), store)
            done = threading.Event()
            error = []

            def populate():
                try:
                    es.populate(tables)
                except Exception as exc:
                    error.append(exc)
                finally:
                    done.set()

            t = threading.Thread(target=populate)
            t.start()
            # wait until the upload has begun (a write is in progress on the master), then kill
            while not done.is_set() and store.status()["pending"] == 0:
                pass
            c.segments[0].kill()
            t.join(timeout=120)
            assert done.is_set()
            assert error, "populate succeeded although a segment died under it"
            assert store.batch_is_exist(es.get_store_keys()) == [False] * 8
            status = store.status()
            assert status["pending"] == 0 and status["objects"] == 0
            assert all(s["used"] == 0 for s in status["segments"])


def test_segment_of_a_size_not_divisible_by_four_serves_local_lookups():
    with DistributedStore.embedded(segment_size=(1 << 20) + 3) as store:
        es = EngramStore(1, EngramStoreConfig([101, 103], 4), store)
        tables = make_tables([101, 103], 4, 9)
        es.populate(tables)
        ids = random_ids(np.random.default_rng(1), [101, 103], 2, 5)
        np.testing.assert_array_equal(es.lookup(ids), expected_rows(tables, ids))


@pytest.mark.parametrize("local_direct", [True, False])
def test_a_layer_repopulated_by_another_client_never_yields_foreign_rows(remote_cluster, local_direct):
    """Reader B caches the placement; writer A removes the layer, fills the space, repopulates it.

    B must never return the filler's bytes: the master holds removed space back for longer than B's placement
    check interval, and B re-resolves the placement when it changed.
    """
    sizes = [64]
    layer = next(_layers)
    with DistributedStore.connect(remote_cluster.address, local_direct=local_direct) as a, \
            DistributedStore.connect(remote_cluster.address, local_direct=local_direct) as b:
        writer = EngramStore(layer, EngramStoreConfig(sizes, 2), a)
        reader = EngramStore(layer, EngramStoreConfig(sizes, 2), b)
        writer.populate([np.ones((64, 2), dtype=np.float32)])
        ids = np.zeros((1, 1, 1), dtype=np.int64)
        assert reader.lookup(ids)[0, 0, 0].tolist() == [1.0, 1.0]
        writer.remove_from_store(force=True)
        a.put(f"filler-{layer}", np.full(64 * 2, 9, dtype=np.float32).tobytes(), replica_num=2)
        writer.populate([np.full((64, 2), 2, dtype=np.float32)])
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # old rows for up to the check interval, then the new ones
            try:
                row = reader.lookup(ids)[0, 0, 0].tolist()
            except ObjectNotFound:
                continue
            assert row in ([1.0, 1.0], [2.0, 2.0]), f"read foreign bytes {row}"
            if row == [2.0, 2.0]:
                break
        else:
            pytest.fail("the reader never saw the repopulated layer")
        writer.remove_from_store(force=True)
        a.remove(f"filler-{layer}", force=True)



def test_a_layer_removed_by_another_client_is_refused_at_the_next_remote_read(remote_cluster):
    """The remover tells the segments, naming each table's put: a reader whose placement is fresh is refused at
    its next read (no wait for its placement check), and then finds the layer populated again at once."""
    sizes = [64, 32]
    layer = next(_layers)
    with DistributedStore.connect(remote_cluster.address, local_direct=False) as a, \
            DistributedStore.connect(remote_cluster.address, local_direct=False) as b:
        writer = EngramStore(layer, EngramStoreConfig(sizes, 2), a)
        reader = EngramStore(layer, EngramStoreConfig(sizes, 2), b)
        writer.populate([np.ones((n, 2), dtype=np.float32) for n in sizes])
        ids = np.zeros((1, 1, 2), dtype=np.int64)
        assert reader.lookup(ids).tolist() == [[[[1.0, 1.0]] * 2]]
        writer.remove_from_store(force=True)
        with pytest.raises(ObjectNotFound):
            reader.lookup(ids)
        writer.populate([np.full((n, 2), 2, dtype=np.float32) for n in sizes])
        assert reader.lookup(ids).tolist() == [[[[2.0, 2.0]] * 2]]
        writer.remove_from_store(force=True)


def test_a_placement_read_only_through_checking_segments_is_not_asked_of_the_master_each_second(remote_store,
                                                                                                monkeypatch):
    """Every table read through a segment that checks the put named: the placement outlives the 1 s a mapped one
    is used for without a check, so a lookup at a model step's cadence wakes no placement check."""
    sizes = [40, 50]
    es = EngramStore(next(_layers), EngramStoreConfig(sizes, 4), remote_store)
    tables = make_tables(sizes, 4, seed=9)
    es.populate(tables)
    ids = np.stack([np.arange(3) % n for n in sizes], axis=-1).reshape(1, 3, 2)
    try:
        np.testing.assert_array_equal(es.lookup(ids), expected_rows(tables, ids))
        asked = []
        locate = remote_store.locate
        monkeypatch.setattr(remote_store, "locate", lambda *a, **k: asked.append(a) or locate(*a, **k))
        time.sleep(1.2)  # past the 1 s after which a placement with a mapped table is checked before use
        for _ in range(3):
            np.testing.assert_array_equal(es.lookup(ids), expected_rows(tables, ids))
        assert asked == []
    finally:
        es.remove_from_store(force=True)


# ---- row formats, head shards and the layout manifest ----------------------------------------------------


@pytest.mark.parametrize("row_format, dim", [("float16", 7), ("bfloat16", 16), ("bytes", 264), ("float32", 3)])
@pytest.mark.parametrize("path", ["local", "remote"])
def test_row_formats_read_back_exactly(local_store, remote_store, row_format, dim, path):
    store = local_store if path == "local" else remote_store
    config = EngramStoreConfig([301, 307], dim, row_format=row_format)
    rng = np.random.default_rng(len(row_format) * dim)
    tables = [rng.integers(0, 256, size=(n, config.row_bytes), dtype=np.uint8).view(config.dtype) for n in (301, 307)]
    es = EngramStore(next(_layers), config, store)
    es.populate(tables)
    ids = random_ids(rng, [301, 307], 3, 9, dup_pool=5)
    rows = es.lookup(ids)
    assert rows.dtype == config.dtype and rows.shape == (3, 9, 2, dim)
    assert rows.tobytes() == expected_rows(tables, ids).tobytes()
    assert es.verify() == [0, 1]
    with pytest.raises(InvalidType, match=f"row_format='{row_format}'"):
        EngramStore(next(_layers), config, store).populate(
            [t.view(np.uint8).astype(np.float64) for t in tables])
    es.remove_from_store()


def test_head_shards_populate_and_read_a_layer_together(remote_store):
    sizes = [101, 103, 107, 109]
    tables = make_tables(sizes, 4, 11)
    layer = next(_layers)
    config = EngramStoreConfig(sizes, 4)
    first = EngramStore(layer, config, remote_store, heads=[0, 1])
    second = EngramStore(layer, config, remote_store, heads=[2, 3])
    full = EngramStore(layer, config, remote_store)
    first.populate(tables[:2])
    ids = random_ids(np.random.default_rng(12), sizes, 2, 6)
    with pytest.raises(ObjectNotFound, match="not published"):  # half the heads: not a layer yet
        full.lookup(ids)
    second.populate(tables[2:])  # the last shard publishes the manifest
    np.testing.assert_array_equal(full.lookup(ids), expected_rows(tables, ids))
    np.testing.assert_array_equal(second.lookup(ids[..., 2:]), expected_rows(tables[2:], ids[..., 2:]))
    assert second.get_heads() == [2, 3] and second.get_table_vocab_sizes() == [107, 109]
    assert second.verify() == [2, 3] and full.verify() == [0, 1, 2, 3]  # every shard's checksums, from the master
    with pytest.raises(InvalidArgument, match="H = 2"):
        second.lookup(ids)
    with pytest.raises(InvalidArgument, match=r"heads\[0\]: expected a head index in \[0, 4\)"):
        EngramStore(layer, config, remote_store, heads=[4])
    with pytest.raises(InvalidArgument, match="increasing list of distinct"):
        EngramStore(layer, config, remote_store, heads=[1, 1])
    assert first.remove_from_store() == 2 and second.remove_from_store() == 2


def test_an_unpublished_or_differently_shaped_layer_is_refused(local_store):
    sizes = [211, 223]
    layer = next(_layers)
    tables = make_tables(sizes, 8, 13)
    es = EngramStore(layer, EngramStoreConfig(sizes, 8), local_store)
    # A populate that died after its tables and before its manifest: the tables are there, the layer is not.
    local_store.batch_put_from(es.get_store_keys(), tables)
    with pytest.raises(ObjectNotFound, match=f"layer {layer} is not published"):
        es.lookup(np.zeros((1, 1, 2), dtype=np.int64))
    with pytest.raises(ObjectExists):
        es.populate(tables)
    assert es.remove_from_store(force=True) == 2
    es.populate(tables)
    for other, field in ((EngramStoreConfig(sizes, 8, row_format="float16"), "row_format"),
                         (EngramStoreConfig([211, 227], 8), "table_vocab_sizes")):
        with pytest.raises(ConfigError, match=f"stored with {field}="):
            EngramStore(layer, other, local_store).lookup(np.zeros((1, 1, 2), dtype=np.int64))
    # An interrupted populate rolls back everything it wrote, the manifest included.
    es.remove_from_store()
    source = es._source  # the interruption strikes between the tables and their manifest
    source.publish = lambda *a: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        es.populate(tables)
    del source.publish
    assert local_store.batch_is_exist(es.get_store_keys() + [f"engram:l{layer}:manifest"]) == [False] * 3


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(g=geometry, cache_rows=st.integers(1, 300), rounds=st.integers(1, 4))
def test_row_cache_returns_the_same_rows_and_counts_hits(remote_store, g, cache_rows, rounds):
    sizes, dim = g["sizes"], g["dim"]
    tables = make_tables(sizes, dim, g["seed"])
    es = EngramStore(next(_layers), EngramStoreConfig(sizes, dim), remote_store,
                     row_cache_bytes=cache_rows * (dim * 4 + 8))
    es.populate(tables)
    rng = np.random.default_rng(g["seed"])
    for _ in range(rounds):
        ids = random_ids(rng, sizes, g["B"], g["L"], g["dups"])
        np.testing.assert_array_equal(es.lookup(ids), expected_rows(tables, ids))
        np.testing.assert_array_equal(es.lookup(ids), expected_rows(tables, ids))
    stats = es.stats()
    assert stats["cache_hits"] + stats["cache_misses"] > 0
    assert stats["remote_rows"] == stats["cache_misses"]
    es.remove_from_store()


def test_row_cache_serves_repeats_without_requests_and_forgets_a_repopulated_layer(remote_store):
    sizes = [1000, 1000]
    layer = next(_layers)
    es = EngramStore(layer, EngramStoreConfig(sizes, 4), remote_store, row_cache_bytes=1 << 20)
    es.populate(make_tables(sizes, 4, 1))
    ids = np.array([[[1, 2], [3, 4]]])
    es.lookup(ids)
    before = es.stats()
    es.lookup(ids)
    after = es.stats()
    assert after["remote_requests"] == before["remote_requests"]  # every row came from the cache
    assert after["cache_hits"] - before["cache_hits"] == 4
    es.remove_from_store()
    fresh = make_tables(sizes, 4, 2)
    es.populate(fresh)
    np.testing.assert_array_equal(es.lookup(ids), expected_rows(fresh, ids))
    with pytest.raises(InvalidArgument, match="row_cache_bytes"):
        EngramStore(layer, EngramStoreConfig(sizes, 4), remote_store, row_cache_bytes=-1)
    es.remove_from_store()


def test_lookup_into_a_buffer_not_aligned_for_wide_words(local_store):
    sizes = [97, 89]
    tables = make_tables(sizes, 16, 21)
    es = EngramStore(next(_layers), EngramStoreConfig(sizes, 16), local_store)
    es.populate(tables)
    ids = random_ids(np.random.default_rng(22), sizes, 2, 3)
    raw = np.zeros(2 * 3 * 2 * 16 * 4 + 4, dtype=np.uint8)
    out = raw[4:].view(np.float32).reshape(2, 3, 2, 16)  # 4-byte aligned, never 8-byte aligned
    assert out.ctypes.data % 8 == 4
    es.lookup_into(ids, out)
    np.testing.assert_array_equal(out, expected_rows(tables, ids))
    es.remove_from_store()


def test_small_local_prefetch_completes_at_once_and_errors_come_from_result(local_store):
    sizes = [50, 60]
    tables = make_tables(sizes, 4, 31)
    layer = next(_layers)
    es = EngramStore(layer, EngramStoreConfig(sizes, 4), local_store)
    es.populate(tables)
    ids = random_ids(np.random.default_rng(32), sizes, 2, 3)
    es.lookup(ids)  # resolves the (all local-direct) placement
    handle = es.prefetch(ids)
    assert handle.done()
    np.testing.assert_array_equal(handle.result(), expected_rows(tables, ids))
    big = random_ids(np.random.default_rng(33), sizes, 4, 1024)  # over the inline limit: a background read
    np.testing.assert_array_equal(es.prefetch(big).result(timeout=30), expected_rows(tables, big))
    es.remove_from_store(force=True)
    handle = es.prefetch(ids)  # the layer is gone: the read fails, and the failure is the handle's
    with pytest.raises(ObjectNotFound):
        handle.result(timeout=30)


def test_a_layer_lost_with_its_writers_segment_can_be_removed_and_populated_again():
    """A client that mounted the segment holding a layer exits: the layer is lost, not stuck."""
    config = EngramStoreConfig(table_vocab_sizes=[101, 103], embedding_dim=8)
    tables = make_tables(config.table_vocab_sizes, 8, seed=5)
    with Cluster(segments=0, heartbeat_timeout_s=5.0) as cluster:
        with DistributedStore.connect(cluster.address, segment_size="16MiB") as writer:
            EngramStore(7, config, writer).populate(tables)
        # The writer's segment went with it; another client finds the layer absent and can write it again.
        with DistributedStore.connect(cluster.address, segment_size="16MiB") as store:
            layer = EngramStore(7, config, store)
            assert store.batch_is_exist(layer.get_store_keys() + ["engram:l7:manifest"]) == [False] * 3
            layer.populate(tables)
            ids = np.array([[[100, 102]]], dtype=np.int64)
            assert np.array_equal(layer.lookup(ids), expected_rows(tables, ids))
            assert layer.remove_from_store() == 2
        with DistributedStore.connect(cluster.address, segment_size="16MiB") as store:
            layer = EngramStore(7, config, store)
            layer.populate(tables)
        with DistributedStore.connect(cluster.address, segment_size="16MiB") as store:
            # Lost again; remove_from_store(force=True) clears the losses, remove_all as well.
            layer = EngramStore(7, config, store)
            assert layer.remove_from_store(force=True) == 2
            with pytest.raises(ObjectNotFound):
                store.remove("engram:l7:h0")
            layer.populate(tables)
            assert np.array_equal(layer.lookup(ids), expected_rows(tables, ids))


@settings(max_examples=10, deadline=None)
@given(g=st.lists(st.tuples(st.lists(st.integers(1, 500), min_size=1, max_size=4), st.sampled_from([1, 4, 16]),
                            st.sampled_from(["float32", "float16", "bytes"])), min_size=1, max_size=3),
       B=st.integers(1, 4), L=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_layers_read_together_in_one_request_per_server(g, B, L, seed):
    """Several layers of one EngramStore, and several EngramStores, read in one request to their server."""
    with DistributedStore.embedded(segment_size="32MiB", local_direct=False) as store:
        configs = {10 + i: EngramStoreConfig(sizes, dim, row_format=fmt) for i, (sizes, dim, fmt) in enumerate(g)}
        rng = np.random.default_rng(seed)
        tables = {}
        with EngramStore(configs, store=store) as layers:
            assert layers.get_layer_ids() == sorted(configs)
            for lid, cfg in configs.items():
                tables[lid] = [rng.integers(0, 255, (n, cfg.row_bytes), dtype=np.uint8).view(cfg.dtype)
                               for n in cfg.table_vocab_sizes]
                layers.populate(tables[lid], layer=lid)
            ids = {lid: random_ids(rng, cfg.table_vocab_sizes, B, L) for lid, cfg in configs.items()}
            for lid in configs:  # resolve the placements (each takes a master request, not a segment one)
                layers.lookup(ids[lid], layer=lid)
            before = read_ranges_served(store)
            rows = layers.lookup_layers(ids)
            assert read_ranges_served(store) - before == 1
            for lid in configs:
                assert rows[lid].tobytes() == expected_rows(tables[lid], ids[lid]).tobytes()
            out = {lid: np.zeros_like(r) for lid, r in rows.items()}
            got = layers.prefetch_layers(ids, out=out).result(timeout=30)
            assert all(got[lid] is out[lid] and out[lid].tobytes() == rows[lid].tobytes() for lid in configs)
            # Separate stores on one client share the request too.
            singles = [EngramStore(lid, cfg, store) for lid, cfg in configs.items()]
            for single, lid in zip(singles, configs):
                single.lookup(ids[lid])  # resolves its placement (reading the manifest is a segment request)
            before = read_ranges_served(store)
            handles = prefetch_many([(single, ids[lid]) for single, lid in zip(singles, configs)])
            for handle, lid in zip(handles, configs):
                assert handle.result(timeout=30).tobytes() == rows[lid].tobytes()
            assert read_ranges_served(store) - before == 1
            with pytest.raises(InvalidArgument, match="unknown Engram layer 99"):
                layers.lookup(ids[min(configs)], layer=99)
            if len(configs) > 1:
                with pytest.raises(InvalidArgument, match="name one with layer="):
                    layers.lookup(ids[min(configs)])


class _ArrayInterface:
    """An object exposing only ``__array_interface__`` (as some GPU-framework host tensors do)."""

    def __init__(self, array):
        self._array = array
        self.__array_interface__ = array.__array_interface__


def test_lookup_into_and_prefetch_fill_any_writable_buffer_without_allocating(local_store):
    sizes, dim = [301, 257], 8
    tables = make_tables(sizes, dim, 41)
    ids = random_ids(np.random.default_rng(42), sizes, 3, 4)
    want = expected_rows(tables, ids)
    layer = next(_layers)
    EngramStore(layer, EngramStoreConfig(sizes, dim), local_store).populate(tables)
    try:
        es = EngramStore(layer, EngramStoreConfig(sizes, dim), local_store)
        shape = want.shape
        backing = np.zeros(shape, np.float32)
        raw = bytearray(want.nbytes)
        for buffer, view in ((memoryview(backing), backing),
                             (_ArrayInterface(backing), backing),
                             (raw, np.frombuffer(raw, np.float32).reshape(shape)),  # flat bytes of the right size
                             (memoryview(raw).cast("B"), np.frombuffer(raw, np.float32).reshape(shape))):
            view[...] = 0
            assert es.lookup_into(ids, buffer) is buffer
            assert np.array_equal(view, want)
            view[...] = 0
            handle = es.prefetch(ids, out=buffer, background=True)
            assert handle.result(timeout=30) is buffer and np.array_equal(view, want)
        for bad, match in ((backing.astype(np.float64), "float32"), (backing[:, ::-1], "C-contiguous"),
                           (bytes(want.nbytes), "writable float32 buffer"), ([[0.0]], "writable float32 buffer"),
                           (bytearray(want.nbytes - 4), "float32 array of shape")):
            with pytest.raises((InvalidArgument, InvalidType), match=match):
                es.lookup_into(ids, bad)
            with pytest.raises((InvalidArgument, InvalidType), match=match):
                es.prefetch(ids, out=bad)  # refused now, not from result()
        readonly = backing.copy()
        readonly.flags.writeable = False
        with pytest.raises(InvalidArgument, match="read-only"):
            es.lookup_into(ids, readonly)
        handle = es.prefetch(ids, background=False)
        assert handle.done() and np.array_equal(handle.result(), want)
    finally:
        EngramStore(layer, EngramStoreConfig(sizes, dim), local_store).remove_from_store(force=True)


def test_local_gathers_split_over_threads_equal_one_thread(local_store):
    sizes, dim = [5000, 4000, 3000], 16
    tables = make_tables(sizes, dim, 51)
    layer = next(_layers)
    EngramStore(layer, EngramStoreConfig(sizes, dim), local_store).populate(tables)
    try:
        threaded = EngramStore(layer, EngramStoreConfig(sizes, dim), local_store, threads=3)
        ids = random_ids(np.random.default_rng(52), sizes, 2, 4000)  # over the threshold: split over threads
        assert np.array_equal(threaded.lookup(ids), expected_rows(tables, ids))
        small = random_ids(np.random.default_rng(53), sizes, 1, 3)
        assert np.array_equal(threaded.lookup(small), expected_rows(tables, small))
        with pytest.raises(InvalidArgument, match="threads"):
            EngramStore(layer, EngramStoreConfig(sizes, dim), local_store, threads=0)
    finally:
        EngramStore(layer, EngramStoreConfig(sizes, dim), local_store).remove_from_store(force=True)


def test_local_tables_are_in_place_views_or_none_when_a_head_is_remote(local_store, remote_store, tmp_path):
    config = EngramStoreConfig(table_vocab_sizes=[11, 13, 7], embedding_dim=24, row_format="bytes")
    rng = np.random.default_rng(7)
    tables = [rng.integers(0, 256, (n, 24), dtype=np.uint8) for n in config.table_vocab_sizes]

    def same(views):
        assert views is not None and len(views) == 3
        for view, table in zip(views, tables):
            assert view.shape == table.shape and view.dtype == np.uint8 and not view.flags.writeable
            assert np.array_equal(view, table)

    bound = EngramStore(next(_layers), config)
    bound.bind_local(tables)
    same(bound.local_tables())
    assert np.shares_memory(bound.local_tables()[1], tables[1])  # the caller's arrays, in place

    on_disk = EngramStore(next(_layers), config, local_dir=tmp_path)
    on_disk.populate(tables)
    same(on_disk.local_tables())

    lid = next(_layers)
    for store, here in ((local_store, True), (remote_store, False)):
        layer = EngramStore(lid, config, store)
        layer.populate(tables)
        try:
            if here:
                same(layer.local_tables())
            else:
                assert layer.local_tables() is None
        finally:
            layer.remove_from_store(force=True)

    with pytest.raises(NotConnected):
        EngramStore(next(_layers), config).local_tables()


class _DLPackTensor:
    """A tensor that offers its memory only through DLPack (as torch and JAX CPU tensors do)."""

    def __init__(self, array, device=(1, 0)):
        self._array, self._device = array, device

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._device


@pytest.mark.parametrize("path", ["local", "remote"])
def test_lookups_fill_dlpack_tensors_in_place(local_store, remote_store, path):
    store = local_store if path == "local" else remote_store
    sizes, dim = [301, 257], 8
    tables = make_tables(sizes, dim, 43)
    ids = random_ids(np.random.default_rng(44), sizes, 3, 4)
    want = expected_rows(tables, ids)
    layer = EngramStore(next(_layers), EngramStoreConfig(sizes, dim), store)
    layer.populate(tables)
    try:
        backing = np.zeros(want.shape, np.float32)
        tensor = _DLPackTensor(backing)
        assert layer.lookup_into(ids, tensor) is tensor and np.array_equal(backing, want)
        backing[...] = 0
        assert layer.prefetch(ids, out=tensor, background=True).result(timeout=30) is tensor
        assert np.array_equal(backing, want)
        flat = np.zeros(want.nbytes, np.uint8)  # a flat byte tensor of the right size is viewed as the rows
        layer.lookup_into(ids, _DLPackTensor(flat))
        assert np.array_equal(flat.view(np.float32).reshape(want.shape), want)
        with pytest.raises(InvalidArgument, match="DLPack device type 2"):
            layer.lookup_into(ids, _DLPackTensor(backing, device=(2, 0)))  # a CUDA tensor
        with pytest.raises(InvalidArgument, match="float32 array of shape"):
            layer.lookup_into(ids, _DLPackTensor(np.zeros((2, 2), np.float32)))
    finally:
        layer.remove_from_store(force=True)


def test_a_closed_engram_store_still_removes_and_reads_synchronously(remote_store):
    sizes, dim = [31, 37], 4
    tables = make_tables(sizes, dim, 45)
    ids = random_ids(np.random.default_rng(46), sizes, 2, 3)
    layer = EngramStore(next(_layers), EngramStoreConfig(sizes, dim), remote_store)
    layer.populate(tables)
    layer.lookup(ids)
    layer.close()
    np.testing.assert_array_equal(layer.lookup(ids), expected_rows(tables, ids))  # resolved again
    with pytest.raises(NotConnected, match="closed"):
        layer.prefetch(ids, background=True)  # no background reads once closed
    assert layer.remove_from_store() == 2
    layer.close()


def test_bfloat16_rows_fill_torch_and_ml_dtypes_bfloat16_buffers(local_store):
    """NumPy has no bfloat16, so its DLPack import refuses such tensors: they are viewed through 16-bit integers."""
    import ml_dtypes

    sizes, dim = [41, 43], 16
    bits = [np.random.default_rng(47 + h).integers(0, 1 << 16, (n, dim), dtype=np.uint16) for h, n in enumerate(sizes)]
    ids = random_ids(np.random.default_rng(48), sizes, 2, 3)
    want = expected_rows(bits, ids)
    with EngramStore(next(_layers), EngramStoreConfig(sizes, dim, row_format="bfloat16"), None) as layer:
        layer.bind_local(bits)
        out = np.zeros(want.shape, ml_dtypes.bfloat16)
        assert layer.lookup_into(ids, out) is out and np.array_equal(out.view(np.uint16), want)
        torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install -e '.[torch]')")
        tensor = torch.zeros(want.shape, dtype=torch.bfloat16)
        assert layer.lookup_into(ids, tensor) is tensor
        assert np.array_equal(tensor.view(torch.int16).numpy().view(np.uint16), want)
    with EngramStore(next(_layers), EngramStoreConfig(sizes, dim), None) as layer:  # float32 rows
        layer.bind_local([b.astype(np.float32) for b in bits])
        with pytest.raises(InvalidArgument, match=r"got bfloat16 .* \(this layer's rows are float32\)"):
            layer.lookup_into(ids, torch.zeros(want.shape, dtype=torch.bfloat16))


@pytest.mark.parametrize("where", ["local_dir", "disk_dir"])
def test_tables_in_files_populate_from_fill_functions_chunk_by_chunk(tmp_path, where):
    sizes, dim = [300, 257], 16
    tables = [np.random.default_rng(49 + h).integers(0, 256, (n, dim), dtype=np.uint8) for h, n in enumerate(sizes)]
    calls = []

    def fill_from(table):
        def fill(start, out):
            calls.append((start, out.shape))
            out[:] = table[start:start + out.shape[0]]
        return fill

    config = EngramStoreConfig(sizes, dim, row_format="bytes")
    with EngramStore(next(_layers), config, None, **{where: tmp_path}) as layer:
        layer.populate([fill_from(t) for t in tables])
        ids = random_ids(np.random.default_rng(50), sizes, 2, 3)
        np.testing.assert_array_equal(layer.lookup(ids), expected_rows(tables, ids))
    assert calls and all(shape[1] == dim for _, shape in calls)
    with EngramStore(next(_layers), config, None) as layer:
        with pytest.raises(InvalidType, match=r"embedding_buffers\[0\]: expected a bytes NumPy array, got function"):
            layer.bind_local([fill_from(t) for t in tables])
