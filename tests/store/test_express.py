"""The express lookup (``StoreSource.express``): a remote layer read in one kernel call straight from ``lookup``.

Whatever the caller passes, it returns exactly what the general path returns (rows equal NumPy's, the same errors,
``out`` filled in place) and counts every lookup, from any number of threads; what it does not take (another dtype,
shape or layout, a caller buffer it cannot fill in place) goes the general way.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from suite_helpers import run_threads
from engram_store import DistributedStore, EngramStore, EngramStoreConfig, InvalidArgument
from engram_store.tables._layout import LookupCounters
from engram_store.testing import Cluster

pytestmark = pytest.mark.timeout(240)

SIZES = [101, 103, 107, 109]
DIM = 8


@pytest.fixture(scope="module")
def remote():
    """A layer on one segment process, read over the network by a client whose lookups take the express path."""
    config = EngramStoreConfig(SIZES, DIM)
    tables = [np.random.default_rng(h).random((n, DIM), dtype=np.float32) for h, n in enumerate(SIZES)]
    with Cluster(segments=1, segment_size="16MiB") as cluster, \
            DistributedStore.connect(cluster.address, local_direct=False) as store:
        layer = EngramStore(1, config, store)
        layer.populate(tables)
        layer.lookup(np.zeros((1, 1, len(SIZES)), np.int64))  # resolves the placement
        yield layer, tables


def _expected(tables, ids):
    return np.stack([tables[h][ids[..., h]] for h in range(len(tables))], axis=-2)


def _ids(rng, b, l):
    return np.stack([rng.integers(0, n, (b, l)) for n in SIZES], axis=-1)


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 9), l=st.integers(1, 5), seed=st.integers(0, 2**32 - 1),
       form=st.sampled_from(["int64", "int32", "list", "strided", "fortran"]),
       into=st.sampled_from([None, "array", "flat bytes", "read-only"]))
def test_every_lookup_returns_numpys_rows_whichever_path_it_takes(remote, b, l, seed, form, into):
    layer, tables = remote
    ids = _ids(np.random.default_rng(seed), b, l)
    given_ids = {"int64": ids, "int32": ids.astype(np.int32), "list": ids.tolist(),
                 "strided": np.repeat(ids, 2, axis=1)[:, ::2], "fortran": np.asfortranarray(ids)}[form]
    expected = _expected(tables, ids)
    if into is None:
        np.testing.assert_array_equal(layer.lookup(given_ids), expected)
        return
    out = np.full(expected.shape, -1, np.float32)
    target = out.reshape(-1).view(np.uint8) if into == "flat bytes" else out
    if into == "read-only":
        out.flags.writeable = False
        with pytest.raises(InvalidArgument, match="read-only"):
            layer.lookup_into(given_ids, out)
        return
    assert layer.lookup_into(given_ids, target) is target
    np.testing.assert_array_equal(out, expected)


def test_what_the_express_path_takes_and_what_it_leaves_to_the_general_one(remote):
    layer, tables = remote
    lay, source = layer._layer(None), layer._source
    ids = _ids(np.random.default_rng(2), 3, 2)
    # Taken whichever way the read goes (on a loaded host the module's earlier tests may outlast the placement's
    # stale limit: the read then asks the master first).
    np.testing.assert_array_equal(source.express(lay, ids, None), _expected(tables, ids))
    out = np.empty(ids.shape + (DIM,), np.float32)
    assert source.express(lay, ids, out) is out
    np.testing.assert_array_equal(out, _expected(tables, ids))
    for other, buffer in ((ids.astype(np.int32), None), (ids.tolist(), None), (ids[None], None), (ids, out[:1]),
                          (ids, out.astype(np.float64)), (ids, out.reshape(-1).view(np.uint8)),
                          (np.asfortranarray(ids), None)):
        assert source.express(lay, other, buffer) is None
    ids[0, 0, 0] = SIZES[0]  # taken (its arguments are): the kernel sends nothing, the read's range check names it
    with pytest.raises(InvalidArgument, match=r"row_ids\[0, 0, 0\] = 101 is out of range"):
        source.express(lay, ids, None)


def test_a_layer_read_another_way_is_taken_too(remote):
    """A row cache keeps a layer off the one-call read: the express entry hands it to the same decision, which
    reads it the general way (the second lookup from the cache)."""
    layer, tables = remote
    ids = _ids(np.random.default_rng(3), 2, 3)
    with EngramStore(1, EngramStoreConfig(SIZES, DIM), layer.store, row_cache_bytes=1 << 20) as cached:
        lay, source = cached._layer(None), cached._source
        for _ in range(2):
            np.testing.assert_array_equal(source.express(lay, ids, None), _expected(tables, ids))
        distinct = sum(np.unique(ids[..., h]).size for h in range(len(SIZES)))  # rows the cache keeps, per head
        stats = cached.stats()
        assert (stats["lookups"], stats["cache_misses"], stats["cache_hits"]) == (2, distinct, distinct)
        assert lay.state.lean is None


def test_an_id_out_of_range_is_named_and_nothing_is_written(remote):
    layer, tables = remote
    ids = _ids(np.random.default_rng(1), 2, 3)
    ids[1, 2, 3] = SIZES[3]
    out = np.full(ids.shape + (DIM,), -1, np.float32)
    with pytest.raises(InvalidArgument, match=r"row_ids\[1, 2, 3\] = 109 is out of range: head 3 .* 109 rows"):
        layer.lookup_into(ids, out)
    assert (out == -1).all()
    ids[1, 2, 3] = -1
    with pytest.raises(InvalidArgument, match=r"row_ids\[1, 2, 3\] = -1 is out of range"):
        layer.lookup(ids)
    np.testing.assert_array_equal(layer.lookup(ids[:1]), _expected(tables, ids[:1]))  # the channel still reads


def test_lookups_from_many_threads_are_all_counted(remote):
    layer, tables = remote
    threads, calls = 4, 3 * LookupCounters.FOLD_EVERY // 4 + 7  # past a fold, with lookups left over
    ids = [_ids(np.random.default_rng(t), 1 + t, 2) for t in range(threads)]
    layer.stats(reset=True)

    def work(t):
        for _ in range(calls):
            np.testing.assert_array_equal(layer.lookup(ids[t]), _expected(tables, ids[t]))

    run_threads(work, threads, 120, "lookups")
    stats = layer.stats()
    rows = calls * sum(i.size for i in ids)
    assert stats["lookups"] == threads * calls and stats["rows"] == rows
    assert stats["remote_rows"] == rows and stats["remote_bytes"] == rows * DIM * 4
    assert stats["remote_requests"] == threads * calls


@settings(max_examples=30, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, 5000), max_size=300), min_size=1, max_size=4))
def test_counters_kept_aside_add_up_exactly(batches):
    """add_remote from several threads at once, folded while they append: the sums are exact."""
    counters = LookupCounters(row_bytes=3)
    counters.add(lookups=1, rows=2, remote_rows=2, remote_bytes=6)
    start = threading.Barrier(len(batches) + 1)

    def work(rows):
        start.wait()
        for r in rows:
            counters.add_remote(r)

    workers = [threading.Thread(target=work, args=(rows,)) for rows in batches]
    for w in workers:
        w.start()
    start.wait()
    seen = counters.snapshot()  # folds while the workers append
    for w in workers:
        w.join(30)
    assert seen["lookups"] <= 1 + sum(map(len, batches))
    total = sum(map(sum, batches))
    assert counters.snapshot() == {**dict.fromkeys(LookupCounters.FIELDS, 0), "lookups": 1 + sum(map(len, batches)),
                                   "rows": 2 + total, "remote_rows": 2 + total, "remote_bytes": 6 + 3 * total,
                                   "remote_requests": sum(map(len, batches))}
    counters.add_remote(5)
    counters.reset()
    assert counters.snapshot() == dict.fromkeys(LookupCounters.FIELDS, 0)
